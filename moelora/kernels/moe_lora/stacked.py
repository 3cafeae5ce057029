"""Routed-expert LoRA path "stacked": every slot's xa side by side, expanded as more K steps of the GEMMs.

Shape legend: `base`'s, and CW stacked columns a shrink program.
  lora_stacked_shrink_kernel: xa_stacked [P, S * BLOCK_R] (x's dtype), a row's xa in its slot's lane
  each GEMM: += xa_stacked @ B_stacked[e] as more K steps, one slot's lane a step
Why: a dense shrink and no branch between K steps (prefill). Pools wider than STACK_MAX_COLS slot columns take
`StackedConfig.overflow` ("separate").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
import triton
import triton.language as tl

from moelora.kernels.checks import cdiv, need_pow2, next_pow2
from moelora.kernels.lora_tiles import add_expand, rank_of, stacked_columns, stacked_slot_ranks
from moelora.kernels.moe_lora.base import ShrinkFirst, site
from moelora.kernels.moe_lora.separate import Separate, SeparateConfig
from moelora.kernels.moe_rows import plan_rows, slot_base
from moelora.kernels.pdl import pdl_args, pdl_wait

STACK_MAX_COLS = 512  # up to this many slot columns (8 slots of rank 64; 32 of 16): 25 MB of xa at M=4096
STACK_RC = tl.constexpr(32)  # rank columns a down expand dot (a 64-wide one: 162 registers, one 128-row CTA an SM)
STACK_BK = 64  # shrink depth step ([128, 64] x [64, 128] tiles, 3 stages: 96 KB of shared memory)


@dataclass(frozen=True)
class StackedConfig:
    """stack_n: stacked columns a shrink program; overflow: the "separate" config of pools too wide to stack."""

    path: ClassVar[str] = "stacked"
    stack_n: int = 128
    overflow: SeparateConfig = field(default_factory=SeparateConfig)

    def __post_init__(self):
        need_pow2("StackedConfig", stack_n=self.stack_n)


class Stacked(ShrinkFirst):
    name = "stacked"
    config = StackedConfig

    @classmethod
    def trials(cls, block_m: int) -> list:
        return [StackedConfig(stack_n=n) for n in (64, 128)]

    @classmethod
    def resolve(cls, cfg: StackedConfig, n_slots: int, block_r: int):
        return (Separate, cfg.overflow) if n_slots * block_r > STACK_MAX_COLS else (cls, cfg)

    def __init__(self, call, cfg: StackedConfig):
        super().__init__(call, cfg)
        # the gate_up and then the down shrink's, in x's dtype (the twin rounds xa so)
        x = call.x
        self.xa = torch.empty(call.rows, call.n_slots * call.block_r, dtype=x.dtype, device=x.device)

    def _epilogue(self) -> dict:
        return dict(xa_ptr=self.xa, stride_xa=self.xa.stride(0), STACKED=True,
                    S_P2=next_pow2(self.call.n_slots))

    def _shrink(self, src: torch.Tensor, which: str, gather: bool) -> None:
        """xa [P, S * block_r]: each plan row's src @ A^T in its slot's lane of columns."""
        call, xa, plan, lora = self.call, self.xa, self.call.plan, self.call.lora
        a, _, ranks = site(lora, which)
        cw = min(self.cfg.stack_n, next_pow2(xa.shape[1]))
        lora_stacked_shrink_kernel[(plan.max_blocks, cdiv(xa.shape[1], cw))](
            src, xa, plan.sorted_route_ids, plan.expert_of_block, plan.num_padded, lora.token_slots, ranks, a,
            plan.num_routes, plan.top_k, a.shape[3], a.shape[0], src.stride(0), xa.stride(0), a.stride(0),
            a.stride(1), a.stride(2), GATHER_TOKENS=gather, BM=plan.block_m, BLOCK_R=call.block_r, CW=cw, BK=STACK_BK,
            S_P2=next_pow2(a.shape[0]), num_warps=4, num_stages=3,
            **pdl_args(call.pdl, src))


@triton.jit
def lora_stacked_shrink_kernel(
    src_ptr, xa_ptr, sorted_ids_ptr, eob_ptr, num_padded_ptr, slots_ptr, ranks_ptr, a_ptr,
    n_routes, top_k, k_dim, n_slots, stride_src, stride_xa, stride_as, stride_ae, stride_ar,
    GATHER_TOKENS: tl.constexpr, BM: tl.constexpr, BLOCK_R: tl.constexpr, CW: tl.constexpr, BK: tl.constexpr,
    S_P2: tl.constexpr, PDL: tl.constexpr,
):
    """xa_stacked[row, c] for program_id(1)'s CW columns and plan block program_id(0): src row @ A[slot, e]^T in
    the row's slot's lane, 0 elsewhere; one tl.dot a K step over all the block's slots."""
    pdl_wait(PDL)
    pid_m = tl.program_id(0)
    if pid_m * BM >= tl.load(num_padded_ptr):
        return
    offs_m, route, valid, tok = plan_rows(sorted_ids_ptr, pid_m, n_routes, top_k, BM)
    slot = tl.load(slots_ptr + tok, mask=valid, other=-1)
    cols, s_col, r_col, live = stacked_columns(stacked_slot_ranks(slot, ranks_ptr, n_slots, S_P2),
                                               tl.program_id(1) * CW, BLOCK_R, CW, S_P2)
    own = slot[:, None] == s_col[None, :]
    mine = tl.max(own.to(tl.int32), axis=1) > 0  # rows on a slot of these columns
    acc = tl.zeros((BM, CW), tl.float32)
    if tl.max(mine.to(tl.int32), axis=0) > 0:
        e = tl.load(eob_ptr + pid_m).to(tl.int64)
        rows = tok if GATHER_TOKENS else offs_m
        a_cols = a_ptr + s_col.to(tl.int64) * stride_as + e * stride_ae + r_col * stride_ar
        for k0 in range(0, k_dim, BK):
            offs_k = k0 + tl.arange(0, BK)
            k_ok = offs_k < k_dim
            xt = tl.load(src_ptr + rows[:, None].to(tl.int64) * stride_src + offs_k[None, :],
                         mask=mine[:, None] & k_ok[None, :], other=0.0)
            at = tl.load(a_cols[None, :] + offs_k[:, None], mask=live[None, :] & k_ok[:, None], other=0.0)
            acc = tl.dot(xt, at.to(xt.dtype), acc)
    xa = tl.where(own, acc, 0.0).to(xa_ptr.dtype.element_ty)
    tl.store(xa_ptr + offs_m[:, None].to(tl.int64) * stride_xa + cols[None, :], xa,
             mask=(cols < n_slots * BLOCK_R)[None, :])


