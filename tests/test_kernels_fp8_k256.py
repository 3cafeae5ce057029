"""W8A8 expert GEMMs stepping K two scale blocks at a time (block_k 256, kernels/fp8_moe.py): each 128-column
block still gets its own activation and weight scale, so the result is the twin's, as at block_k 128 (contract 10).
W8A16 keeps one block a step (refused otherwise)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton")

from kernel_env import DEV, gpu_only, kernel_test  # noqa: E402
from test_kernels_fp8_moe import (  # noqa: E402
    DSV2_LITE,
    QWEN3,
    check_w8a8_within_bound,
    dequantized_twin,
    fp8_weights,
    gpu_case,
    gpu_config,
    run_fp8,
    tiny_fp8_config,
)
from test_kernels_fused_moe import make_case, rel_err  # noqa: E402

from moelora.kernels.fp8_moe import FP8ExpertScales  # noqa: E402
from moelora.kernels.fused_moe import fused_moe  # noqa: E402
from moelora.kernels.moe_config import GemmTile  # noqa: E402


def k256(cfg, bn=32, warps=4):
    tile = GemmTile(bn, 256, warps, 2)
    return replace(cfg, gate_up=tile, down=tile)


@kernel_test
@pytest.mark.parametrize("H,inter", [(200, 136), (300, 392)], ids=["one-partial-step", "full-then-partial"])
@pytest.mark.parametrize("block", [True, False], ids=["block", "channel"])
@pytest.mark.parametrize("shrink", ["off", "route"])
def test_w8a8_two_blocks_a_step_equals_twin(H, inter, block, shrink):
    """K off the 256 grid: a step whose second block is partial or absent (masked, scale 0 x value 0)."""
    ranks = () if shrink == "off" else (8, 0, 3, 8)
    case = make_case(9, H, inter, 5, 2, ranks=ranks, R=8, dtype=torch.float32, device=DEV, seed=H)
    cfg = k256(tiny_fp8_config("separate" if shrink == "off" else shrink))
    got, deq_gu, deq_d = run_fp8(case, cfg, block, True)
    assert rel_err(got, dequantized_twin(case, deq_gu, deq_d, True)) <= 1e-4
    check_w8a8_within_bound(got, case, deq_gu, deq_d, 1e-5)


@kernel_test
def test_w8a16_refuses_two_blocks_a_step():
    x, w_gu, w_d, wts, ids, _ = make_case(3, 128, 128, 2, 1, dtype=torch.float32, device=DEV, seed=7)
    q_gu, q_d, (s_gu, s_d), _, _ = fp8_weights(w_gu, w_d, True)
    with pytest.raises(ValueError, match=r"block_k must be 128 \(W8A16\), got 256"):
        fused_moe(x, q_gu, q_d, wts, ids, config=k256(tiny_fp8_config()), fp8=FP8ExpertScales(s_gu, s_d))


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("T,bm,bn,warps", [(8, 16, 64, 4), (64, 32, 64, 8), (512, 64, 64, 8)])
@pytest.mark.parametrize("shape", ["qwen3", "dsv2_lite"])
def test_gpu_w8a8_two_blocks_a_step(T, bm, bn, warps, shape):
    """The tuner's block_k 256 tiles at the model shapes (E 16: the fp64 bound), 8 adapters."""
    sh = QWEN3 if shape == "qwen3" else DSV2_LITE
    case = gpu_case(sh, T, seed=T + 13, lora=True, E=16)
    cfg = replace(k256(gpu_config(sh, T, act=True), bn, warps), block_m=bm)
    got, deq_gu, deq_d = run_fp8(case, cfg, True, True, no_sync=True)
    assert rel_err(got, dequantized_twin(case, deq_gu, deq_d, True, torch.float32)) <= 1e-2
    check_w8a8_within_bound(got, case, deq_gu, deq_d, 1e-2)
