"""Routed-expert LoRA kernels that run outside the base GEMMs (the GEMM epilogues consume them).

Shape legend: T tokens, K top-k, H hidden, I expert intermediate, S adapter slots, E experts,
R max rank (BLOCK_R = max(16, next_pow2(R))), P plan rows (max_padded), BM plan block_m,
SPLIT reduction splits, RC = 16 rank columns per step (cost follows each slot's own rank).

- `lora_shrink_kernel` ("separate"): xa [SPLIT, P, BLOCK_R] fp32 partials of src rows @ A^T,
  src = x (gathered by token) or h (plan rows); program (plan block, split); the block's rows are
  grouped by slot and each slot is one tl.dot over its rows; the GEMM epilogue expands slot by
  slot. Best when blocks are full (prefill).
- `lora_route_delta_kernel` ("route"): the whole delta of a route, shrink and expand, as two
  GEMVs in one program: delta[route] = ((src row @ A[s, e, :rank]^T) in x's dtype) @
  B[s, e, :, :rank]^T -> [T*K, N], RC rank columns at a time (a rank-8 slot in a rank-64 pool
  costs rank 8), except that a slot of rank > WIDE_MIN (32) takes one pass WIDE_RC (the pool's
  width) wide, so x and its delta row are touched once (H200, Qwen3 M=64, 8 adapters r64: 1.55x
  no-LoRA in one pass vs 2.49x in 16-column chunks; the per-slot choice is a runtime branch).
  The delta buffer is x's dtype for pools of rank <= 16 (one chunk: the rounding of the torch
  twin) and fp32 above (chunks accumulate in place, one program per row and split). gate_up: one
  program per (route, N split), src x[route // K], in route order, or (lora_route_order="plan") per
  (plan row, N split), so an expert's routes run side by side and share their pairs' A/B in L2;
  down: one per (plan row, N split), src h[row].
  The GEMM epilogue adds delta[route] to its tile: a plain load, no loop over the block's slots.
  Every program streams its own A/B rows with no dependence on the other rows of its block
  (decode: a block holds a few routes on as many slots).
- `lora_block_delta_kernel` ("block"): the same delta buffer as "route", computed per (plan block,
  slot): program (block, lane, N split) takes the lane-th distinct slot of its block (the last lane
  every slot left), shrinks that slot's rows with one tl.dot over k (xa rounded to src's dtype, as
  "route"), then expands them tile by tile. A and B of a (slot, expert) pair are read once per
  block and split instead of once per route: the reuse "route" lacks when blocks hold several
  routes of one adapter (M >= 256), with the slots of a block in parallel programs (lanes), not
  the serial per-slot loop of "separate". One pass per pair at the pool's width, masked to the slot's
  rank, or (a slot of rank <= 16 in a wider pool) at 16 columns; the delta in x's dtype.
  SUB > 1 (FusedMoEConfig.lora_block_m): each plan block is taken as SUB sub-blocks of BM / SUB
  rows, one program row each: tiles of fewer masked rows staged per step and more programs, for
  A/B read once per sub-block instead of once per block. PERSIST (lora_block_programs): a fixed
  number of programs loop over those (sub-block, lane, split) items: slower alone, faster beside the
  base GEMM at M = 128 / 256 on the H200 (docs/benchmarks.md).
- `lora_stacked_shrink_kernel` ("stacked"): xa_stacked [P, S * BLOCK_R] in x's dtype, each row's xa in
  its slot's BLOCK_R columns and zeros in the others (every row of a live block written); program (plan
  block, CW stacked columns); the GEMM kernels expand it as extra K steps against every slot's B of the
  block's expert (moe_gemm).
- The route / block switch (FusedMoEConfig.lora_block_max_slots): both delta kernels are launched
  and each program first counts the distinct slots of the batch (`slots_skip`); with at most
  max_slots the block kernel runs and the route kernel's programs exit, else the reverse. One
  captured graph serves a batch of one adapter (block: A/B once per block) and of many (route).
Rows on no slot, or on a slot whose rank at this site is 0, are neither read nor written (and
never read back).
"""

