"""RMSNorm and the fused residual add + RMSNorm, one launch each.

Shape legend: T rows (tokens), D normalised dim (hidden, or a head / latent width).
  rms_norm(x [T, D], weight [D], eps)             -> y [T, D]          (x's dtype)
  add_rms_norm(x [T, D], delta [T, D], weight, eps) -> (h = x + delta, y = rms_norm(h))
  norm_fp8(x, delta | None, weight, eps) -> (h, y, FP8Rows of y: q [T, D] e4m3, s [T, ceil(D/128)] fp32)
Either add takes a second delta (`delta2` [T, D]): h = x + (delta + delta2), the inner sum rounded to the dtype
first, as torch's `x + (delta + delta2)` -- an MoE block's routed and shared-expert outputs, added here rather
than in a launch of their own.
Numerics are `rms_norm_ref` / `add_rms_norm_ref`'s; one program a row, any row stride, unit stride along D.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moelora.kernels.args import FP8Rows
from moelora.kernels.checks import cdiv, check_rows, check_vector, need, next_pow2, output
from moelora.kernels.fp8_quant import GROUP, quant_tile
from moelora.kernels.pdl import pdl_args, pdl_wait
from moelora.kernels.rounding import round_to


@triton.jit
def _rms_norm_kernel(x_ptr, delta_ptr, delta2_ptr, w_ptr, h_ptr, y_ptr, q_ptr, s_ptr, D, stride_x, stride_delta,
                     stride_delta2, stride_h, stride_y, stride_q, stride_s, eps, HAS_DELTA: tl.constexpr,
                     HAS_DELTA2: tl.constexpr, QUANT: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
                     GROUP_: tl.constexpr = GROUP):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_DELTA:
        delta = tl.load(delta_ptr + row * stride_delta + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_DELTA2:  # the two deltas' sum in the dtype first (torch's x + (delta + delta2))
            delta2 = tl.load(delta2_ptr + row * stride_delta2 + offs, mask=mask, other=0.0)
            delta = round_to(delta + delta2.to(tl.float32), h_ptr)
        x = (x.to(tl.float32) + delta).to(h_ptr.dtype.element_ty)  # the dtype's add
        tl.store(h_ptr + row * stride_h + offs, x, mask=mask)
    xf = x.to(tl.float32)
    scale = tl.rsqrt(tl.sum(xf * xf, axis=0) / D + eps)
    normed = (xf * scale).to(y_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = (w * normed).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * stride_y + offs, y, mask=mask)
    if QUANT:  # y as stored, in 1 x 128 groups: per_token_group_quant's bits
        q, s = quant_tile(tl.reshape(tl.where(mask, y.to(tl.float32), 0.0), (BLOCK_D // GROUP_, GROUP_)))
        tl.store(q_ptr + row * stride_q + offs, tl.reshape(q, (BLOCK_D,)), mask=mask)
        g = tl.arange(0, BLOCK_D // GROUP_)
        tl.store(s_ptr + row * stride_s + g, s, mask=g * GROUP_ < D)


def _launch(x, delta, weight, eps, h, y, rows: FP8Rows | None = None, pdl: bool = False, delta2=None) -> None:
    T, D = x.shape
    if T == 0 or D == 0:
        return
    block_d = max(next_pow2(D), GROUP) if rows is not None else next_pow2(D)
    num_warps = 1 if block_d <= 256 else 4 if block_d <= 4096 else 8
    q, s = rows if rows is not None else (y, y)
    d2 = x if delta2 is None else delta2
    _rms_norm_kernel[(T,)](x, x if delta is None else delta, d2, weight, y if h is None else h, y, q, s, D,
                           x.stride(0), 0 if delta is None else delta.stride(0), 0 if delta2 is None else d2.stride(0),
                           0 if h is None else h.stride(0), y.stride(0), q.stride(0), s.stride(0), float(eps),
                           HAS_DELTA=delta is not None, HAS_DELTA2=delta2 is not None, QUANT=rows is not None,
                           BLOCK_D=block_d, num_warps=num_warps, **pdl_args(pdl, x))


def _check(x: torch.Tensor, weight: torch.Tensor) -> tuple[int, int]:
    need(x.dim() == 2, lambda: f"x must be [T, D], got {tuple(x.shape)}")
    check_rows("x", x)
    check_vector("weight", weight, x.shape[1], x.device)
    return x.shape[0], x.shape[1]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, out: torch.Tensor | None = None,
             pdl: bool = False) -> torch.Tensor:
    """RMSNorm of each row of x [T, D] -> `out` (x's dtype; new unless the caller passes its own); `pdl`: launched
    with programmatic dependent launch where the GPU has it (`kernels.pdl`, as every launcher here)."""
    T, D = _check(x, weight)
    out = output(out, (T, D), x.dtype, x.device, (x, weight))
    _launch(x, None, weight, eps, None, out, pdl=pdl)
    return out


def _check_delta(name: str, delta: torch.Tensor | None, x: torch.Tensor) -> None:
    if delta is not None:
        check_rows(name, delta, tuple(x.shape), x.dtype)
        need(delta.device == x.device, f"{name} must be on {x.device}")


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, *,
                 out: tuple[torch.Tensor, torch.Tensor] | None = None, pdl: bool = False,
                 delta2: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, y): h = x + delta rounded to the dtype (the next residual), y = rms_norm(h); `out`: the caller's (h, y).
    delta2: h = x + (delta + delta2), the inner sum rounded to the dtype first."""
    T, D = _check(x, weight)
    _check_delta("delta", delta, x)
    _check_delta("delta2", delta2, x)
    h_out, y_out = out if out is not None else (None, None)
    inputs = (x, delta, weight) if delta2 is None else (x, delta, delta2, weight)
    h = output(h_out, (T, D), x.dtype, x.device, inputs, "out[0]")
    y = output(y_out, (T, D), x.dtype, x.device, inputs + (h,), "out[1]")
    _launch(x, delta, weight, eps, h, y, pdl=pdl, delta2=delta2)
    return h, y


def norm_fp8(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, *, pdl: bool = False,
             delta2: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, FP8Rows]:
    """(h, y, rows): `add_rms_norm` (h = x when delta is None; delta2 as there), and y quantized for the W8A8 GEMMs
    that read it, bit for bit `per_token_group_quant(y)`, in the same launch. All new."""
    T, D = _check(x, weight)
    need(delta2 is None or delta is not None, "delta2 needs delta")
    _check_delta("delta", delta, x)
    _check_delta("delta2", delta2, x)
    h = x if delta is None else torch.empty(T, D, dtype=x.dtype, device=x.device)
    y = torch.empty(T, D, dtype=x.dtype, device=x.device)
    rows = FP8Rows(torch.empty(T, D, dtype=torch.float8_e4m3fn, device=x.device),
                   torch.empty(T, cdiv(D, GROUP), dtype=torch.float32, device=x.device))
    _launch(x, delta, weight, eps, None if delta is None else h, y, rows, pdl, delta2)
    return h, y, rows
