"""MiniMax-M2 (M2 / M2.1 / M2.5: `MiniMaxM2ForCausalLM`): its config as released, the refusals of what transformers'
implementation does not run, and bf16 from disk against the fp32 oracle. Logit equality with transformers + PEFT
(fp32, every adapter layout, the Hub checkpoint spelling) runs with the other families (tests/e2e/test_oracle.py,
tests/layers/test_forward.py, tests/lora/test_adapters.py, tests/layers/test_weights.py)."""

from __future__ import annotations

import pytest
import torch

from moelora import LLM
from moelora.config import ModelConfig
from moelora.errors import ConfigError
from tests.helpers.oracle import tiny_hf_config, tiny_hf_model

ARCH = "MiniMaxM2ForCausalLM"
# The fields moelora reads of the released config.json (transformers' MiniMaxM2Config defaults are the same model):
# the partial rotary spelled `rotary_dim`, the FP8 checkpoint's block quantization.
RELEASED = dict(
    architectures=[ARCH], hidden_size=3072, intermediate_size=1536, num_hidden_layers=62, num_attention_heads=48,
    num_key_value_heads=8, head_dim=128, num_local_experts=256, num_experts_per_tok=8, rotary_dim=64,
    rope_theta=5000000, max_position_embeddings=196608, rms_norm_eps=1e-6, vocab_size=200064, hidden_act="silu",
    scoring_func="sigmoid", use_qk_norm=True, qk_norm_type="per_layer", use_routing_bias=True, torch_dtype="bfloat16",
    shared_intermediate_size=0, num_mtp_modules=3, attn_type_list=[1] * 62,
    quantization_config={"quant_method": "fp8", "fmt": "float8_e4m3fn", "activation_scheme": "dynamic",
                         "weight_block_size": [128, 128]})


def test_released_config_parses():
    cfg = ModelConfig.from_dict(dict(RELEASED))
    assert (cfg.family, cfg.attention, cfg.qk_norm, cfg.rotary_dim, cfg.rope_theta, cfg.head_dim) == (
        "minimax_m2", "gqa", "whole", 64, 5e6, 128)
    assert (cfg.topk_method, cfg.n_group, cfg.topk_group, cfg.norm_topk_prob, cfg.router_correction_bias,
            cfg.routed_scaling_factor, cfg.num_experts, cfg.top_k) == ("noaux_tc", 1, 1, True, True, 1.0, 256, 8)
    assert cfg.sparse_layers == tuple(range(62)) and cfg.moe_intermediate_size == 1536
    assert cfg.shared_expert_intermediate_size == cfg.shared_experts_intermediate_size == 0
    assert cfg.quantization is not None and cfg.quantization.block == (128, 128)


def _raw(**changes) -> dict:
    raw = tiny_hf_config("minimax_m2").to_dict()
    raw["architectures"] = [ARCH]
    raw.update(changes)
    return raw


@pytest.mark.parametrize("changes,needle", [
    ({"use_qk_norm": False}, "use_qk_norm"),
    ({"qk_norm_type": "per_head"}, "qk_norm_type"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"use_routing_bias": False}, "use_routing_bias"),
    ({"attn_type_list": [1, 0, 1]}, "lightning"),
    ({"routed_scaling_factor": 2.0}, "routed_scaling_factor"),
    ({"shared_intermediate_size": 3072}, "shared_intermediate_size"),
    ({"hidden_act": "gelu"}, "gelu"),
])
def test_unsupported_values_are_refused(changes, needle):
    with pytest.raises(ConfigError, match=needle):
        ModelConfig.from_dict(_raw(**changes))


def test_rotary_dim_spelling_equals_the_factor():
    head_dim = tiny_hf_config("minimax_m2").head_dim
    legacy = ModelConfig.from_dict(_raw(rope_parameters={"rope_type": "default", "rope_theta": 1e4}, rotary_dim=8))
    assert legacy.partial_rotary_factor == 8 / head_dim and legacy.rotary_dim == 8
    full = ModelConfig.from_dict(_raw(rope_parameters={"rope_type": "default", "rope_theta": 1e4}))
    assert full.rotary_dim == head_dim  # transformers' default: the whole head


def test_bfloat16_from_disk_tracks_fp32_oracle(tmp_path):
    """bf16 end to end through `LLM` from the Hub spelling (router and its correction bias kept fp32). A sanity bound
    as the other families' (bf16 rounding moves these logits by hundredths; a dtype or name bug by whole units)."""
    hf = tiny_hf_model("minimax_m2", seed=13)
    hf.save_pretrained(str(tmp_path))
    llm = LLM(tmp_path, device="cpu", dtype="bfloat16")
    gate = llm.engine.model.model.layers[0].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(gate.e_score_correction_bias, hf.model.layers[0].mlp.e_score_correction_bias)
    ids = torch.randint(0, hf.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids).logits[0]
    assert (llm.logits(ids.tolist())[0] - ref).abs().max() < 0.25
