"""Dense multi-LoRA delta over a slot-sorted row plan ("planned" mode of `lora_linear`).

Shape legend: T tokens, N_in / N_out features, S adapter slots, R pool rank per segment
(BLOCK_R = pow2 >= max(16, R)), G output segments, BM rows per plan block, P plan rows (max_padded).

The rows are grouped by adapter slot with the routing plan of the routed experts
(`moe_plan.build_routing_plan` on token_slots as [T, 1] "expert" ids over S "experts"): each slot's
rows listed in ascending order and padded to BM with the sentinel T, so a plan block holds the rows
of exactly one slot; rows on no slot (-1) are in no block. `row_plan` builds it; the engine's runners
build it once per step (`LoRABatch.with_row_plan`) and every dense site reads it.

`planned_delta_kernel`: program (plan block b, column split j) adds to y[rows of b, columns of j]
the delta of its slot s: for each segment g its columns overlap, xa = x[rows] @ A_g,s[:rank_g]^T
over the full N_in (fp32, rounded to x's dtype: the twin's precision), then y[rows, n] += xa @
B_s[n, :rank_g]^T tile by tile (read, add in fp32, store). One launch, no partials buffer, no slot
lanes: a program serves one slot, so its loads are one A (rank rows) and one B stripe. Every
(row, column) belongs to one program: no atomics, deterministic. The shrink is repeated by each
column split of a block, from L2 (x rows and A are a few tens of KB).

`plan_shrink` "split" (the same kernel with SPLIT > 0): the shrink is the split
path's (N_in in chunks, fp32 partials per row, on the LoRA side stream next to cuBLAS when there is
one), and the planned program only sums its rows' partials and expands: the full-depth shrink leaves
the critical path. H200: never the fastest with 8 adapters; with one, the fastest only from 512 rows
(q/k/v T=1024 56.6 -> 50.6 us): the default stays "fused" (docs/benchmarks.md).

Why: the split path's expand at decode batches of 64-256 rows spread over 8 adapters runs its
[BM, BN] tiles once per slot lane (8x the programs, each with a full-size accumulator); H200,
merged q/k/v 2048->5120 at T=256, 8 adapters r16: 42.2 us per call vs cuBLAS 10.8 (benchmarks.md).
Grid: (plan max_blocks, splits) from shapes only, so it is CUDA-graph safe; programs past the
plan's padded count exit after one load.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moelora.kernels.lora_tiles import lora_b_tile_cols, lora_shrink_rows
from moelora.kernels.moe_plan import MoERoutingPlan, build_routing_plan


def row_plan(token_slots: torch.Tensor, n_slots: int, block_m: int) -> MoERoutingPlan:
    """Slot-sorted, block_m-padded row plan of token_slots [T] int32 (-1: no slot, left out)."""
    return build_routing_plan(token_slots.view(-1, 1), max(1, n_slots), block_m)


@triton.jit
def _add_expanded(xa, b_s, y_rows, valid, c0, c1, stride_bn, rank, BN: tl.constexpr, BLOCK_R: tl.constexpr):
    """y[rows, n] += xa @ B_s[n, :rank]^T for n in [c0, c1), BN columns at a time (read, add in fp32,
    store); xa [BM, BLOCK_R] in y's dtype, y_rows the rows' pointers [BM, 1], rows past `valid` untouched."""
    for n0 in range(c0, c1, BN):
        offs_n = n0 + tl.arange(0, BN)
        bt = lora_b_tile_cols(b_s, offs_n, n0, c1, stride_bn, rank, 0, BLOCK_R)
        mask = valid[:, None] & (offs_n[None, :] < c1)
        y = tl.load(y_rows + offs_n[None, :], mask=mask, other=0.0)
        d = tl.dot(xa, bt.to(xa.dtype))
        tl.store(y_rows + offs_n[None, :], (y.to(tl.float32) + d).to(y_rows.dtype.element_ty), mask=mask)


@triton.jit
def planned_delta_kernel(
    src_ptr, y_ptr, a_ptr, b_ptr, ranks_ptr, sorted_ptr, bslot_ptr, num_padded_ptr,
    T, N_in, n_slots, n_per_split, R_SEG, stride_src, stride_yt, stride_as, stride_ar, stride_bs, stride_bn,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BLOCK_R: tl.constexpr, G: tl.constexpr,
    SEG_BOUNDS: tl.constexpr, SPLIT: tl.constexpr = 0,
):
    """y[rows of plan block program_id(0), columns of split program_id(1)] += their LoRA delta;
    see the module docstring. SEG_BOUNDS: G + 1 column bounds (G = 1: (0, N_out)); ranks [G, S].
    SPLIT 0: src is x [T, N_in] (row stride stride_src), shrunk here over the full N_in; SPLIT > 0
    (`plan_shrink` "split"): src is the split path's xa [SPLIT, T, G * BLOCK_R] (fp32 partials over
    N_in chunks, each row's own slot; partial stride stride_src), summed here (A is not read)."""
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
                if SPLIT == 0:
                    a_g = a_ptr + s.to(tl.int64) * stride_as + (g * R_SEG) * stride_ar
                    xa = lora_shrink_rows(src_ptr, rows, stride_src, valid, a_g, stride_ar, rank, 0, N_in, BM,
                                          BLOCK_R, BK)
                else:
                    xa_rows = (src_ptr + rows[:, None].to(tl.int64) * (G * BLOCK_R) + g * BLOCK_R
                               + tl.arange(0, BLOCK_R)[None, :])
                    xa = tl.zeros((BM, BLOCK_R), tl.float32)
                    for p in tl.static_range(SPLIT):
                        xa += tl.load(xa_rows + p * stride_src, mask=valid[:, None], other=0.0)
                _add_expanded(xa.to(y_ptr.dtype.element_ty), b_s, y_rows, valid, c0, c1, stride_bn, rank, BN,
                              BLOCK_R)


