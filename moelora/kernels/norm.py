"""RMSNorm and the fused residual add + RMSNorm, one launch each.

Shape legend: T rows (tokens), D normalised dim (hidden, or a head / latent width).
  rms_norm(x [T, D], weight [D], eps)             -> y [T, D]          (x's dtype)
  add_rms_norm(x [T, D], delta [T, D], weight, eps) -> (h = x + delta, y = rms_norm(h))
Numerics are `rms_norm_ref` / `add_rms_norm_ref`'s; one program a row, any row stride, unit stride along D.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moelora.kernels.checks import check_rows, check_vector, need, next_pow2, output


@triton.jit
def _rms_norm_kernel(x_ptr, delta_ptr, w_ptr, h_ptr, y_ptr, D, stride_x, stride_delta, stride_h, stride_y, eps,
                     HAS_DELTA: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_DELTA:
        delta = tl.load(delta_ptr + row * stride_delta + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + delta.to(tl.float32)).to(h_ptr.dtype.element_ty)  # the dtype's add
        tl.store(h_ptr + row * stride_h + offs, x, mask=mask)
    xf = x.to(tl.float32)
    scale = tl.rsqrt(tl.sum(xf * xf, axis=0) / D + eps)
    normed = (xf * scale).to(y_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + offs, (w * normed).to(y_ptr.dtype.element_ty), mask=mask)


def _launch(x, delta, weight, eps, h, y) -> None:
    T, D = x.shape
    if T == 0 or D == 0:
        return
    block_d = next_pow2(D)
    num_warps = 1 if block_d <= 256 else 4 if block_d <= 4096 else 8
    _rms_norm_kernel[(T,)](x, x if delta is None else delta, weight, y if h is None else h, y, D, x.stride(0),
                           0 if delta is None else delta.stride(0), 0 if h is None else h.stride(0), y.stride(0),
                           float(eps), HAS_DELTA=delta is not None, BLOCK_D=block_d, num_warps=num_warps)


def _check(x: torch.Tensor, weight: torch.Tensor) -> tuple[int, int]:
    need(x.dim() == 2, lambda: f"x must be [T, D], got {tuple(x.shape)}")
    check_rows("x", x)
    check_vector("weight", weight, x.shape[1], x.device)
    return x.shape[0], x.shape[1]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of each row of x [T, D] -> `out` (x's dtype; new unless the caller passes its own)."""
    T, D = _check(x, weight)
    out = output(out, (T, D), x.dtype, x.device, (x, weight))
    _launch(x, None, weight, eps, None, out)
    return out


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, *,
                 out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, y): h = x + delta rounded to the dtype (the next residual), y = rms_norm(h); `out`: the caller's (h, y)."""
    T, D = _check(x, weight)
    check_rows("delta", delta, (T, D), x.dtype)
    need(delta.device == x.device, f"delta must be on {x.device}")
    h_out, y_out = out if out is not None else (None, None)
    inputs = (x, delta, weight)
    h = output(h_out, (T, D), x.dtype, x.device, inputs, "out[0]")
    y = output(y_out, (T, D), x.dtype, x.device, inputs + (h,), "out[1]")
    _launch(x, delta, weight, eps, h, y)
    return h, y