from __future__ import annotations

import triton
import triton.language as tl

from moelora.kernels.lora_tiles import (
    drop_largest_slots,
    lora_b_tile,
    lora_shrink_rows,
    stacked_columns,
    stacked_slot_ranks,
)
from moelora.kernels.moe_gemm import plan_rows, slot_base


@triton.jit
def lora_shrink_kernel(
    src_ptr, xa_ptr, sorted_ids_ptr, eob_ptr, num_padded_ptr, slots_ptr, ranks_ptr, a_ptr,
    n_routes, top_k, k_dim, k_split, P, stride_src, stride_as, stride_ae, stride_ar, n_lanes,
    GATHER_TOKENS: tl.constexpr, BM: tl.constexpr, BLOCK_R: tl.constexpr, LORA_BK: tl.constexpr,
    LORA_RC: tl.constexpr,
):
    """xa[sp, rows, :rank] = src rows (x[token] or h[plan row]) @ A[s, e, :rank, k-split sp]^T for
    the slots s of the block; grid (blocks, SPLIT, n_lanes) keeps each program's serial slot loop
    short: lane l takes the block's l-th largest distinct slot, the last lane every slot left (one
    lane: all of them in turn)."""
    pid_m = tl.program_id(0)
    sp = tl.program_id(1)
    lane = tl.program_id(2)
    if pid_m * BM >= tl.load(num_padded_ptr):
        return
    e = tl.load(eob_ptr + pid_m).to(tl.int64)
    offs_m, route, valid, tok = plan_rows(sorted_ids_ptr, pid_m, n_routes, top_k, BM)
    rows = tok if GATHER_TOKENS else offs_m
    k_start = sp * k_split
    k_end = tl.minimum(k_dim, k_start + k_split)
    slot, s = drop_largest_slots(tl.load(slots_ptr + tok, mask=valid, other=-1), lane)
    last = lane == n_lanes - 1
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
        s = tl.where(last, tl.max(slot, axis=0), -1)  # a lane below the last takes one slot



@triton.jit
def lora_stacked_shrink_kernel(
    src_ptr, xa_ptr, sorted_ids_ptr, eob_ptr, num_padded_ptr, slots_ptr, ranks_ptr, a_ptr,
    n_routes, top_k, k_dim, n_slots, stride_src, stride_xa, stride_as, stride_ae, stride_ar,
    GATHER_TOKENS: tl.constexpr, BM: tl.constexpr, BLOCK_R: tl.constexpr, CW: tl.constexpr, BK: tl.constexpr,
    S_P2: tl.constexpr,
):
    """xa_stacked[row, c] for the CW stacked columns c of program_id(1) and every row of plan block
    program_id(0): src row @ A[c // BLOCK_R, e, c % BLOCK_R]^T where c is in the row's slot's lane, 0
    elsewhere, in xa's dtype. One tl.dot a K step over all the block's slots of those columns (a dense
    GEMM, not a loop over slots); A rows of slots absent from the block, or past a slot's rank, load
    nothing, and a program with no row on its columns' slots only writes its zeros."""
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
def slots_skip(slots_ptr, n_tokens, max_slots, SWITCH: tl.constexpr, T_P2: tl.constexpr, S_P2: tl.constexpr):
    """Whether this side of a switched pair stands aside: SWITCH 1 (the "block" side) when the T
    tokens name more than max_slots distinct slots, 2 (the "route" side) when at most that many.
    Every program counts them itself from the T slots (T <= T_P2: a few KB from L2), so the pair
    needs no host sync and no other launch, and exactly one of the two runs. Callers test SWITCH
    first, so an unswitched kernel compiles none of this."""
    offs = tl.arange(0, T_P2)
    slot = tl.load(slots_ptr + offs, mask=offs < n_tokens, other=-1)
    present = tl.max((slot[:, None] == tl.arange(0, S_P2)[None, :]).to(tl.int32), axis=0)
    n_distinct = tl.sum(present, axis=0)
    if SWITCH == 1:
        skip = n_distinct > max_slots
    else:
        skip = n_distinct <= max_slots
    return skip