def planned_delta(src: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slot_ranks: torch.Tensor,
                  plan: MoERoutingPlan, bounds: tuple[int, ...], r_seg: int, block_r: int, cols_per_program: int,
                  block_n: int, block_k: int, num_warps: int, num_stages: int) -> None:
    """out[t] += its LoRA delta for the rows of `plan` (slot s of their block). src: x [T, N_in]
    (shrunk here) or the split path's xa [P, T, G block_r] fp32 partials (`plan_shrink` "split": A
    is not read). a [S, G r_seg, N_in], b [S, N_out, r_seg], slot_ranks [G, S]
    (or [S] with G = 1) contiguous, bounds the G + 1 column bounds of the segments;
    cols_per_program: columns a program covers (a multiple of block_n)."""
    partials = src.dim() == 3
    grid = (plan.max_blocks, triton.cdiv(bounds[-1], cols_per_program))
    planned_delta_kernel[grid](
        src, out, a, b, slot_ranks, plan.sorted_route_ids, plan.expert_of_block, plan.num_padded,
        out.shape[0], a.shape[2], a.shape[0], cols_per_program, r_seg, src.stride(0), out.stride(0), a.stride(0),
        a.stride(1), b.stride(0), b.stride(1), BM=plan.block_m, BN=block_n, BK=block_k, BLOCK_R=block_r,
        G=len(bounds) - 1, SEG_BOUNDS=tuple(bounds), SPLIT=src.shape[0] if partials else 0, num_warps=num_warps,
        num_stages=num_stages)


def planned_cols(T: int, n_out: int, n_slots: int, block_m: int, block_n: int, target_programs: int) -> int:
    """Columns per program so that the plan's likely blocks (T / BM plus a partial one per slot)
    times the column splits reach about `target_programs`; a multiple of block_n."""
    blocks = triton.cdiv(T, block_m) + min(n_slots, T) // 2
    splits = max(1, min(triton.cdiv(n_out, block_n), triton.cdiv(target_programs, max(1, blocks))))
    return triton.cdiv(triton.cdiv(n_out, splits), block_n) * block_n
