"""Dense LoRA mode "planned": cuBLAS for the base, then the delta over the rows grouped by slot.

Shape legend: `base`'s, and BM rows per plan block.
  row_plan: the routing plan of token_slots as [T, 1] ids over S "experts" (`lora.batch.plan_step`)
  planned_delta_kernel: program (block, column split): y[rows] += (x[rows] @ A_s^T) @ B_s^T
Why: a program per block of one slot's rows costs the same for 1 or 8 adapters (split's expand: once per lane).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moelora.kernels.checks import cdiv
from moelora.kernels.dense_lora.base import Segments, base_gemm
from moelora.kernels.lora_tiles import lora_b_tile_cols, lora_shrink_rows
from moelora.kernels.moe_plan import MoERoutingPlan, build_routing_plan
from moelora.kernels.pdl import pdl_args, pdl_wait


class Planned:
    name = "planned"

    @staticmethod
    def run(x, weight, bias, lora, out, cfg, side_stream=None) -> None:
        base_gemm(x, weight, bias, out)
        if lora is not None:
            add_delta(x, out, lora, cfg)


def add_delta(x, out, lora, cfg) -> None:
    """out += the LoRA delta of its rows, over `lora.row_plan` (built here when missing or of other blocks)."""
    (T, n_out), S = out.shape, lora.a.shape[0]
    plan = lora.row_plan
    if plan is None or plan.block_m != cfg.block_m:
        plan = row_plan(lora.token_slots, S, cfg.block_m, pdl=cfg.pdl)
    seg, a, b = Segments(lora), lora.a, lora.b
    bounds = seg.bounds or (0, n_out)
    planned_delta_kernel[(plan.max_blocks, cdiv(n_out, cfg.plan_cols))](
        x, out, a, b, lora.slot_ranks, plan.sorted_route_ids, plan.expert_of_block, plan.num_padded, T, a.shape[2],
        S, cfg.plan_cols, seg.r_seg, x.stride(0), out.stride(0), a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        BM=plan.block_m, BN=cfg.block_n, BK=cfg.block_k, BLOCK_R=seg.block_r, G=len(bounds) - 1,
        SEG_BOUNDS=tuple(bounds), num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(cfg.pdl, x))


def row_plan(token_slots: torch.Tensor, n_slots: int, block_m: int, *, pdl: bool = False) -> MoERoutingPlan:
    """Slot-sorted, block_m-padded row plan of token_slots [T] int32 (-1: no slot, left out); `pdl`: programmatic
    dependent launch where the GPU has it (`kernels.pdl`)."""
    return build_routing_plan(token_slots.view(-1, 1), max(1, n_slots), block_m, pdl=pdl)


@triton.jit
def _add_expanded(xa, b_s, y_rows, valid, c0, c1, stride_bn, rank, BN: tl.constexpr, BLOCK_R: tl.constexpr):
    """y[rows, c0:c1] += xa @ B_s^T, BN columns a step (fp32 add); rows past `valid` untouched."""
    for n0 in range(c0, c1, BN):
        offs_n = n0 + tl.arange(0, BN)
        bt = lora_b_tile_cols(b_s, offs_n, (offs_n >= n0) & (offs_n < c1), stride_bn, rank, 0, BLOCK_R)
        mask = valid[:, None] & (offs_n[None, :] < c1)
        y = tl.load(y_rows + offs_n[None, :], mask=mask, other=0.0)
        d = tl.dot(xa, bt.to(xa.dtype))
        tl.store(y_rows + offs_n[None, :], (y.to(tl.float32) + d).to(y_rows.dtype.element_ty), mask=mask)


@triton.jit
def planned_delta_kernel(
    src_ptr, y_ptr, a_ptr, b_ptr, ranks_ptr, sorted_ptr, bslot_ptr, num_padded_ptr,
    T, N_in, n_slots, n_per_split, R_SEG, stride_src, stride_yt, stride_as, stride_ar, stride_bs, stride_bn,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BLOCK_R: tl.constexpr, G: tl.constexpr,
    SEG_BOUNDS: tl.constexpr, PDL: tl.constexpr,
):
    """y[rows of block program_id(0), columns of split program_id(1)] += their delta (x shrunk over the full N_in)."""
    pdl_wait(PDL)
    pid_b = tl.program_id(0)
    if pid_b * BM >= tl.load(num_padded_ptr):
        return
    s = tl.load(bslot_ptr + pid_b)
    rows = tl.load(sorted_ptr + pid_b * BM + tl.arange(0, BM))
    valid = rows < T
    n_start = tl.program_id(1) * n_per_split
    n_end = n_start + n_per_split
    b_s = b_ptr + s.to(tl.int64) * stride_bs
    y_rows = y_ptr + rows[:, None].to(tl.int64) * stride_yt
    for g in tl.static_range(G):
        lo = SEG_BOUNDS[g]
        hi = SEG_BOUNDS[g + 1]
        c0 = tl.maximum(n_start, lo)
        c1 = tl.minimum(n_end, hi)
        if c0 < c1:
            rank = tl.load(ranks_ptr + g * n_slots + s)
            if rank > 0:
                a_g = a_ptr + s.to(tl.int64) * stride_as + (g * R_SEG) * stride_ar
                xa = lora_shrink_rows(src_ptr, rows, stride_src, valid, a_g, stride_ar, rank, 0, N_in, BM,
                                      BLOCK_R, BK)
                _add_expanded(xa.to(y_ptr.dtype.element_ty), b_s, y_rows, valid, c0, c1, stride_bn, rank, BN,
                              BLOCK_R)

