"""The default step token budget (`EngineConfig.max_num_batched_tokens` None): 8192 on a GPU of >= 70 GiB (the
H100 / H200 class, as vLLM's API server), else 2048 (docs/performance.md, "Prefill chunk size")."""

from __future__ import annotations

import pytest

from moelora.cli import build_parser
from moelora.config import ModelConfig
from moelora.engine.config import EngineConfig, default_max_num_batched_tokens
from moelora.errors import ConfigError

TINY = ModelConfig(family="qwen3_moe", vocab_size=64, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                   head_dim=8, intermediate_size=32, moe_intermediate_size=8, num_experts=4, top_k=2,
                   norm_topk_prob=True, max_position_embeddings=64).resolve()


def test_the_default_follows_the_gpus_memory():
    gib = 2**30
    assert default_max_num_batched_tokens(None) == 2048  # the CPU
    assert default_max_num_batched_tokens(24 * gib) == 2048
    assert default_max_num_batched_tokens(70 * gib - 1) == 2048
    assert default_max_num_batched_tokens(70 * gib) == 8192
    assert default_max_num_batched_tokens(int(139.8 * gib)) == 8192  # an H200


def test_resolve_fills_the_default_and_keeps_a_given_budget():
    assert EngineConfig(device="cpu").resolve(TINY).max_num_batched_tokens == 2048
    assert EngineConfig(device="cpu", max_num_batched_tokens=512).resolve(TINY).max_num_batched_tokens == 512
    with pytest.raises(ConfigError, match="max_num_batched_tokens must be >= 1, got 0"):
        EngineConfig(device="cpu", max_num_batched_tokens=0).resolve(TINY)


def test_serve_leaves_the_budget_to_the_engine_unless_given():
    parser = build_parser()
    assert parser.parse_args(["serve", "m"]).max_num_batched_tokens is None
    assert parser.parse_args(["serve", "m", "--max-num-batched-tokens", "4096"]).max_num_batched_tokens == 4096
