"""The test oracle: tiny transformers models built locally (no hub), one per family.

Routers get std-0.3 weights so top-k has a margin; every other weight is random too, so no
zero hides a wrong index. Sizes are deliberately awkward (I != H/2, odd head counts).
"""

from __future__ import annotations

import torch

FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "minimax_m2")
# Grouped routers, shared experts, dense first layers; DeepSeek with multi-head latent attention.
DEEPSEEK_GLM_FAMILIES = ("deepseek_v2", "deepseek_v3", "glm4_moe", "glm4_moe_lite", "dots1")


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
    elif family == "minimax_m2":  # whole q / k norms, partial rotary, a biased sigmoid router of one group
        cfg = dict(common, head_dim=16, num_local_experts=6, intermediate_size=40,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
        cls = tf.MiniMaxM2Config
    elif family in DEEPSEEK_GLM_FAMILIES:
        cfg, cls = _deepseek_glm_config(family, common)
    else:
        raise ValueError(family)
    cfg.update(overrides)
    return cls(**cfg)


def _deepseek_glm_config(family: str, common: dict):
    """Awkward sizes: v_head_dim != qk_nope_head_dim, odd head counts, groups that bind."""
    import transformers as tf

    moe = dict(moe_intermediate_size=16, intermediate_size=40, first_k_dense_replace=1, n_shared_experts=2)
    mla = dict(kv_lora_rank=20, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10)
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if family == "deepseek_v2":
        cfg = dict(common, **moe, **mla, num_attention_heads=3, num_key_value_heads=3, q_lora_rank=None,
                   n_routed_experts=6, topk_method="group_limited_greedy", n_group=3, topk_group=2,
                   routed_scaling_factor=1.5, norm_topk_prob=False, rope_parameters=rope)
        return cfg, tf.DeepseekV2Config
    if family == "deepseek_v3":
        cfg = dict(common, **dict(moe, n_shared_experts=1), **mla, num_key_value_heads=4, q_lora_rank=24,
                   n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3, routed_scaling_factor=2.5,
                   norm_topk_prob=True, rope_interleave=True, attention_bias=True, rope_parameters=rope)
        return cfg, tf.DeepseekV3Config
    if family == "glm4_moe_lite":  # GLM-4.7-Flash: V3's MLA with q_lora, GLM's router; dense layers by type list
        moe_lite = {k: v for k, v in moe.items() if k != "first_k_dense_replace"}
        cfg = dict(common, **dict(moe_lite, n_shared_experts=1), **mla, num_key_value_heads=4, q_lora_rank=24,
                   n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=3, routed_scaling_factor=1.8,
                   norm_topk_prob=True, rope_interleave=True, mlp_layer_types=["dense", "sparse", "sparse"],
                   rope_parameters=rope)
        return cfg, tf.Glm4MoeLiteConfig
    if family == "dots1":  # dots.llm1: Qwen3's attention over DeepSeek-V3's blocks (no renormalisation here)
        cfg = dict(common, **moe, head_dim=16, n_routed_experts=6, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                   norm_topk_prob=False, sliding_window=None, rope_parameters=rope)
        return cfg, tf.Dots1Config
    cfg = dict(common, **moe, head_dim=16, n_routed_experts=6, n_group=2, topk_group=1, routed_scaling_factor=1.8,
               norm_topk_prob=True, use_qk_norm=True, attention_bias=True,
               rope_parameters=dict(rope, partial_rotary_factor=0.5))
    return cfg, tf.Glm4MoeConfig


def randomize_(model, seed: int = 0, std: float = 0.08, router_std: float = 0.3, bias_std: float = 0.1) -> None:
    """Fill every parameter with random values (routers wider, norms near 1), and the router
    correction bias buffers (DeepSeek-V3, GLM) too."""
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
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(bias_std * torch.randn(b.shape, generator=g, dtype=torch.float64))


def tiny_hf_model(family: str, *, seed: int = 0, dtype=torch.float32, **overrides):
    """A randomised tiny `*ForCausalLM` of `family` in eval mode."""
    import transformers as tf

    cfg = tiny_hf_config(family, **overrides)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    randomize_(model, seed)
    return model.eval()


def tiny_model_cache(first_seed: int):
    """`get(family, **overrides)`: `tiny_hf_model` built once a (family, overrides) and kept, the n-th new one with
    seed `first_seed` + n (a test module's shared models)."""
    cache = {}

    def get(family: str, **overrides):
        key = (family, tuple(sorted(overrides.items())))
        if key not in cache:
            cache[key] = tiny_hf_model(family, seed=len(cache) + first_seed, **overrides)
        return cache[key]

    return get