@triton.jit
def lora_route_delta_kernel(
    src_ptr, delta_ptr, ids_ptr, sorted_ids_ptr, eob_ptr, num_padded_ptr, slots_ptr, ranks_ptr, a_ptr, b_ptr,
    n_routes, top_k, k_dim, n_out, n_per_split, stride_src, stride_d,
    stride_as, stride_ae, stride_ar, stride_bs, stride_be, stride_bn, max_slots,
    BY_PLAN_ROW: tl.constexpr, BM: tl.constexpr, RC: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr,
    WIDE_RC: tl.constexpr, WIDE_MIN: tl.constexpr, SRC_BY_TOKEN: tl.constexpr,
    SWITCH: tl.constexpr = 0, T_P2: tl.constexpr = 1, S_P2: tl.constexpr = 1, STAGES: tl.constexpr = 1,
):
    """delta[route, n] for the n of split program_id(1); see the module docstring. BY_PLAN_ROW: program
    pid takes plan row pid (routes of one expert, hence of few (slot, expert) pairs, run side by side
    and share their A/B through L2), reading src row pid (h, down) or, SRC_BY_TOKEN, its token's row
    (x, gate_up); else program pid takes route pid, reading its token's row. SWITCH: `slots_skip`. STAGES:
    `_delta_pass`'s loops software-pipelined that deep (1: not)."""
    if SWITCH != 0:
        if slots_skip(slots_ptr, n_routes // top_k, max_slots, SWITCH, T_P2, S_P2):
            return
    pid = tl.program_id(0)
    if BY_PLAN_ROW:
        if pid >= tl.load(num_padded_ptr):
            return
        route = tl.load(sorted_ids_ptr + pid)
        if route >= n_routes:
            return
        e = tl.load(eob_ptr + pid // BM).to(tl.int64)
        if SRC_BY_TOKEN:
            src = src_ptr + (route // top_k).to(tl.int64) * stride_src
        else:
            src = src_ptr + pid.to(tl.int64) * stride_src
    else:  # gate_up: route pid reads its token's row of x
        route = pid
        e = tl.load(ids_ptr + pid).to(tl.int64)
        src = src_ptr + (pid // top_k).to(tl.int64) * stride_src
    s = tl.load(slots_ptr + route // top_k)
    if s < 0:
        return
    rank = tl.load(ranks_ptr + s)
    if rank == 0:
        return
    a_base = a_ptr + s.to(tl.int64) * stride_as + e * stride_ae
    b_base = b_ptr + s.to(tl.int64) * stride_bs + e * stride_be
    n_start = tl.program_id(1) * n_per_split
    n_end = tl.minimum(n_out, n_start + n_per_split)
    d_row = delta_ptr + route.to(tl.int64) * stride_d
    if WIDE_RC > RC:  # a pool wider than RC: slots of rank > WIDE_MIN take one wide pass (x and the
        if rank > WIDE_MIN:  # delta row touched once), the others RC columns at a time (cost ~ rank)
            _delta_pass(src, a_base, b_base, d_row, 0, rank, k_dim, n_start, n_end, stride_ar, stride_bn,
                        WIDE_RC, 4096 // WIDE_RC, 4096 // WIDE_RC, STAGES)
            return
    for r0 in range(0, rank, RC):
        _delta_pass(src, a_base, b_base, d_row, r0, rank, k_dim, n_start, n_end, stride_ar, stride_bn, RC, BK, BN,
                    STAGES)


@triton.jit
def _delta_pass(src, a_base, b_base, d_row, r0, rank, k_dim, n_start, n_end, stride_ar, stride_bn,
                RC: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr, STAGES: tl.constexpr):
    """Rank columns [r0, r0 + RC) of one route's delta: xa = src . A[r0:r0+RC]^T (rounded to src's
    dtype), then d_row[n] (+)= B[n, r0:r0+RC] . xa for n in [n_start, n_end); adds to d_row when r0 > 0."""
    offs_r = r0 + tl.arange(0, RC)
    r_ok = offs_r < rank
    xa = tl.zeros((RC,), tl.float32)
    for k0 in tl.range(0, k_dim, BK, num_stages=STAGES):  # a GEMV chain: loads in flight only if pipelined
        offs_k = k0 + tl.arange(0, BK)
        k_ok = offs_k < k_dim
        xv = tl.load(src + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        a = tl.load(a_base + offs_r[:, None] * stride_ar + offs_k[None, :], mask=r_ok[:, None] & k_ok[None, :],
                    other=0.0)
        xa += tl.sum(a.to(tl.float32) * xv[None, :], axis=1)
    xa = xa.to(src.dtype.element_ty).to(tl.float32)
    for n0 in tl.range(n_start, n_end, BN, num_stages=STAGES):
        offs_n = n0 + tl.arange(0, BN)
        n_ok = offs_n < n_end
        bt = lora_b_tile(b_base, offs_n, n_end, stride_bn, rank, r0, RC)  # [RC, BN]
        d = tl.sum(bt.to(tl.float32) * xa[:, None], axis=0)
        if r0 > 0:  # this program stored the earlier chunks' sum here
            d += tl.load(d_row + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(d_row + offs_n, d.to(d_row.dtype.element_ty), mask=n_ok)


@triton.jit
def lora_block_delta_kernel(
    src_ptr, delta_ptr, sorted_ids_ptr, eob_ptr, num_padded_ptr, slots_ptr, ranks_ptr, a_ptr, b_ptr,
    n_routes, top_k, k_dim, n_out, n_per_split, n_lanes, stride_src, stride_d,
    stride_as, stride_ae, stride_ar, stride_bs, stride_be, stride_bn, max_slots,
    BY_PLAN_ROW: tl.constexpr, BM: tl.constexpr, BLOCK_R: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr,
    SUB: tl.constexpr = 1, SWITCH: tl.constexpr = 0, T_P2: tl.constexpr = 1, S_P2: tl.constexpr = 1,
    PERSIST: tl.constexpr = False, B_CHUNKS: tl.constexpr = True,
):
    """delta[route, n] for the rows of sub-block program_id(0) (BM / SUB rows of plan block
    program_id(0) // SUB) on the lane-th distinct slot, n in split program_id(2); see the module
    docstring. SWITCH: `slots_skip`. B_CHUNKS: `lora_b_tile`'s CHUNKS (FusedMoEConfig.lora_block_b_chunks).
    PERSIST: a 1-D grid of fewer programs, each looping over the (sub-block, lane, split) items of the live
    sub-blocks (sub-block fastest). In a pool wider than
    NARROW_R, a slot of rank <= NARROW_R takes NARROW_R-column tiles (`_block_pair_delta`), not the
    pool's (H200, Qwen3, 8 adapters of rank 8 in a rank-64 pool, M=128: 563 -> 486 us a layer; two
    launches, one per rank class, made it 421 but rank 64 itself 587 -> 671)."""
    if SWITCH != 0:
        if slots_skip(slots_ptr, n_routes // top_k, max_slots, SWITCH, T_P2, S_P2):
            return
    BMS: tl.constexpr = BM // SUB
    live = tl.cdiv(tl.load(num_padded_ptr), BMS)  # sub-blocks holding plan rows
    if PERSIST:
        n_items = live * n_lanes * tl.cdiv(n_out, n_per_split)
        for item in range(tl.program_id(0), n_items, tl.num_programs(0)):
            _block_delta_item(src_ptr, delta_ptr, sorted_ids_ptr, eob_ptr, slots_ptr, ranks_ptr, a_ptr, b_ptr,
                              n_routes, top_k, k_dim, n_out, n_per_split, n_lanes, stride_src, stride_d, stride_as,
                              stride_ae, stride_ar, stride_bs, stride_be, stride_bn, item % live,
                              (item // live) % n_lanes, item // (live * n_lanes), BY_PLAN_ROW, BMS, SUB, BLOCK_R,
                              BK, BN, B_CHUNKS)
    elif tl.program_id(0) < live:
        _block_delta_item(src_ptr, delta_ptr, sorted_ids_ptr, eob_ptr, slots_ptr, ranks_ptr, a_ptr, b_ptr,
                          n_routes, top_k, k_dim, n_out, n_per_split, n_lanes, stride_src, stride_d, stride_as,
                          stride_ae, stride_ar, stride_bs, stride_be, stride_bn, tl.program_id(0), tl.program_id(1),
                          tl.program_id(2), BY_PLAN_ROW, BMS, SUB, BLOCK_R, BK, BN, B_CHUNKS)


NARROW_R = tl.constexpr(16)  # the block delta's rank tile for slots of rank <= 16, whatever the pool's


@triton.jit
def _block_pair_delta(src_ptr, rows, stride_src, sel, a_se, b_se, stride_ar, stride_bn, rank, k_dim, d_rows, n_start,
                      n_end, BMS: tl.constexpr, R: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr,
                      B_CHUNKS: tl.constexpr):
    """The delta of the rows in sel for one (slot, expert) pair, in R rank columns (>= its rank): xa =
    rows @ A[:rank]^T rounded to src's dtype, then d_rows[:, n] = xa @ B[n, :rank]^T over [n_start, n_end),
    BN columns at a time."""
    xa = lora_shrink_rows(src_ptr, rows, stride_src, sel, a_se, stride_ar, rank, 0, k_dim, BMS, R, BK)
    xa = xa.to(src_ptr.dtype.element_ty)
    for n0 in range(n_start, n_end, BN):
        offs_n = n0 + tl.arange(0, BN)
        d = tl.dot(xa, lora_b_tile(b_se, offs_n, n_end, stride_bn, rank, 0, R, B_CHUNKS).to(xa.dtype))
        tl.store(d_rows + offs_n[None, :], d.to(d_rows.dtype.element_ty), mask=sel[:, None] & (offs_n[None, :] < n_end))


@triton.jit
def _block_delta_item(src_ptr, delta_ptr, sorted_ids_ptr, eob_ptr, slots_ptr, ranks_ptr, a_ptr, b_ptr, n_routes,
                      top_k, k_dim, n_out, n_per_split, n_lanes, stride_src, stride_d, stride_as, stride_ae,
                      stride_ar, stride_bs, stride_be, stride_bn, pid_m, lane, pid_n, BY_PLAN_ROW: tl.constexpr,
                      BMS: tl.constexpr, SUB: tl.constexpr, BLOCK_R: tl.constexpr, BK: tl.constexpr,
                      BN: tl.constexpr, B_CHUNKS: tl.constexpr):
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
                                      d_rows, n_start, n_end, BMS, NARROW_R, BK, BN, B_CHUNKS)
                else:
                    _block_pair_delta(src_ptr, rows, stride_src, sel, a_se, b_se, stride_ar, stride_bn, rank, k_dim,
                                      d_rows, n_start, n_end, BMS, BLOCK_R, BK, BN, B_CHUNKS)
            else:
                _block_pair_delta(src_ptr, rows, stride_src, sel, a_se, b_se, stride_ar, stride_bn, rank, k_dim,
                                  d_rows, n_start, n_end, BMS, BLOCK_R, BK, BN, B_CHUNKS)
        slot = tl.where(sel, -1, slot)
        s = tl.where(last, tl.max(slot, axis=0), -1)  # a lane below the last takes one slot
