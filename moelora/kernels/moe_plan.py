"""Routing plan on the device: expert-sorted, block-padded route order (contract 3).

Shape legend: T tokens, K top-k, E experts, BM = block_m rows per GEMM block, C routes per chunk,
P = max_padded = max_blocks * BM (from T, K, E, BM only: `plan_capacity`).
A counting sort, fixed sizes, no host sync (CUDA-graph safe), one writer per output position: one launch of E
programs for small batches, else count / scan / scatter; bit-identical to `reference.build_routing_plan_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moelora.kernels.args import MoERoutingPlan
from moelora.kernels.checks import cdiv, next_pow2
from moelora.kernels.pdl import pdl_args, pdl_wait
from moelora.kernels.reference import local_expert_ids, plan_capacity

# Up to this many routes, one launch of E programs (each re-counting all ids) beats three launches
_PER_EXPERT_MAX_ROUTES = 4096
# Chunk bases a scan program writes a step down its expert's column: one step up to 131072 routes (chunks of 128)
_SCAN_COLS = 1024


@triton.jit
def _expert_layout(e, counts, sorted_ptr, eob_ptr, num_padded_ptr, n_routes, E, max_blocks,
                   BM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr):
    """Program e's share of the layout from every expert's counts: expert e's padding sentinels and blocks, every
    E-th block past the padded total, num_padded (program 0); returns expert e's first row."""
    cols = tl.arange(0, BLOCK_E)
    padded = (counts + BM - 1) // BM * BM
    poff = tl.cumsum(padded, axis=0) - padded
    total = tl.sum(padded, axis=0)
    mine = cols == e
    count = tl.sum(tl.where(mine, counts, 0), axis=0)
    off = tl.sum(tl.where(mine, poff, 0), axis=0)
    j = tl.arange(0, BM)
    n_pad = (count + BM - 1) // BM * BM - count
    tl.store(sorted_ptr + off + count + j, tl.full((BM,), 0, tl.int32) + n_routes, mask=j < n_pad)
    for b0 in range(0, (count + n_pad) // BM, BLOCK_B):
        blk = b0 + tl.arange(0, BLOCK_B)
        tl.store(eob_ptr + off // BM + blk, tl.full((BLOCK_B,), 0, tl.int32) + e,
                 mask=blk < (count + n_pad) // BM)
    for b in range(total // BM + e, max_blocks, E):  # the tail: blocks past the padded total
        tl.store(eob_ptr + b, -1)
        tl.store(sorted_ptr + b * BM + j, tl.full((BM,), 0, tl.int32) + n_routes)
    if e == 0:
        tl.store(num_padded_ptr, total)
    return off


@triton.jit(do_not_specialize=["max_blocks"])  # not a function of T's class: warmup.py
def _plan_expert_kernel(ids_ptr, sorted_ptr, eob_ptr, num_padded_ptr, n_routes, E, max_blocks,
                        BM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr,
                        PDL: tl.constexpr):
    """Program e: histograms all n ids as one vector, then writes only expert e's routes, padding and blocks (and a
    share of the tail); no chunk loop (the chunked one-hot it replaced was 7x slower: docs/performance.md)."""
    pdl_wait(PDL)
    e = tl.program_id(0)
    offs = tl.arange(0, BLOCK_N)
    valid = offs < n_routes
    ids = tl.load(ids_ptr + offs, mask=valid, other=0).to(tl.int32)
    valid = valid & (ids >= 0)  # -1: another rank's expert (an expert map), in no block
    ids = tl.where(valid, ids, 0)
    counts = tl.histogram(ids, BLOCK_E, mask=valid)
    off = _expert_layout(e, counts, sorted_ptr, eob_ptr, num_padded_ptr, n_routes, E, max_blocks, BM, BLOCK_E,
                         BLOCK_B)
    sel = (valid & (ids == e)).to(tl.int32)
    tl.store(sorted_ptr + off + tl.cumsum(sel, axis=0) - 1, offs, mask=sel != 0)


@triton.jit
def _plan_count_kernel(ids_ptr, counts_ptr, n_routes, C: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    c = tl.program_id(0)
    offs = c * C + tl.arange(0, C)
    valid = offs < n_routes
    e = tl.load(ids_ptr + offs, mask=valid, other=0).to(tl.int32)
    valid = valid & (e >= 0)
    e = tl.where(valid, e, 0)
    tl.store(counts_ptr + c * BLOCK_E + tl.arange(0, BLOCK_E), tl.histogram(e, BLOCK_E, mask=valid))


@triton.jit(do_not_specialize=["n_chunks", "max_blocks"])  # not a function of T's class: warmup.py
def _plan_scan_kernel(counts_ptr, base_ptr, sorted_ptr, eob_ptr, num_padded_ptr, n_chunks, n_routes, E,
                      max_blocks, BM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr,
                      TILE_C: tl.constexpr, COLS: tl.constexpr, PDL: tl.constexpr):
    """Program e: every expert's total (the counts summed, TILE_C chunks a load), expert e's share of the layout,
    then its column of chunk bases (COLS chunks a step). One program for all of it took 29 µs at 32768 routes
    (docs/performance.md)."""
    pdl_wait(PDL)
    e = tl.program_id(0)
    cols = tl.arange(0, BLOCK_E)
    rows = tl.arange(0, TILE_C)
    counts = tl.zeros((BLOCK_E,), tl.int32)
    for c0 in range(0, n_chunks, TILE_C):
        tile_off = (c0 + rows)[:, None] * BLOCK_E + cols[None, :]
        counts += tl.sum(tl.load(counts_ptr + tile_off, mask=(c0 + rows)[:, None] < n_chunks, other=0), axis=0)
    run = _expert_layout(e, counts, sorted_ptr, eob_ptr, num_padded_ptr, n_routes, E, max_blocks, BM, BLOCK_E,
                         BLOCK_B)
    chunks = tl.arange(0, COLS)
    for c0 in range(0, n_chunks, COLS):
        ok = c0 + chunks < n_chunks
        col = tl.load(counts_ptr + (c0 + chunks) * BLOCK_E + e, mask=ok, other=0)
        tl.store(base_ptr + (c0 + chunks) * BLOCK_E + e, run + tl.cumsum(col, axis=0) - col, mask=ok)
        run += tl.sum(col, axis=0)


@triton.jit
def _plan_scatter_kernel(ids_ptr, base_ptr, sorted_ptr, n_routes, C: tl.constexpr, BLOCK_E: tl.constexpr,
                         PDL: tl.constexpr):
    """Program c: route i goes to base[c, e_i] + the chunk's earlier routes on e_i (a [C, C] compare, whatever E)."""
    pdl_wait(PDL)
    c = tl.program_id(0)
    j = tl.arange(0, C)
    offs = c * C + j
    valid = offs < n_routes
    e = tl.load(ids_ptr + offs, mask=valid, other=0).to(tl.int32)
    valid = valid & (e >= 0)  # another rank's route (-1) is placed nowhere; it never equals a local id
    earlier = (e[:, None] == e[None, :]) & (j[None, :] < j[:, None])  # padding ids sit after every route
    rank = tl.sum(earlier.to(tl.int32), axis=1)
    base = tl.load(base_ptr + c * BLOCK_E + e, mask=valid, other=0)
    tl.store(sorted_ptr + base + rank, offs, mask=valid)


def build_routing_plan(topk_ids: torch.Tensor, num_experts: int, block_m: int, *,
                       expert_map: torch.Tensor | None = None, pdl: bool = False) -> MoERoutingPlan:
    """Expert-sorted, block_m-padded plan of topk_ids [T, K]; ValueError for a bad block_m or ids. `expert_map`
    [E_global] int32: only the routes to this rank's experts, their local ids kept as `local_ids`; `pdl`:
    programmatic dependent launch where the GPU has it (`kernels.pdl`)."""
    if topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be [T, K] int32/int64, got {tuple(topk_ids.shape)} {topk_ids.dtype}")
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two >= 16, got {block_m}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    T, K = topk_ids.shape
    local = None if expert_map is None else local_expert_ids(topk_ids, expert_map)
    n = T * K
    max_padded, max_blocks = plan_capacity(n, num_experts, block_m)
    dev = topk_ids.device
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=dev)
    eob = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    plan = MoERoutingPlan(sorted_route_ids=sorted_ids, expert_of_block=eob, num_padded=num_padded,
                          block_m=block_m, num_tokens=T, top_k=K, num_experts=num_experts, local_ids=local)
    if n == 0:
        num_padded.zero_()
        return plan
    ids = (topk_ids if local is None else local).contiguous().view(-1)
    block_e = max(16, next_pow2(num_experts))
    # a constexpr from n's power-of-two range, not from max_blocks itself: one compile a range (warmup.py)
    block_b = max(16, min(128, 4096 // block_m, next_pow2(plan_capacity(next_pow2(n), num_experts, block_m)[1])))
    if n <= _PER_EXPERT_MAX_ROUTES:
        warps = 4 if n <= 1024 else 8
        # at least one id per thread: tl.histogram over a layout that repeats ids across threads
        # relies on the compiler dividing the repeats out; with none there is nothing to divide
        block_n = max(32 * warps, next_pow2(n))
        _plan_expert_kernel[(num_experts,)](ids, sorted_ids, eob, num_padded, n, num_experts, max_blocks,
                                            BM=block_m, BLOCK_N=block_n, BLOCK_E=block_e, BLOCK_B=block_b,
                                            num_warps=warps, **pdl_args(pdl, ids))
        return plan
    chunk = 128  # the scatter compares [chunk, chunk] pairs; the count's histogram wants >= 32 ids a warp
    n_chunks = cdiv(n, chunk)
    # 8192 counts per scan tile: 32 a thread at 8 warps; 16384 took 200 B of stack (sm_90, E=128, BM=128)
    tile_c = min(next_pow2(n_chunks), max(1, 8192 // block_e))
    counts = torch.empty(n_chunks, block_e, dtype=torch.int32, device=dev)
    bases = torch.empty_like(counts)
    launch = pdl_args(pdl, ids)
    _plan_count_kernel[(n_chunks,)](ids, counts, n, C=chunk, BLOCK_E=block_e, num_warps=4, **launch)
    _plan_scan_kernel[(num_experts,)](counts, bases, sorted_ids, eob, num_padded, n_chunks, n, num_experts,
                                      max_blocks, BM=block_m, BLOCK_E=block_e, BLOCK_B=block_b, TILE_C=tile_c,
                                      COLS=min(_SCAN_COLS, next_pow2(n_chunks)), num_warps=8, **launch)
    _plan_scatter_kernel[(n_chunks,)](ids, bases, sorted_ids, n, C=chunk, BLOCK_E=block_e, num_warps=4, **launch)
    return plan


def per_route_plan(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                   cache: dict | None = None) -> MoERoutingPlan:
    """A plan with no sort and no launch (`plan_per_route`): block r holds route r alone, for one-token batches
    (distinct experts). `cache`: the caller's dict of the constant rows, filled only outside graph capture."""
    if topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be [T, K] int32/int64, got {tuple(topk_ids.shape)} {topk_ids.dtype}")
    T, K = topk_ids.shape
    n, dev = T * K, topk_ids.device
    key = (T, K, block_m, str(dev))
    rows = cache.get(key) if cache is not None else None
    if rows is None:
        pos = torch.arange(n * block_m, dtype=torch.int32, device=dev)
        rows = (torch.where(pos % block_m == 0, pos // block_m, n).to(torch.int32),
                torch.full((1,), n * block_m, dtype=torch.int32, device=dev))
        capturing = dev.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if cache is not None and not capturing:
            cache[key] = rows
    ids = topk_ids.reshape(-1)
    eob = ids if ids.dtype == torch.int32 else ids.to(torch.int32)
    return MoERoutingPlan(sorted_route_ids=rows[0], expert_of_block=eob, num_padded=rows[1], block_m=block_m,
                          num_tokens=T, top_k=K, num_experts=num_experts)
