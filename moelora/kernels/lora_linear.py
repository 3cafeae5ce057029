"""Dense linear with per-token multi-LoRA: y = x W^T + b + x A_s^T B_s^T (s = slot of the row).

Shape legend: T tokens, N_in / N_out in / out features, S adapter slots, R max rank.
  x [T, N_in], weight [N_out, N_in], bias [N_out] | None
  lora: DenseLoRAArgs (a [S, R, N_in], b [S, N_out, R] with scaling folded in,
        token_slots [T] int32 (-1: no adapter), slot_ranks [S] int32)       -> y [T, N_out]

The base projection is one cuBLAS GEMM into the output buffer this launcher allocates (or the
caller's `out=`); one Triton kernel then adds the LoRA delta into that buffer, tile by tile:
program (m, n) walks the distinct slots of its BM rows and, 16 rank columns at a time up to the
slot's own rank, shrinks rows @ A_s^T over N_in and adds (xa) @ B_s^T to its [BM, BN] tile.
Tiles whose rows have no adapter exit after one load, and rows with slot -1 are neither read nor written. No host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moelora.kernels.lora_tiles import lora_b_tile, lora_shrink_rows
from moelora.kernels.reference import DenseLoRAArgs

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class LoRALinearConfig:
    block_m: int = 16
    block_n: int = 128
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 2


def default_lora_linear_config(num_tokens: int) -> LoRALinearConfig:
    """Decode: short row blocks; prefill: wide N tiles, so the in-program shrink repeats less."""
    if num_tokens <= 32:
        return LoRALinearConfig(16, 64, 256, 4, 2)
    return LoRALinearConfig(64, 256, 64, 8, 2)


@triton.jit
def _lora_delta_add_kernel(
    x_ptr, y_ptr, a_ptr, b_ptr, slots_ptr, ranks_ptr, T, N_in, N_out,
    stride_xt, stride_yt, stride_as, stride_ar, stride_bs, stride_bn,
    BM: tl.constexpr, BN: tl.constexpr, RC: tl.constexpr, BK: tl.constexpr,
):
    offs_t = tl.program_id(0) * BM + tl.arange(0, BM)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    slot = tl.load(slots_ptr + offs_t, mask=offs_t < T, other=-1)
    rows_on = slot >= 0
    s = tl.max(slot, axis=0)
    if s < 0:
        return
    acc = tl.zeros((BM, BN), tl.float32)
    while s >= 0:
        sel = slot == s
        rank = tl.load(ranks_ptr + s)
        a_s = a_ptr + s.to(tl.int64) * stride_as
        b_s = b_ptr + s.to(tl.int64) * stride_bs
        for r0 in range(0, rank, RC):  # only the slot's own rank columns, RC at a time
            xa = lora_shrink_rows(x_ptr, offs_t, stride_xt, sel, a_s + r0 * stride_ar, stride_ar, rank - r0, 0, N_in,
                                  BM, RC, BK).to(x_ptr.dtype.element_ty)
            acc = tl.dot(xa, lora_b_tile(b_s + r0, offs_n, N_out, stride_bn, rank - r0, RC).to(xa.dtype), acc)
        slot = tl.where(sel, -1, slot)
        s = tl.max(slot, axis=0)
    y_ptrs = y_ptr + offs_t[:, None].to(tl.int64) * stride_yt + offs_n[None, :]
    mask = rows_on[:, None] & (offs_n[None, :] < N_out)
    y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + acc).to(y_ptr.dtype.element_ty), mask=mask)


def _check(x, weight, bias, lora):
    if x.dim() != 2 or x.dtype not in _FLOAT_DTYPES or x.stride(1) != 1:
        raise ValueError(f"x must be [T, N_in] fp16/bf16/fp32 with unit last stride, got {tuple(x.shape)} "
                         f"{x.dtype}")
    T, n_in = x.shape
    if weight.dim() != 2 or weight.shape[1] != n_in or weight.dtype != x.dtype:
        raise ValueError(f"weight must be [N_out, N_in={n_in}] {x.dtype}, got {tuple(weight.shape)} {weight.dtype}")
    n_out = weight.shape[0]
    if bias is not None and (tuple(bias.shape) != (n_out,) or bias.dtype != x.dtype):
        raise ValueError(f"bias must be [N_out={n_out}] {x.dtype}, got {tuple(bias.shape)} {bias.dtype}")
    if lora is None:
        return T, n_in, n_out
    S, R = lora.a.shape[0], lora.a.shape[1]
    for name, t, shape in (("a", lora.a, (S, R, n_in)), ("b", lora.b, (S, n_out, R))):
        if tuple(t.shape) != shape or t.stride(-1) != 1 or not t.is_floating_point():
            raise ValueError(f"lora.{name} must be float {shape} with unit last stride, got {tuple(t.shape)}")
    if tuple(lora.token_slots.shape) != (T,) or lora.token_slots.dtype != torch.int32:
        raise ValueError(f"lora.token_slots must be [T={T}] int32, got {tuple(lora.token_slots.shape)} "
                         f"{lora.token_slots.dtype}")
    if tuple(lora.slot_ranks.shape) != (S,) or lora.slot_ranks.dtype != torch.int32:
        raise ValueError(f"lora.slot_ranks must be [S={S}] int32, got {tuple(lora.slot_ranks.shape)}")
    return T, n_in, n_out


def lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                lora: DenseLoRAArgs | None, *, out: torch.Tensor | None = None,
                config: LoRALinearConfig | None = None) -> torch.Tensor:
    """`lora_linear_ref` on the GPU: returns y [T, N_out] (new, or the caller's `out=`)."""
    T, n_in, n_out = _check(x, weight, bias, lora)
    if out is None:
        out = torch.empty(T, n_out, dtype=x.dtype, device=x.device)
    if tuple(out.shape) != (T, n_out) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"out must be [T={T}, N_out={n_out}] {x.dtype} with unit last stride")
    if T == 0:
        return out
    if out.untyped_storage().data_ptr() in (x.untyped_storage().data_ptr(), weight.untyped_storage().data_ptr()):
        raise ValueError("out must not alias an input (contract 2)")
    if bias is None:
        torch.mm(x, weight.t(), out=out)
    else:
        torch.addmm(bias, x, weight.t(), out=out)
    if lora is None:
        return out
    cfg = config or default_lora_linear_config(T)
    grid = (triton.cdiv(T, cfg.block_m), triton.cdiv(n_out, cfg.block_n))
    _lora_delta_add_kernel[grid](
        x, out, lora.a, lora.b, lora.token_slots, lora.slot_ranks, T, n_in, n_out, x.stride(0), out.stride(0),
        lora.a.stride(0), lora.a.stride(1), lora.b.stride(0), lora.b.stride(1), BM=cfg.block_m,
        BN=cfg.block_n, RC=16, BK=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
