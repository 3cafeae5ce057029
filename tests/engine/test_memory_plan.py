"""The KV pool's memory plan: what the decode graphs keep is left free (`cuda_graphs.graph_reserve`)."""

from __future__ import annotations

from dataclasses import replace

from moelora.engine.config import EngineConfig
from moelora.engine.cuda_graphs import graph_reserve

VOCAB, ACTS, PROFILE_ROWS = 1000, 8_000_000, 2048
# default_buckets(64): 1, 2, 4, 8, then 16, 32, 48, and 64
BUCKET_ROWS = 1 + 2 + 4 + 8 + 16 + 32 + 48 + 64


def test_graph_reserve_counts_each_graph_sets_logits_and_a_decode_forward():
    cfg = EngineConfig(device="cuda", kernel_backend="triton", max_num_seqs=64, max_loras=4, max_lora_rank=16,
                       piecewise_graph_tokens=0)
    decode_acts = ACTS * 64 // PROFILE_ROWS  # the profile's peak, scaled to the largest bucket's rows
    both = graph_reserve(cfg, VOCAB, ACTS, PROFILE_ROWS)
    assert both == 2 * BUCKET_ROWS * VOCAB * 4 + decode_acts  # LoRA graphs and base graphs: fp32 logits each
    lora_only = graph_reserve(replace(cfg, base_decode_graphs=False), VOCAB, ACTS, PROFILE_ROWS)
    assert lora_only == BUCKET_ROWS * VOCAB * 4 + decode_acts
    assert graph_reserve(replace(cfg, max_loras=0), VOCAB, ACTS, PROFILE_ROWS) == lora_only  # no slots: one set
    assert graph_reserve(cfg, VOCAB, ACTS, 16) == 2 * BUCKET_ROWS * VOCAB * 4 + ACTS  # never above the peak
    for no_graphs in (replace(cfg, enforce_eager=True), replace(cfg, device="cpu"),
                      replace(cfg, kernel_backend="torch")):
        assert graph_reserve(no_graphs, VOCAB, ACTS, PROFILE_ROWS) == 0


def test_graph_reserve_counts_the_piecewise_graphs_pool_and_buffers():
    """Piecewise graphs: twice the profile's peak scaled to their largest bucket (min(piecewise_graph_tokens, the
    step budget) rows, at most the peak) on top of the decode graphs' reserve."""
    cfg = EngineConfig(device="cuda", kernel_backend="triton", max_num_seqs=64, max_loras=4, max_lora_rank=16,
                       max_num_batched_tokens=8192, piecewise_graph_tokens=512)
    decode = graph_reserve(replace(cfg, piecewise_graph_tokens=0), VOCAB, ACTS, PROFILE_ROWS)
    assert graph_reserve(cfg, VOCAB, ACTS, PROFILE_ROWS) == decode + 2 * ACTS * 512 // PROFILE_ROWS
    small = replace(cfg, max_num_batched_tokens=256)  # the step budget bounds the buckets
    assert graph_reserve(small, VOCAB, ACTS, PROFILE_ROWS) == decode + 2 * ACTS * 256 // PROFILE_ROWS
    assert graph_reserve(cfg, VOCAB, ACTS, 128) == graph_reserve(replace(cfg, piecewise_graph_tokens=0), VOCAB, ACTS,
                                                                 128) + 2 * ACTS  # never above the peak
    assert graph_reserve(replace(cfg, tensor_parallel_size=2), VOCAB, ACTS, PROFILE_ROWS) == decode
