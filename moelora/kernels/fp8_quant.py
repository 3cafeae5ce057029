"""Dynamic FP8 (e4m3) activation quantization per token and group of 128 columns (DeepSeek's 1 x 128 recipe).

Shape legend: M rows (tokens), K columns, G = ceil(K / 128) groups a row.
  x [M, K] fp16/bf16/fp32 -> (q [M, K] float8_e4m3fn, s [M, G] fp32), x ~ q * s per group.
s = amax / 448 over the group (1 for an all-zero group; the last group may be partial), q = x / s rounded to
nearest, saturated at +-448: bit for bit `moelora.quant.fp8.quantize_groups`, its torch twin.
Also the FP8 GEMMs' transposed K steps on e4m3 weights (`w8a8_dot_t`, `w8a16_dot`), shared by `fp8_moe` and
`fp8_linear`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moelora.kernels.checks import FLOAT_DTYPES, cdiv, next_pow2
from moelora.kernels.pdl import pdl_args, pdl_wait

GROUP = 128
FP8_MAX = 448.0


@triton.jit
def _round_e4m3(v):
    """v (fp32, |v| <= 448) rounded to the nearest e4m3 value, ties to even, in fp32: the spacing of v's binade
    is 2^(e-3) (e its exponent, at least -6: the subnormals'), and v / spacing is rounded to an integer by the
    fp32 adder (adding and removing 1.5 * 2^23; exact, as |v| / spacing < 16). The cast after it is then exact
    on every path: Triton's fp32 -> e4m3 conversion may round twice (through fp16) on the GPU, and the
    interpreter's rounds across a binade wrongly (-125.9 -> -64), so neither is left to round."""
    bits = v.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    inv_step = ((130 - e) << 23).to(tl.float32, bitcast=True)  # 2^(3 - e)
    step = ((124 + e) << 23).to(tl.float32, bitcast=True)  # 2^(e - 3)
    r = ((tl.abs(v) * inv_step + 12582912.0) - 12582912.0) * step
    # v's sign bit on r (r >= 0), -0.0 included as torch's cast keeps it: `-r` is 0 - r on the GPU (+0.0)
    return (r.to(tl.int32, bitcast=True) | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def quant_tile(t, FP8_MAX_: tl.constexpr = 448.0):
    """t [BM, BK] (BK = one group, masked columns 0) -> (q [BM, BK] e4m3, s [BM] fp32)."""
    t = t.to(tl.float32)
    amax = tl.max(tl.abs(t), axis=1)
    # div_rn: IEEE division, as torch's (Triton's `/` on fp32 may lower to an approximate division)
    s = tl.where(amax > 0, tl.math.div_rn(amax, tl.full(amax.shape, FP8_MAX_, tl.float32)), 1.0)
    v = tl.clamp(tl.math.div_rn(t, tl.broadcast_to(s[:, None], t.shape)), -FP8_MAX_, FP8_MAX_)
    return _round_e4m3(v).to(tl.float8e4nv), s


@triton.jit
def _group_quant_kernel(x_ptr, q_ptr, s_ptr, rows_ptr, M, K, n_groups, stride_x, stride_q, stride_s, stride_sg,
                        GROUP_: tl.constexpr, GB: tl.constexpr, ROW_LIMIT: tl.constexpr, PDL: tl.constexpr):
    """Program (row, j): groups [j GB, (j + 1) GB) of one row; ROW_LIMIT: rows from *rows_ptr on are left; rows
    from M on (padding) are written as an all-zero row's (q 0, s 1)."""
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    if ROW_LIMIT:
        if row >= tl.load(rows_ptr):
            return
    g = tl.program_id(1) * GB + tl.arange(0, GB)
    cols = g[:, None] * GROUP_ + tl.arange(0, GROUP_)[None, :]
    ok = (g[:, None] < n_groups) & (cols < K)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < tl.where(row < M, K, 0), other=0.0)
    q, s = quant_tile(x)
    tl.store(q_ptr + row * stride_q + cols, q, mask=ok)
    tl.store(s_ptr + row * stride_s + g * stride_sg, s, mask=g < n_groups)


def per_token_group_quant(x: torch.Tensor, rows: torch.Tensor | None = None, *, pdl: bool = False,
                          row_multiple: int = 1, col_major_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> new (q [M', K] e4m3, s [M', ceil(K/128)] fp32), M' = M rounded up to `row_multiple` (the padding
    rows an all-zero row's: q 0, s 1); `col_major_scales`: s column-major (stride (1, M')), the layout cuBLAS's
    block-scaled GEMM reads; `rows` (device int32 [1], e.g. a plan's `num_padded`): only rows below it are
    written; `pdl`: programmatic dependent launch where the GPU has it (`kernels.pdl`)."""
    if x.dim() != 2 or x.dtype not in FLOAT_DTYPES or x.stride(1) != 1:
        raise ValueError(f"x must be [M, K] fp16/bf16/fp32 with unit last stride, got {tuple(x.shape)} {x.dtype}")
    M, K = x.shape
    n_groups = cdiv(K, GROUP)
    padded = cdiv(M, row_multiple) * row_multiple
    q = torch.empty(padded, K, dtype=torch.float8_e4m3fn, device=x.device)
    s = (torch.empty(n_groups, padded, dtype=torch.float32, device=x.device).t() if col_major_scales
         else torch.empty(padded, n_groups, dtype=torch.float32, device=x.device))
    if padded == 0 or K == 0:
        return q, s
    gb = min(8, next_pow2(n_groups))
    _group_quant_kernel[(padded, cdiv(n_groups, gb))](
        x, q, s, x if rows is None else rows, M, K, n_groups, x.stride(0), q.stride(0), s.stride(0), s.stride(1),
        GROUP_=GROUP, GB=gb, ROW_LIMIT=rows is not None, num_warps=4, **pdl_args(pdl, x))
    return q, s


# the transposed e4m3 K steps of the FP8 GEMMs (`fp8_moe`, `fp8_linear`): one form, one place
@triton.jit
def w8a8_dot_t(acc_t, aq, a_scale, w, w_scale):
    """One K step transposed: acc_t [BN, BM] + dot(W_q [BN, BK], A_q^T [BK, BM]) * w_s * a_s (aq, a_scale:
    `fp8_moe._w8a8_rows`). With the weight tile as the MMA's M side, BN >= 64 gives Hopper's e4m3 wgmma below
    BM = 64 rows, where the untransposed dot runs mma.sync on both operands upcast to f16 (the W8A8 steps take this form
    there)."""
    return acc_t + tl.dot(w, tl.trans(aq)) * (w_scale[:, None] * a_scale[None, :])


@triton.jit
def w8a16_dot(acc_t, a_t, w, w_scale):
    """One K step transposed: acc_t [BN, BM] += (W_q [BN, BK] * w_s, in A's dtype) @ a_t [BK, BM]. The weight,
    upcast in registers, is the MMA's register operand and the activations its shared-memory one (Hopper's
    wgmma takes only its first operand from registers), and the accumulator stays chained."""
    return tl.dot((w.to(tl.float32) * w_scale[:, None]).to(a_t.dtype), a_t, acc_t)