@triton.jit
def stacked_epilogue(acc_g, acc_u, slots_ptr, ranks_ptr, tok, valid, offs_m, e, xa_ptr, stride_xa, b_ptr, offs_n,
                     n_limit, stride_bs, stride_be, stride_bn, n_slots, BLOCK_R: tl.constexpr, S_P2: tl.constexpr,
                     TWO: tl.constexpr):
    """"stacked": xa_stacked @ B_stacked[e] as more K steps, one lane of BLOCK_R columns a step, from the block's
    smallest slot to its largest (absent slots between load nothing: no branch a lane, which cost 1-8 % where every
    slot is present); acc_g / acc_u / TWO as `add_expand`. The down GEMM's lanes go STACK_RC rank columns a dot
    (unrolled), so its 128-row tiles keep two CTAs an SM at rank 64; gate_up's (one CTA an SM by its shared memory)
    stay whole lanes."""
    slot = tl.load(slots_ptr + tok, mask=valid, other=-1)
    slot_ranks = stacked_slot_ranks(slot, ranks_ptr, n_slots, S_P2)
    RC: tl.constexpr = BLOCK_R if TWO else min(BLOCK_R, STACK_RC)
    xa_rows = xa_ptr + offs_m[:, None].to(tl.int64) * stride_xa + tl.arange(0, RC)[None, :]
    first = tl.min(tl.where(slot >= 0, slot, n_slots), axis=0)  # the lanes below hold zeros only
    for s in range(first, tl.max(slot, axis=0) + 1):
        for c in tl.static_range(0, BLOCK_R, RC):
            acc_g, acc_u = add_expand(acc_g, acc_u, tl.load(xa_rows + s * BLOCK_R + c),
                                      slot_base(b_ptr, s, e, stride_bs, stride_be), offs_n, n_limit, stride_bn,
                                      rank_of(slot_ranks, s, S_P2), c, RC, TWO)
    return acc_g, acc_u
