"""SwiGLU's activation: silu(gate) * up in one launch (dense MLPs and shared experts).

Shape legend: T tokens, I intermediate.
  silu_mul(gate [T, I], up [T, I]) -> [T, I]   (any row strides: halves of one gate_up tensor too)
Numerics are `silu_mul_ref`'s (`F.silu(gate) * up`, rounded where torch rounds).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moelora.kernels.checks import cdiv, check_rows, need, next_pow2, output
from moelora.kernels.pdl import pdl_args, pdl_wait


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, o_ptr, inter, stride_g, stride_u, stride_o, BLOCK: tl.constexpr,
                     PDL: tl.constexpr):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(o_ptr.dtype.element_ty).to(tl.float32)
    tl.store(o_ptr + row * stride_o + cols, (act * u).to(o_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, *, out: torch.Tensor | None = None,
             pdl: bool = False) -> torch.Tensor:
    """silu(gate) * up -> [T, I] (new, or `out=`); `pdl`: programmatic dependent launch where the GPU has it
    (`kernels.pdl`)."""
    need(gate.dim() == 2, f"gate must be [T, I], got {tuple(gate.shape)}")
    check_rows("gate", gate)
    check_rows("up", up, tuple(gate.shape), gate.dtype)
    need(up.device == gate.device, f"up must be on {gate.device}")
    T, inter = gate.shape
    out = output(out, (T, inter), gate.dtype, gate.device, (gate, up))
    if T == 0 or inter == 0:
        return out
    block = min(1024, next_pow2(inter))
    _silu_mul_kernel[(T, cdiv(inter, block))](
        gate, up, out, inter, gate.stride(0), up.stride(0), out.stride(0), BLOCK=block,
        num_warps=4 if block >= 512 else 1, **pdl_args(pdl, gate))
    return out
