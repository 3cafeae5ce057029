"""SwiGLU's activation: silu(gate) * up in one launch (dense MLPs and shared experts).

Shape legend: T tokens, I intermediate.
  silu_mul(gate [T, I], up [T, I]) -> [T, I]   (any row strides: halves of one gate_up tensor too)
  silu_mul_fp8(gate, up) -> (h [T, I], FP8Rows of h: q [T, I] e4m3, s [T, ceil(I/128)] fp32)
Numerics are `silu_mul_ref`'s (`F.silu(gate) * up`, rounded where torch rounds: `rounding.round_to`, which no
compiler folds away). `silu_mul_fp8` also writes h quantized for the W8A8 down projection reading it, bit for bit
`per_token_group_quant(h)`, in the same launch (as `norm_fp8` does for the GEMMs after a norm): one
`_group_quant_kernel` launch a dense MLP fewer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moelora.kernels.args import FP8Rows
from moelora.kernels.checks import cdiv, check_rows, need, next_pow2, output
from moelora.kernels.fp8_quant import GROUP, quant_tile
from moelora.kernels.pdl import pdl_args, pdl_wait
from moelora.kernels.rounding import round_to


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, o_ptr, q_ptr, s_ptr, inter, stride_g, stride_u, stride_o, stride_q, stride_s,
                     BLOCK: tl.constexpr, QUANT: tl.constexpr, PDL: tl.constexpr, GROUP_: tl.constexpr = GROUP):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    act = round_to(g / (1.0 + tl.exp(-g)), o_ptr)
    h = round_to(act * u, o_ptr)  # h as stored, in fp32
    tl.store(o_ptr + row * stride_o + cols, h.to(o_ptr.dtype.element_ty), mask=mask)
    if QUANT:  # h as stored, in 1 x 128 groups: per_token_group_quant's bits
        q, s = quant_tile(tl.reshape(tl.where(mask, h, 0.0), (BLOCK // GROUP_, GROUP_)))
        tl.store(q_ptr + row * stride_q + cols, tl.reshape(q, (BLOCK,)), mask=mask)
        grp = tl.program_id(1) * (BLOCK // GROUP_) + tl.arange(0, BLOCK // GROUP_)
        tl.store(s_ptr + row * stride_s + grp, s, mask=grp * GROUP_ < inter)


def _check(gate: torch.Tensor, up: torch.Tensor) -> tuple[int, int]:
    need(gate.dim() == 2, f"gate must be [T, I], got {tuple(gate.shape)}")
    check_rows("gate", gate)
    check_rows("up", up, tuple(gate.shape), gate.dtype)
    need(up.device == gate.device, f"up must be on {gate.device}")
    return gate.shape


def _launch(gate, up, out, rows: FP8Rows | None, pdl: bool) -> None:
    T, inter = gate.shape
    if T == 0 or inter == 0:
        return
    block = min(1024, next_pow2(inter))
    if rows is not None:
        block = max(block, GROUP)  # whole groups a program (1024 and every power of two from 128 are)
    q, s = rows if rows is not None else (out, out)
    _silu_mul_kernel[(T, cdiv(inter, block))](
        gate, up, out, q, s, inter, gate.stride(0), up.stride(0), out.stride(0), q.stride(0), s.stride(0),
        BLOCK=block, QUANT=rows is not None, num_warps=4 if block >= 512 else 1, **pdl_args(pdl, gate))


def silu_mul(gate: torch.Tensor, up: torch.Tensor, *, out: torch.Tensor | None = None,
             pdl: bool = False) -> torch.Tensor:
    """silu(gate) * up -> [T, I] (new, or `out=`); `pdl`: programmatic dependent launch where the GPU has it
    (`kernels.pdl`)."""
    T, inter = _check(gate, up)
    out = output(out, (T, inter), gate.dtype, gate.device, (gate, up))
    _launch(gate, up, out, None, pdl)
    return out


def silu_mul_fp8(gate: torch.Tensor, up: torch.Tensor, *, pdl: bool = False) -> tuple[torch.Tensor, FP8Rows]:
    """(h, rows): `silu_mul`, and h quantized for the W8A8 GEMM that reads it, bit for bit
    `per_token_group_quant(h)`, in the same launch. All new."""
    T, inter = _check(gate, up)
    h = torch.empty(T, inter, dtype=gate.dtype, device=gate.device)
    rows = FP8Rows(torch.empty(T, inter, dtype=torch.float8_e4m3fn, device=gate.device),
                   torch.empty(T, cdiv(inter, GROUP), dtype=torch.float32, device=gate.device))
    _launch(gate, up, h, rows, pdl)
    return h, rows
