"""FP8 block math (`moelora.quant.fp8`) against hand-computed cases, and the W8A8 twin's error bound.

Every expected value here is written out by hand (e4m3 values are exact binary fractions): a scale is
amax / 448 over its block, a partial block at the end of a row or column has its own scale.
"""

from __future__ import annotations

import pytest
import torch

from moelora.kernels.reference import fused_moe_ref, lora_linear_ref
from moelora.quant.fp8 import (
    ABS_ERROR,
    FP8_DTYPE,
    REL_ERROR,
    dequantize_blocks,
    dequantize_channels,
    dequantize_segments,
    fake_quantize_groups,
    quantize_blocks,
    quantize_channels,
    quantize_segments,
)
from tests.helpers.fp8_bounds import experts_bound, gemm_bound


def fp8(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).to(FP8_DTYPE)


def test_one_partial_block():
    w = torch.tensor([[896.0, 2.0, -3.0], [0.5, 0.0, 1.0]])  # amax 896 -> s = 2
    q, s = quantize_blocks(w)
    assert s.shape == (1, 1) and s.item() == 2.0
    assert torch.equal(q.float(), torch.tensor([[448.0, 1.0, -1.5], [0.25, 0.0, 0.5]]))
    assert torch.equal(dequantize_blocks(q, s), w)


def test_partial_blocks_of_a_130_x_129_weight():
    w = torch.zeros(130, 129)
    w[0, 0], w[5, 7] = 224.0, -100.0  # block (0, 0): s = 0.5, -100 / 0.5 = -200 -> e4m3 -192 (spacing 16)
    w[129, 5] = -7.0  # block (1, 0), two rows: s = 7 / 448 = 2^-6
    w[2, 128], w[3, 128] = 4.0, 1.0  # block (0, 1), one column: s = 4 / 448; 1 -> 112
    q, s = quantize_blocks(w)
    assert s.shape == (2, 2)
    assert s[0, 0] == 0.5 and s[1, 0] == 2.0 ** -6 and s[1, 1] == 1.0  # an all-zero block keeps s = 1
    assert torch.isclose(s[0, 1], torch.tensor(4.0 / 448.0))
    assert q[0, 0].float() == 448 and q[5, 7].float() == -192 and q[129, 5].float() == -448
    assert q[2, 128].float() == 448 and q[3, 128].float() == 112
    assert q.float().count_nonzero() == 5
    back = dequantize_blocks(q, s)
    assert back[5, 7] == -96.0 and back[129, 5] == -7.0 and back[0, 0] == 224.0
    assert torch.isclose(back[3, 128], torch.tensor(1.0))


def test_rounding_to_nearest_e4m3():
    w = torch.tensor([[448.0, 403.2, 17.0, 0.01]])  # s = 1: 403.2 -> 416 (spacing 32), 17 -> 16 (spacing 2)
    q, s = quantize_blocks(w)
    assert s.item() == 1.0
    assert torch.equal(q.float(), torch.tensor([[448.0, 416.0, 16.0, 0.009765625]]))  # 0.01 -> 5 * 2^-9


def test_dequantize_blocks_by_hand():
    q = torch.ones(130, 2).to(FP8_DTYPE)
    q[129, 1] = fp8(-3.0)
    s = torch.tensor([[2.0], [0.5]])  # rows 0..127 and the partial block of rows 128..129
    w = dequantize_blocks(q, s, dtype=torch.float64)
    assert w.dtype == torch.float64
    assert torch.all(w[:128] == 2.0) and w[128, 0] == 0.5 and w[129, 1] == -1.5


def test_whole_blocks_by_hand():
    """256 x 384 (2 x 3 whole blocks, the broadcast path): each block's elements times its own scale."""
    q = torch.ones(2, 256, 384).to(FP8_DTYPE)
    s = torch.arange(1.0, 13.0).view(2, 2, 3)
    w = dequantize_blocks(q, s)
    assert w.shape == (2, 256, 384)
    for e in range(2):
        for i in range(2):
            for j in range(3):
                assert torch.all(w[e, i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] == s[e, i, j])
    q2, s2 = quantize_blocks(w)
    assert torch.equal(s2, s / 448) and torch.all(q2.float() == 448)


def test_segments_block_each_on_its_own():
    w = torch.tensor([[8.0, 1.0], [2.0, 0.0], [4.0, 2.0], [1.0, -1.0], [0.5, 0.25]])
    q, s = quantize_segments(w, (3, 2))  # segment 0: amax 8, segment 1: amax 1
    assert torch.equal(s, torch.tensor([[8.0 / 448], [1.0 / 448]]))
    whole_q, whole_s = quantize_blocks(w)
    assert whole_s.shape == (1, 1) and not torch.equal(whole_q.float(), q.float())
    assert torch.allclose(dequantize_segments(q, s, (3, 2)), w)
    # multi-block segments: rows 0..199 (2 grid rows) then 0..69 (1)
    big = torch.randn(270, 140, generator=torch.Generator().manual_seed(0))
    q, s = quantize_segments(big, (200, 70))
    assert s.shape == (3, 2)
    torch.testing.assert_close(s[2], quantize_blocks(big[200:])[1][0])
    torch.testing.assert_close(dequantize_segments(q, s, (200, 70)), big, rtol=REL_ERROR, atol=1e-3)


