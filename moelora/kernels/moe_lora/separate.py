"""Routed-expert LoRA path "separate": a shrink kernel before each GEMM, the expand in its epilogue.

Shape legend: `base`'s, and SPLIT shrink partials.
  lora_shrink_kernel: src rows (x by token, or h by plan row) @ A^T -> xa [SPLIT, P, BLOCK_R] fp32
The default config's path and the "stacked" overflow: A and B read once per (plan block, slot).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import triton
import triton.language as tl

from moelora.kernels.checks import cdiv, need_at_least, need_pow2
from moelora.kernels.lora_tiles import add_expand, lora_shrink_rows
from moelora.kernels.moe_lora.base import LORA_RC, ShrinkFirst, site
from moelora.kernels.moe_rows import plan_rows, slot_base
from moelora.kernels.pdl import pdl_args, pdl_wait


@dataclass(frozen=True)
class SeparateConfig:
    """split_k: partials of each shrink (many when there are few plan blocks); block_k: its depth step."""

    path: ClassVar[str] = "separate"
    split_k: int = 8
    block_k: int = 128

    def __post_init__(self):
        need_at_least("SeparateConfig", 1, split_k=self.split_k)
        need_pow2("SeparateConfig", block_k=self.block_k)


class Separate(ShrinkFirst):
    name = "separate"
    config = SeparateConfig

    @classmethod
    def trials(cls, block_m: int) -> list:
        return [SeparateConfig(split_k=k) for k in (1, 4, 8)]

    def __init__(self, call, cfg: SeparateConfig):
        super().__init__(call, cfg)
        # the gate_up and then the down shrink's partials, one buffer for both
        self.xa = torch.empty(cfg.split_k, call.rows, call.block_r, dtype=torch.float32, device=call.x.device)

    def _epilogue(self) -> dict:
        return dict(xa_ptr=self.xa, XA_SPLIT=self.cfg.split_k, stride_xa=self.xa.stride(0), HAS_LORA=True,
                    LORA_BK=self.cfg.block_k)

    def _shrink(self, src: torch.Tensor, which: str, gather: bool) -> None:
        call, cfg, xa = self.call, self.cfg, self.xa
        plan, lora = call.plan, call.lora
        a, _, ranks = site(lora, which)
        k_dim = a.shape[3]
        k_split = cdiv(cdiv(k_dim, cfg.split_k), cfg.block_k) * cfg.block_k
        lora_shrink_kernel[(plan.max_blocks, cfg.split_k)](
            src, xa, plan.sorted_route_ids, plan.expert_of_block, plan.num_padded, lora.token_slots,
            ranks, a, plan.num_routes, plan.top_k, k_dim, k_split, xa.shape[1], src.stride(0),
            a.stride(0), a.stride(1), a.stride(2), GATHER_TOKENS=gather, BM=plan.block_m, BLOCK_R=call.block_r,
            LORA_BK=cfg.block_k, LORA_RC=LORA_RC, num_warps=4, num_stages=2, **pdl_args(call.pdl, src))


@triton.jit
def lora_shrink_kernel(
    src_ptr, xa_ptr, sorted_ids_ptr, eob_ptr, num_padded_ptr, slots_ptr, ranks_ptr, a_ptr,
    n_routes, top_k, k_dim, k_split, P, stride_src, stride_as, stride_ae, stride_ar,
    GATHER_TOKENS: tl.constexpr, BM: tl.constexpr, BLOCK_R: tl.constexpr, LORA_BK: tl.constexpr,
    LORA_RC: tl.constexpr, PDL: tl.constexpr,
):
    """xa[sp, rows, :rank] = src rows @ A[s, e, :rank, k-split sp]^T, slot by slot; grid (blocks, SPLIT)."""
    pdl_wait(PDL)
    pid_m = tl.program_id(0)
    sp = tl.program_id(1)
    if pid_m * BM >= tl.load(num_padded_ptr):
        return
    e = tl.load(eob_ptr + pid_m).to(tl.int64)
    offs_m, route, valid, tok = plan_rows(sorted_ids_ptr, pid_m, n_routes, top_k, BM)
    rows = tok if GATHER_TOKENS else offs_m
    k_start = sp * k_split
    k_end = tl.minimum(k_dim, k_start + k_split)
    slot = tl.load(slots_ptr + tok, mask=valid, other=-1)
    s = tl.max(slot, axis=0)
    while s >= 0:
        sel = slot == s
        rank = tl.load(ranks_ptr + s)
        a_se = slot_base(a_ptr, s, e, stride_as, stride_ae)
        for r0 in range(0, rank, LORA_RC):  # only the slot's own rank columns, LORA_RC at a time
            part = lora_shrink_rows(src_ptr, rows, stride_src, sel, a_se + r0 * stride_ar, stride_ar, rank - r0,
                                    k_start, k_end, BM, LORA_RC, LORA_BK)
            tl.store(xa_ptr + (sp * P + offs_m[:, None]).to(tl.int64) * BLOCK_R + (r0 + tl.arange(0, LORA_RC))[None, :],
                     part, mask=sel[:, None])
        slot = tl.where(sel, -1, slot)
        s = tl.max(slot, axis=0)


@triton.jit
def _xa_chunk(xa_ptr, xa_off, sel, split_stride, r0, SPLIT: tl.constexpr, RC: tl.constexpr):
    """Rank columns [r0, r0+RC) of the block's xa summed over the SPLIT partials; rows not in sel give 0."""
    offs_r = r0 + tl.arange(0, RC)
    xa = tl.zeros((xa_off.shape[0], RC), tl.float32)
    for sp in tl.static_range(SPLIT):
        xa += tl.load(xa_ptr + sp * split_stride + xa_off[:, None] + offs_r[None, :], mask=sel[:, None], other=0.0)
    return xa


@triton.jit
def separate_epilogue(acc_g, acc_u, src_ptr, slot, e, offs_m, ranks_ptr, b_ptr, xa_ptr, offs_n, n_limit, stride_bs,
                      stride_be, stride_bn, num_blocks, BM: tl.constexpr, BLOCK_R: tl.constexpr,
                      XA_SPLIT: tl.constexpr, LORA_RC: tl.constexpr, TWO: tl.constexpr):
    """"separate": expand xa slot by slot, LORA_RC rank columns a step; acc_g / acc_u / TWO as `add_expand`."""
    dt = src_ptr.dtype.element_ty
    xa_off = offs_m.to(tl.int64) * BLOCK_R
    s = tl.max(slot, axis=0)
    while s >= 0:
        sel = slot == s
        rank = tl.load(ranks_ptr + s)
        b_se = slot_base(b_ptr, s, e, stride_bs, stride_be)
        for r0 in range(0, rank, LORA_RC):
            xs = _xa_chunk(xa_ptr, xa_off, sel, num_blocks * BM * BLOCK_R, r0, XA_SPLIT, LORA_RC).to(dt)
            acc_g, acc_u = add_expand(acc_g, acc_u, xs, b_se, offs_n, n_limit, stride_bn, rank, r0, LORA_RC, TWO)
        slot = tl.where(sel, -1, slot)
        s = tl.max(slot, axis=0)
    return acc_g, acc_u
