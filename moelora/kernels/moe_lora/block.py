"""Routed-expert LoRA path "block": each route's whole delta, per (plan block, slot), before the GEMM that adds it.

Shape legend: `base`'s.
  lora_block_delta_kernel, program (block, lane, N split): one slot's rows of the block shrunk with one tl.dot,
  then expanded into delta [T*K, N] (`deltas`)
Why: a (slot, expert) pair's A and B are read once per block, not once per route.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import triton
import triton.language as tl

from moelora.kernels.checks import cdiv, need_at_least, need_one_of, need_pow2
from moelora.kernels.lora_tiles import drop_largest_slots, lane_count, lora_b_tile, lora_shrink_rows
from moelora.kernels.moe_lora.base import site
from moelora.kernels.moe_lora.deltas import GATE_UP_DELTA_AT, DeltaPath
from moelora.kernels.moe_rows import plan_rows, slot_base
from moelora.kernels.pdl import pdl_args, pdl_wait

BLOCK_TARGET_PROGRAMS = 264  # programs to aim for (2 per SM on a 132-SM H200): the N split fills the rest
BLOCK_LANES = 8  # programs per plan block, one distinct slot each (the last: the rest)


@dataclass(frozen=True)
class BlockConfig:
    """block_n / block_k: expand / shrink step; block_m (0: the plan's): rows a program; programs (0: one an item):
    that many looping programs; gate_up_at: "epilogue", or "activation" (the delta beside the GEMM, side stream)."""

    path: ClassVar[str] = "block"
    block_n: int = 64
    block_k: int = 128
    block_m: int = 0
    programs: int = 0
    gate_up_at: str = "epilogue"

    def __post_init__(self):
        need_pow2("BlockConfig", block_n=self.block_n, block_k=self.block_k)
        need_one_of("BlockConfig", "block_m", self.block_m, (0, 16, 32, 64, 128))
        need_at_least("BlockConfig", 0, programs=self.programs)
        need_one_of("BlockConfig", "gate_up_at", self.gate_up_at, GATE_UP_DELTA_AT)


class Block(DeltaPath):
    name = "block"
    config = BlockConfig
    # the gate_up delta beside its GEMM; 1, 2, 4 programs an H200 SM looping over the items; B column-masked
    refinements = (dict(gate_up_at="activation"), *(dict(programs=p) for p in (132, 264, 528)))

    @classmethod
    def trials(cls, block_m: int) -> list:
        # fewer, wider steps (512: a shorter shrink chain); 16-row programs over larger plan blocks
        wide = [BlockConfig(block_n=bn, block_k=bk) for bn, bk in ((256, 128), (256, 256), (256, 512), (128, 512))]
        sub = [BlockConfig(block_n=bn, block_k=bk, block_m=16) for bn, bk in ((256, 128), (128, 128), (256, 256))]
        return [BlockConfig(), *wide, *(sub if block_m > 16 else [])]

    def delta(self, src, delta, which: str) -> None:
        """delta [T*K, N] of every route with LoRA, per (plan block, slot)."""
        call, cfg, plan, lora = self.call, self.cfg, self.call.plan, self.call.lora
        a, b, ranks = site(lora, which)
        n_out, k_dim = b.shape[2], a.shape[3]
        bn = cfg.block_n
        rows = cfg.block_m or plan.block_m  # a program's rows: routes of distinct tokens, at most T of them
        lanes = lane_count(a.shape[0], plan.num_tokens, rows, BLOCK_LANES)
        # split N only when blocks x lanes alone leave SMs idle (each split repeats the block's shrink)
        n_split = max(1, min(cdiv(n_out, bn), cdiv(BLOCK_TARGET_PROGRAMS, plan.num_routes)))
        per_split = cdiv(cdiv(n_out, n_split), bn) * bn
        sub = max(1, plan.block_m // rows)  # programs per plan block
        grid = (plan.max_blocks * sub, lanes, cdiv(n_out, per_split))
        persist = 0 < cfg.programs < grid[0] * grid[1] * grid[2]
        lora_block_delta_kernel[(cfg.programs,) if persist else grid](
            src, delta, plan.sorted_route_ids, plan.expert_of_block, plan.num_padded, lora.token_slots,
            ranks, a, b, plan.num_routes, plan.top_k, k_dim, n_out, per_split, lanes, src.stride(0),
            delta.stride(0), a.stride(0), a.stride(1), a.stride(2), b.stride(0), b.stride(1), b.stride(2),
            BY_PLAN_ROW=which == "down", BM=plan.block_m, BLOCK_R=call.block_r, BK=cfg.block_k, BN=bn, SUB=sub,
            PERSIST=persist, num_warps=4, **pdl_args(call.pdl, src))


@triton.jit
def lora_block_delta_kernel(
    src_ptr, delta_ptr, sorted_ids_ptr, eob_ptr, num_padded_ptr, slots_ptr, ranks_ptr, a_ptr, b_ptr,
    n_routes, top_k, k_dim, n_out, n_per_split, n_lanes, stride_src, stride_d,
    stride_as, stride_ae, stride_ar, stride_bs, stride_be, stride_bn,
    BY_PLAN_ROW: tl.constexpr, BM: tl.constexpr, BLOCK_R: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr,
    PDL: tl.constexpr, SUB: tl.constexpr = 1, PERSIST: tl.constexpr = False,
):
    """delta[route, n] for sub-block program_id(0) on its lane's slot, split program_id(2); PERSIST: fewer programs
    looping over the items; a slot of rank <= NARROW_R in a wider pool takes NARROW_R-column tiles."""
    pdl_wait(PDL)
    BMS: tl.constexpr = BM // SUB
    live = tl.cdiv(tl.load(num_padded_ptr), BMS)  # sub-blocks holding plan rows
    if PERSIST:
        n_items = live * n_lanes * tl.cdiv(n_out, n_per_split)
        for item in range(tl.program_id(0), n_items, tl.num_programs(0)):
            _block_delta_item(src_ptr, delta_ptr, sorted_ids_ptr, eob_ptr, slots_ptr, ranks_ptr, a_ptr, b_ptr,
                              n_routes, top_k, k_dim, n_out, n_per_split, n_lanes, stride_src, stride_d, stride_as,
                              stride_ae, stride_ar, stride_bs, stride_be, stride_bn, item % live,
                              (item // live) % n_lanes, item // (live * n_lanes), BY_PLAN_ROW, BMS, SUB, BLOCK_R,
                              BK, BN)
    elif tl.program_id(0) < live:
        _block_delta_item(src_ptr, delta_ptr, sorted_ids_ptr, eob_ptr, slots_ptr, ranks_ptr, a_ptr, b_ptr,
                          n_routes, top_k, k_dim, n_out, n_per_split, n_lanes, stride_src, stride_d, stride_as,
                          stride_ae, stride_ar, stride_bs, stride_be, stride_bn, tl.program_id(0), tl.program_id(1),
                          tl.program_id(2), BY_PLAN_ROW, BMS, SUB, BLOCK_R, BK, BN)


NARROW_R = tl.constexpr(16)  # the block delta's rank tile for slots of rank <= 16, whatever the pool's


@triton.jit
def _block_pair_delta(src_ptr, rows, stride_src, sel, a_se, b_se, stride_ar, stride_bn, rank, k_dim, d_rows, n_start,
                      n_end, BMS: tl.constexpr, R: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr):
    """One (slot, expert) pair's delta for the rows in sel: xa = rows @ A[:rank]^T (src's dtype), then xa @ B^T."""
    xa = lora_shrink_rows(src_ptr, rows, stride_src, sel, a_se, stride_ar, rank, 0, k_dim, BMS, R, BK)
    xa = xa.to(src_ptr.dtype.element_ty)
    for n0 in range(n_start, n_end, BN):
        offs_n = n0 + tl.arange(0, BN)
        d = tl.dot(xa, lora_b_tile(b_se, offs_n, n_end, stride_bn, rank, 0, R).to(xa.dtype))
        tl.store(d_rows + offs_n[None, :], d.to(d_rows.dtype.element_ty), mask=sel[:, None] & (offs_n[None, :] < n_end))


@triton.jit
def _block_delta_item(src_ptr, delta_ptr, sorted_ids_ptr, eob_ptr, slots_ptr, ranks_ptr, a_ptr, b_ptr, n_routes,
                      top_k, k_dim, n_out, n_per_split, n_lanes, stride_src, stride_d, stride_as, stride_ae,
                      stride_ar, stride_bs, stride_be, stride_bn, pid_m, lane, pid_n, BY_PLAN_ROW: tl.constexpr,
                      BMS: tl.constexpr, SUB: tl.constexpr, BLOCK_R: tl.constexpr, BK: tl.constexpr,
                      BN: tl.constexpr):
    """One (sub-block, lane, split) item of `lora_block_delta_kernel`."""
    e = tl.load(eob_ptr + pid_m // SUB).to(tl.int64)
    offs_m, route, valid, tok = plan_rows(sorted_ids_ptr, pid_m, n_routes, top_k, BMS)
    rows = offs_m if BY_PLAN_ROW else tok  # down: h rows are plan rows; gate_up: x rows are tokens
    slot, s = drop_largest_slots(tl.load(slots_ptr + tok, mask=valid, other=-1), lane)
    n_start = pid_n * n_per_split
    n_end = tl.minimum(n_out, n_start + n_per_split)
    last = lane == n_lanes - 1
    while s >= 0:
        sel = slot == s
        rank = tl.load(ranks_ptr + s)
        if rank > 0:
            a_se = slot_base(a_ptr, s, e, stride_as, stride_ae)
            b_se = slot_base(b_ptr, s, e, stride_bs, stride_be)
            d_rows = delta_ptr + route[:, None].to(tl.int64) * stride_d
            if BLOCK_R > NARROW_R:
                if rank <= NARROW_R:  # a narrow adapter in a wide pool: tiles of its width, not the pool's
                    _block_pair_delta(src_ptr, rows, stride_src, sel, a_se, b_se, stride_ar, stride_bn, rank, k_dim,
                                      d_rows, n_start, n_end, BMS, NARROW_R, BK, BN)
                else:
                    _block_pair_delta(src_ptr, rows, stride_src, sel, a_se, b_se, stride_ar, stride_bn, rank, k_dim,
                                      d_rows, n_start, n_end, BMS, BLOCK_R, BK, BN)
            else:
                _block_pair_delta(src_ptr, rows, stride_src, sel, a_se, b_se, stride_ar, stride_bn, rank, k_dim,
                                  d_rows, n_start, n_end, BMS, BLOCK_R, BK, BN)
        slot = tl.where(sel, -1, slot)
        s = tl.where(last, tl.max(slot, axis=0), -1)  # a lane below the last takes one slot
