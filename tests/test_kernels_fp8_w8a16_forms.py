"""W8A16's two K steps on FP8 expert weights (kernels/fp8_moe.py): the scale on each step's partial sums (the
default; channel scales once after the loop) and on the weight tile before the dot (`weight_prescale`, the
off switch) both equal the twin on the dequantized weights (contract 10)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_env import DEV, gpu_only, kernel_test  # noqa: E402
from test_kernels_fp8_moe import QWEN3, dequantized_twin, fp8_weights, gpu_case, gpu_config, tiny_fp8_config  # noqa: E402
from test_kernels_fused_moe import make_case, rel_err  # noqa: E402

from moelora.kernels.fp8_moe import FP8ExpertScales  # noqa: E402
from moelora.kernels.fused_moe import fused_moe  # noqa: E402


def both_forms(case, config, block):
    """(post-scaled, pre-scaled) outputs of the case on its quantized weights, and the dequantized weights."""
    x, w_gu, w_d, wts, ids, lora = case
    q_gu, q_d, (s_gu, s_d), deq_gu, deq_d = fp8_weights(w_gu, w_d, block)
    outs = [fused_moe(x, q_gu, q_d, wts, ids, lora=lora, config=config,
                      fp8=FP8ExpertScales(s_gu, s_d, block=block, weight_prescale=pre)) for pre in (False, True)]
    return (*outs, deq_gu, deq_d)


@kernel_test
@pytest.mark.parametrize("block", [True, False], ids=["block", "channel"])
@pytest.mark.parametrize("shrink", ["off", "route"])
def test_w8a16_forms_equal_the_twin(block, shrink):
    """H and I off the 128 grid (partial scale blocks), adapters on some rows."""
    ranks = () if shrink == "off" else (8, 0, 3, 8)
    case = make_case(9, 200, 136, 5, 2, ranks=ranks, R=8, dtype=torch.float32, device=DEV, seed=4)
    post, pre, deq_gu, deq_d = both_forms(case, tiny_fp8_config("separate" if shrink == "off" else shrink), block)
    want = dequantized_twin(case, deq_gu, deq_d, False)
    assert rel_err(post, want) <= 1e-4 and rel_err(pre, want) <= 1e-4


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("T", [8, 512])
@pytest.mark.parametrize("block", [True, False], ids=["block", "channel"])
def test_gpu_w8a16_forms_equal_the_twin(T, block):
    """The Qwen3-30B-A3B expert shape on the table's tiles, 8 adapters: bf16 against the fp32 twin."""
    case = gpu_case(QWEN3, T, seed=T + 5, lora=True)
    post, pre, deq_gu, deq_d = both_forms(case, gpu_config(QWEN3, T), block)
    want = dequantized_twin(case, deq_gu, deq_d, False, torch.float32)
    assert rel_err(post, want) <= 1e-2 and rel_err(pre, want) <= 1e-2
