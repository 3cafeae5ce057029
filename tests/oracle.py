"""The test oracle: tiny transformers models built locally (no hub), one per family.

Routers get std-0.3 weights so top-k has a margin; every other weight is random too, so no
zero hides a wrong index. Sizes are deliberately awkward (I != H/2, odd head counts).
"""

from __future__ import annotations

import torch

FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")


def tiny_hf_config(family: str, **overrides):
    """A small transformers config of `family`; `overrides` replace any field."""
    import transformers as tf

    common = dict(vocab_size=97, hidden_size=48, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, num_experts_per_tok=2,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "qwen3_moe":
        cfg = dict(common, head_dim=16, num_experts=6, moe_intermediate_size=40, intermediate_size=72,
                   norm_topk_prob=True, mlp_only_layers=[1], decoder_sparse_step=1,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        cls = tf.Qwen3MoeConfig
    elif family == "qwen2_moe":
        cfg = dict(common, num_experts=5, moe_intermediate_size=40, intermediate_size=72,
                   shared_expert_intermediate_size=56, norm_topk_prob=False, decoder_sparse_step=1,
                   mlp_only_layers=[2])
        cls = tf.Qwen2MoeConfig
    elif family == "mixtral":
        cfg = dict(common, num_local_experts=4, intermediate_size=40)
        cls = tf.MixtralConfig
    elif family == "olmoe":
        cfg = dict(common, num_experts=6, intermediate_size=40, norm_topk_prob=False)
        cls = tf.OlmoeConfig
    else:
        raise ValueError(family)
    cfg.update(overrides)
    return cls(**cfg)


def randomize_(model, seed: int = 0, std: float = 0.08, router_std: float = 0.3) -> None:
    """Fill every parameter with random values (routers wider, norms near 1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith("mlp.gate.weight"):
                p.copy_(router_std * noise)
            else:
                p.copy_(std * noise)


def tiny_hf_model(family: str, *, seed: int = 0, dtype=torch.float32, **overrides):
    """A randomised tiny `*ForCausalLM` of `family` in eval mode."""
    import transformers as tf

    cfg = tiny_hf_config(family, **overrides)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    randomize_(model, seed)
    return model.eval()