def test_leading_expert_dims():
    w = torch.randn(3, 130, 5, generator=torch.Generator().manual_seed(1))
    q, s = quantize_blocks(w)
    assert q.shape == w.shape and s.shape == (3, 2, 1)
    for e in range(3):
        assert torch.equal(s[e], quantize_blocks(w[e])[1])


def test_channels_by_hand():
    w = torch.tensor([[896.0, -448.0], [0.0, 0.0], [1.0, -7.0]])
    q, s = quantize_channels(w)
    assert torch.equal(s, torch.tensor([[2.0], [1.0], [2.0 ** -6]]))
    assert torch.equal(q.float(), torch.tensor([[448.0, -224.0], [0.0, 0.0], [64.0, -448.0]]))
    assert torch.equal(dequantize_channels(q, s), w)
    assert torch.equal(dequantize_channels(q, torch.tensor([0.5])), q.float() * 0.5)  # a per-tensor scale


def test_activation_groups_by_hand():
    x = torch.zeros(2, 130)
    x[0, 0], x[0, 1], x[0, 128], x[0, 129] = 448.0, 403.2, 2.0, -0.75  # group 1 (2 columns): s = 2 / 448
    x[1, 3] = 1.0
    got = fake_quantize_groups(x, 128)
    assert got[0, 0] == 448 and got[0, 1] == 416  # group 0: s = 1
    # -0.75 / (2 / 448) = -168, halfway between e4m3's -160 and -176 (spacing 16): ties to even, -160
    assert got[0, 128] == 2.0 and torch.isclose(got[0, 129], torch.tensor(-160 * 2 / 448))
    assert got[1, 3] == 1.0 and got.count_nonzero() == 5
    per_token = fake_quantize_groups(x, None)  # one scale over the row: 403.2 -> 416, 2 -> 2, -0.75 -> -0.75
    assert per_token[0, 1] == 416 and per_token[0, 128] == 2.0 and torch.isclose(per_token[0, 129],
                                                                                 torch.tensor(-0.75))


@pytest.mark.parametrize("shape", [(7, 300), (5, 129), (3, 64)])
def test_e4m3_error_bound(shape):
    """|w - dq(q(w))| <= 2^-4 |w| + 2^-10 s elementwise (the bound the W8A8 twin's is built from)."""
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(2)) * torch.logspace(-4, 1, shape[1])
    q, s = quantize_blocks(w)
    err = (dequantize_blocks(q, s) - w).abs()
    assert torch.all(err <= REL_ERROR * w.abs() + ABS_ERROR * s.max() + 1e-12)


@pytest.mark.parametrize("group", [128, None])
def test_w8a8_twin_linear_within_bound(group):
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(9, 300, generator=g, dtype=torch.float64), torch.randn(40, 300, generator=g, dtype=torch.float64)
    quant = lambda t: fake_quantize_groups(t, group)  # noqa: E731
    exact, w8a8 = lora_linear_ref(x, w, None, None), lora_linear_ref(x, w, None, None, act_quant=quant)
    diff = (w8a8 - exact).abs()
    assert diff.max() > 0
    assert torch.all(diff <= gemm_bound(x, w, group) + 1e-9)


def test_w8a8_twin_experts_within_bound():
    """Routed experts: the gate_up GEMM's input and the down GEMM's input h are rounded per 128 group."""
    g = torch.Generator().manual_seed(4)
    T, H, inter, E = 6, 130, 40, 3
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    w_gu = 0.1 * torch.randn(E, 2 * inter, H, generator=g, dtype=torch.float64)
    w_d = 0.1 * torch.randn(E, H, inter, generator=g, dtype=torch.float64)
    ids = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 2], [1, 0], [2, 1]])
    weights = torch.rand(T, 2, generator=g, dtype=torch.float64)
    quant = lambda t: fake_quantize_groups(t, 128)  # noqa: E731
    exact = fused_moe_ref(x, w_gu, w_d, weights, ids)
    w8a8 = fused_moe_ref(x, w_gu, w_d, weights, ids, act_quant=quant)
    assert (w8a8 - exact).abs().max() > 0
    bound = experts_bound(x, w_gu, w_d, weights, ids, 128)
    assert torch.all((w8a8 - exact).abs() <= bound + 1e-12)
