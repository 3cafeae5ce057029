"""Triton kernels of the routed-expert GEMMs over a `MoERoutingPlan`, with the routed LoRA delta.

Shape legend: T tokens, H hidden, I expert intermediate, E experts, K top-k, S adapter slots,
R max rank (BLOCK_R = max(16, next_pow2(R))), P = plan rows (max_padded), BM = plan block_m.
  x [T, H]            w_gate_up [E, 2I, H]   -> h [P, I]   (plan row order; padding rows unwritten)
  h [P, I]            w_down    [E, H, I]    -> y [T*K, H] (route order, routing weight applied)
  lora gate_up A [S, E, R, H], B [S, E, 2I, R]; down A [S, E, R, I], B [S, E, H, R]
  xa [SPLIT, P, BLOCK_R] fp32: split-K partial LoRA shrinks (x A^T) per plan row ("separate").

Program (pid_m, pid_n) owns rows [pid_m*BM, +BM) of the plan (one expert) and BN output columns.
LoRA is computed in the base GEMM's own layout (contract 3); rows of one block may be on
different slots (or none: slot -1 never enters any LoRA work).
  inline (decode): the two largest distinct slots of the block are fused into the base K-loop:
    each step also multiplies the x tile it already holds by A[s, e] (rank-masked loads, so a
    rank-8 adapter in a rank-64 pool moves rank-8 bytes); the epilogue adds (xa) B[s, e]^T for
    each before the activation / routing weight. Further slots (rare at decode) get a second
    pass in the epilogue.
  separate (prefill): lora_shrink_kernel (moe_lora) computes xa first, and the GEMM epilogue
    only expands, slot by slot; with EXPAND_LANES (FusedMoEConfig.lora_expand_lanes) the block's
    largest slots in one dot: xa rows in their slot's lane of columns, the slots' B tiles stacked.
  stacked (prefill, STACKED): lora_stacked_shrink_kernel (moe_lora) writes each row's xa in its slot's
    lane of S * BLOCK_R columns (zeros in the others); the epilogue adds xa_stacked @ B_stacked[e] as K
    steps of one lane each, slot 0 up to the block's largest: a plain loop with no reduction or branch
    (Triton pipelines its loads), where a slot absent from the block, or B columns past a slot's rank,
    load nothing.
  route / block (decode, LORA_DELTA): lora_route_delta_kernel / lora_block_delta_kernel (moe_lora)
    compute each route's whole delta; the gate_up epilogue adds delta[route] to the tile before the
    activation (HAS_LORA is off: no slot loop). The down delta is not added by down_kernel but by
    combine_kernel (w_k * delta[route] next to y's row): the down delta kernel then depends on h
    only, so it can run concurrently with the down GEMM on a second stream. With the gate_up delta
    at "activation" (FusedMoEConfig.lora_gate_up_at), gate_up_kernel writes gate and up unactivated
    (RAW_OUT, [P, 2I]) and act_delta_kernel adds the delta and applies SiLU * up: the gate_up delta
    kernel then depends on x only and can run concurrently with the gate_up GEMM.
  spread (one token, SPREAD): no LoRA launch of its own. gate_up_kernel's programs of output tile n also
    shrink x over columns [n k, (n + 1) k) into partials xa_gu [parts, P, BLOCK_R] and write gate and up
    raw for the rows with a gate_up delta; act_spread_kernel sums the partials, expands, applies SiLU * up
    and shrinks its own h columns into xa_d partials; down_kernel's epilogue expands those as "separate".
    Each shrink column is read once, and only the distinct slots of a block loop: with one route a block
    (M = 1) nothing repeats. With several slots a block the loops sit in the tails of every GEMM program
    and lose to "block" (docs/benchmarks.md).
USE_TMA: weight tiles (and h in the down GEMM, whose rows are contiguous in plan order) come
through Hopper tensor descriptors; LoRA and everything else is unchanged.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moelora.kernels.lora_tiles import lora_a_tile, lora_b_tile, lora_shrink_rows, rank_of, stacked_slot_ranks


@triton.jit
def _tile_ids(num_blocks, num_n, GROUP_M: tl.constexpr):
    """Grouped order: GROUP_M consecutive blocks (often one expert) share each weight tile in L2."""
    pid = tl.program_id(0)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    size = tl.minimum(num_blocks - first_m, GROUP_M)
    return first_m + (pid % width) % size, (pid % width) // size


@triton.jit
def plan_rows(sorted_ids_ptr, pid_m, n_routes, top_k, BM: tl.constexpr):
    offs_m = pid_m * BM + tl.arange(0, BM)
    route = tl.load(sorted_ids_ptr + offs_m)
    valid = route < n_routes
    return offs_m, route, valid, route // top_k


@triton.jit
def slot_base(ptr, s, e, stride_s, stride_e):
    return ptr + tl.maximum(s, 0).to(tl.int64) * stride_s + e * stride_e


@triton.jit
def _rank_of(ranks_ptr, s):
    return tl.where(s >= 0, tl.load(ranks_ptr + tl.maximum(s, 0)), 0)


@triton.jit
def _lora_head(slots_ptr, ranks_ptr, tok, valid):
    """Row slots, the two largest distinct slots s0, s1 with their ranks (rank 0 when absent),
    and the rows left for the epilogue loop (slot, or -1 once s0/s1 took them)."""
    slot = tl.load(slots_ptr + tok, mask=valid, other=-1)
    s0 = tl.max(slot, axis=0)
    rest = tl.where(slot == s0, -1, slot)
    s1 = tl.max(rest, axis=0)
    rest = tl.where(rest == s1, -1, rest)
    return slot, rest, s0, _rank_of(ranks_ptr, s0), s1, _rank_of(ranks_ptr, s1)


@triton.jit
def _delta_rows(slots_ptr, ranks_ptr, tok, valid):
    """Rows whose route has a LoRA delta: a slot, of rank > 0 at this site (as the delta kernel skips)."""
    slot = tl.load(slots_ptr + tok, mask=valid, other=-1)
    rank = tl.load(ranks_ptr + tl.maximum(slot, 0), mask=slot >= 0, other=0)
    return rank > 0


@triton.jit
def _xa_chunk(xa_ptr, xa_off, sel, split_stride, r0, SPLIT: tl.constexpr, RC: tl.constexpr):
    """Rank columns [r0, r0+RC) of the block's xa (row offsets xa_off: plan row * BLOCK_R), summed over the
    SPLIT partials; rows not in sel read nothing (and give 0)."""
    offs_r = r0 + tl.arange(0, RC)
    xa = tl.zeros((xa_off.shape[0], RC), tl.float32)
    for sp in tl.static_range(SPLIT):
        xa += tl.load(xa_ptr + sp * split_stride + xa_off[:, None] + offs_r[None, :], mask=sel[:, None], other=0.0)
    return xa


@triton.jit
def _lane_columns(slot, ranks_ptr, LANES: tl.constexpr, BLOCK_R: tl.constexpr):
    """The block's LANES largest distinct slots side by side as LANES * BLOCK_R expand columns:
    (each row's lane, -1 for no slot; the slot and rank of each column, [LANES * BLOCK_R], -1 / 0 past
    the block's slots; the rows' slots with the laned ones set to -1: what the slot loop still owes)."""
    lanes = tl.arange(0, LANES)
    s_vec = tl.full([LANES], -1, tl.int32)
    row_lane = slot * 0 - 1
    rest = slot
    for lane in tl.static_range(LANES):
        s = tl.max(rest, axis=0)
        s_vec = tl.where(lanes == lane, s, s_vec)
        row_lane = tl.where((rest == s) & (s >= 0), lane, row_lane)
        rest = tl.where(rest == s, -1, rest)
    r_vec = tl.load(ranks_ptr + tl.maximum(s_vec, 0), mask=s_vec >= 0, other=0)
    c_lane = tl.arange(0, LANES * BLOCK_R) // BLOCK_R
    hit = lanes[None, :] == c_lane[:, None]
    s_col = tl.sum(tl.where(hit, s_vec[None, :], 0), axis=1)
    r_col = tl.sum(tl.where(hit, r_vec[None, :], 0), axis=1)
    return row_lane, s_col, r_col, rest


@triton.jit
def _xa_lanes(xa_ptr, xa_off, row_lane, r_col, split_stride, SPLIT: tl.constexpr, BLOCK_R: tl.constexpr,
              LANES: tl.constexpr):
    """[BM, LANES * BLOCK_R] fp32: each row's xa (row offsets xa_off, its SPLIT partials summed) in its
    lane's columns, up to that slot's rank; zero elsewhere (rows on no laned slot read nothing)."""
    offs_c = tl.arange(0, LANES * BLOCK_R)
    c_r = offs_c % BLOCK_R
    sel = (row_lane[:, None] == (offs_c // BLOCK_R)[None, :]) & (c_r < r_col)[None, :]
    xa = tl.zeros((xa_off.shape[0], LANES * BLOCK_R), tl.float32)
    for sp in tl.static_range(SPLIT):
        xa += tl.load(xa_ptr + sp * split_stride + xa_off[:, None] + c_r[None, :], mask=sel, other=0.0)
    return xa


@triton.jit
def _b_lanes(b_ptr, e, s_col, r_col, offs_n, n_limit, stride_bs, stride_be, stride_bn, BLOCK_R: tl.constexpr,
             LANES: tl.constexpr):
    """[LANES * BLOCK_R, BN]: the laned slots' B^T tiles of expert e stacked (lane l: rows
    [l BLOCK_R, l BLOCK_R + rank)), rank- and column-masked: a column past a slot's rank moves no bytes."""
    c_r = tl.arange(0, LANES * BLOCK_R) % BLOCK_R
    base = b_ptr + tl.maximum(s_col, 0).to(tl.int64) * stride_bs + e * stride_be
    return tl.load(base[:, None] + offs_n[None, :] * stride_bn + c_r[:, None],
                   mask=(c_r < r_col)[:, None] & (offs_n[None, :] < n_limit), other=0.0)


@triton.jit
def _add_expand(acc_g, acc_u, xs, b_se, offs_n, n_limit, stride_bn, rank, col0, R: tl.constexpr, TWO: tl.constexpr):
    """acc_g += xs @ B^T over B rows offs_n (masked to n_limit and the rank), rank columns from col0, and with TWO
    (gate_up) acc_u += the same over the up half, B rows n_limit + offs_n. xs [BM, R] in the dot's dtype; B tiles:
    `lora_b_tile`."""
    acc_g = tl.dot(xs, lora_b_tile(b_se, offs_n, n_limit, stride_bn, rank, col0, R).to(xs.dtype), acc_g)
    if TWO:
        acc_u = tl.dot(xs, lora_b_tile(b_se + n_limit * stride_bn, offs_n, n_limit, stride_bn, rank, col0,
                                       R).to(xs.dtype), acc_u)
    return acc_g, acc_u


@triton.jit
def _inline_epilogue(acc_g, acc_u, xa0, xa1, slot, rest, s0, r0, s1, r1, src_ptr, src_rows, stride_src, k_dim, e,
                     ranks_ptr, a_ptr, b_ptr, offs_n, n_limit, stride_as, stride_ae, stride_ar, stride_bs, stride_be,
                     stride_bn, BM: tl.constexpr, BLOCK_R: tl.constexpr, LORA_BK: tl.constexpr, TWO: tl.constexpr):
    """"inline": the expand of the two slots shrunk in the K loop (xa0, xa1), then every further slot of the
    block in a second pass over its src rows (from L2): shrink and expand. `_add_expand`'s acc_g / acc_u / TWO."""
    dt = src_ptr.dtype.element_ty
    if r0 > 0:
        xs = tl.where((slot == s0)[:, None], xa0, 0.0).to(dt)
        acc_g, acc_u = _add_expand(acc_g, acc_u, xs, slot_base(b_ptr, s0, e, stride_bs, stride_be), offs_n, n_limit,
                                   stride_bn, r0, 0, BLOCK_R, TWO)
    if r1 > 0:
        xs = tl.where((slot == s1)[:, None], xa1, 0.0).to(dt)
        acc_g, acc_u = _add_expand(acc_g, acc_u, xs, slot_base(b_ptr, s1, e, stride_bs, stride_be), offs_n, n_limit,
                                   stride_bn, r1, 0, BLOCK_R, TWO)
    s = tl.max(rest, axis=0)
    while s >= 0:  # slots beyond the two fused ones
        sel = rest == s
        rank = tl.load(ranks_ptr + s)
        if rank > 0:
            xs = lora_shrink_rows(src_ptr, src_rows, stride_src, sel, slot_base(a_ptr, s, e, stride_as, stride_ae),
                                  stride_ar, rank, 0, k_dim, BM, BLOCK_R, LORA_BK).to(dt)
            acc_g, acc_u = _add_expand(acc_g, acc_u, xs, slot_base(b_ptr, s, e, stride_bs, stride_be), offs_n,
                                       n_limit, stride_bn, rank, 0, BLOCK_R, TWO)
        rest = tl.where(sel, -1, rest)
        s = tl.max(rest, axis=0)
    return acc_g, acc_u


@triton.jit
def _separate_epilogue(acc_g, acc_u, src_ptr, slot, e, offs_m, ranks_ptr, b_ptr, xa_ptr, offs_n, n_limit, stride_bs,
                       stride_be, stride_bn, num_blocks, BM: tl.constexpr, BLOCK_R: tl.constexpr,
                       XA_SPLIT: tl.constexpr, LORA_RC: tl.constexpr, EXPAND_LANES: tl.constexpr, TWO: tl.constexpr):
    """"separate" (xa precomputed): expand only, LORA_RC rank columns at a time up to each slot's rank; with
    EXPAND_LANES the block's largest slots first in one dot, the loop takes the rest. The dot in src's dtype;
    acc_g / acc_u / TWO as `_add_expand`."""
    dt = src_ptr.dtype.element_ty
    xa_off = offs_m.to(tl.int64) * BLOCK_R
    if EXPAND_LANES > 0:
        row_lane, s_col, r_col, slot = _lane_columns(slot, ranks_ptr, EXPAND_LANES, BLOCK_R)
        xl = _xa_lanes(xa_ptr, xa_off, row_lane, r_col, num_blocks * BM * BLOCK_R, XA_SPLIT, BLOCK_R,
                       EXPAND_LANES).to(dt)
        acc_g = tl.dot(xl, _b_lanes(b_ptr, e, s_col, r_col, offs_n, n_limit, stride_bs, stride_be, stride_bn, BLOCK_R,
                                    EXPAND_LANES).to(dt), acc_g)
        if TWO:
            acc_u = tl.dot(xl, _b_lanes(b_ptr + n_limit * stride_bn, e, s_col, r_col, offs_n, n_limit, stride_bs,
                                        stride_be, stride_bn, BLOCK_R, EXPAND_LANES).to(dt), acc_u)
    s = tl.max(slot, axis=0)
    while s >= 0:
        sel = slot == s
        rank = tl.load(ranks_ptr + s)
        b_se = slot_base(b_ptr, s, e, stride_bs, stride_be)
        for r0 in range(0, rank, LORA_RC):
            xs = _xa_chunk(xa_ptr, xa_off, sel, num_blocks * BM * BLOCK_R, r0, XA_SPLIT, LORA_RC).to(dt)
            acc_g, acc_u = _add_expand(acc_g, acc_u, xs, b_se, offs_n, n_limit, stride_bn, rank, r0, LORA_RC, TWO)
        slot = tl.where(sel, -1, slot)
        s = tl.max(slot, axis=0)
    return acc_g, acc_u


@triton.jit
def _stacked_epilogue(acc_g, acc_u, slots_ptr, ranks_ptr, tok, valid, offs_m, e, xa_ptr, stride_xa, b_ptr, offs_n,
                      n_limit, stride_bs, stride_be, stride_bn, n_slots, BLOCK_R: tl.constexpr, S_P2: tl.constexpr,
                      TWO: tl.constexpr):
    """"stacked": xa_stacked @ B_stacked[e] as more K steps, slot 0 up to the block's largest, one slot's lane
    of BLOCK_R columns a step (a slot absent from the block has rank 0 here and loads no B).
    acc_g / acc_u / TWO as `_add_expand`."""
    slot = tl.load(slots_ptr + tok, mask=valid, other=-1)
    slot_ranks = stacked_slot_ranks(slot, ranks_ptr, n_slots, S_P2)
    xa_rows = xa_ptr + offs_m[:, None].to(tl.int64) * stride_xa + tl.arange(0, BLOCK_R)[None, :]
    for s in range(0, tl.max(slot, axis=0) + 1):  # no lane past the block's largest slot
        acc_g, acc_u = _add_expand(acc_g, acc_u, tl.load(xa_rows + s * BLOCK_R),
                                   slot_base(b_ptr, s, e, stride_bs, stride_be), offs_n, n_limit, stride_bn,
                                   rank_of(slot_ranks, s, S_P2), 0, BLOCK_R, TWO)
    return acc_g, acc_u


@triton.jit
def _spread_shrink(src_ptr, src_rows, stride_src, slot, valid, ranks_ptr, a_ptr, e, xa_ptr, offs_m, part, k_start,
                   k_end, part_stride, stride_as, stride_ae, stride_ar, BM: tl.constexpr, BLOCK_R: tl.constexpr,
                   LORA_BK: tl.constexpr):
    """"spread": xa[part, plan rows] = src[rows, k_start:k_end] @ A[slot(row), e][:rank, k_start:k_end]^T (fp32),
    one dot per distinct slot of the block (rank-masked A loads); rows on no slot get zeros."""
    xa = tl.zeros((BM, BLOCK_R), tl.float32)
    s = tl.max(slot, axis=0)
    while s >= 0:
        sel = slot == s
        rank = tl.load(ranks_ptr + s)
        if rank > 0:
            xa += lora_shrink_rows(src_ptr, src_rows, stride_src, sel, slot_base(a_ptr, s, e, stride_as, stride_ae),
                                   stride_ar, rank, k_start, k_end, BM, BLOCK_R, LORA_BK)
        slot = tl.where(sel, -1, slot)
        s = tl.max(slot, axis=0)
    tl.store(xa_ptr + part * part_stride + offs_m[:, None].to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)[None, :], xa,
             mask=valid[:, None])


@triton.jit
def gate_up_kernel(
    x_ptr, w, h_ptr, sorted_ids_ptr, eob_ptr, num_padded_ptr,
    slots_ptr, ranks_ptr, a_ptr, b_ptr, xa_ptr, delta_ptr,
    n_routes, top_k, H, inter, num_blocks,
    stride_xt, stride_we, stride_wn, stride_hp, stride_dr,
    stride_as, stride_ae, stride_ar, stride_bs, stride_be, stride_bn, stride_xa, n_slots,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    HAS_LORA: tl.constexpr, INLINE_SHRINK: tl.constexpr, XA_SPLIT: tl.constexpr, BLOCK_R: tl.constexpr,
    LORA_BK: tl.constexpr, LORA_RC: tl.constexpr, USE_TMA: tl.constexpr, LORA_DELTA: tl.constexpr,
    RAW_OUT: tl.constexpr, EXPAND_LANES: tl.constexpr = 0, STACKED: tl.constexpr = False, S_P2: tl.constexpr = 1,
    SPREAD: tl.constexpr = False, spread_k=0, h_act_ptr=None, stride_act=0,
):
    """h[plan row] = silu(gate) * up of x[token] @ W_gu[e]^T (+ LoRA); RAW_OUT: h is [P, 2I] and gets
    gate and up as they are (columns [0, I) and [I, 2I)), for `act_delta_kernel` / `act_spread_kernel` to
    finish. SPREAD: program (block, n tile) also computes the gate_up shrink over x columns [n spread_k,
    (n + 1) spread_k) into xa[n] ([parts, P, BLOCK_R] fp32), for `act_spread_kernel` to sum and expand; only
    rows with a gate_up delta are written raw, the others get silu(gate) * up in h_act [P, I] (stride_act)
    here, as without LoRA (bit for bit)."""
    pid_m, pid_n = _tile_ids(num_blocks, tl.cdiv(inter, BN), GROUP_M)
    if pid_m * BM >= tl.load(num_padded_ptr):
        return
    e = tl.load(eob_ptr + pid_m).to(tl.int64)
    offs_m, route, valid, tok = plan_rows(sorted_ids_ptr, pid_m, n_routes, top_k, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    x_rows = x_ptr + tok[:, None].to(tl.int64) * stride_xt
    dt = x_ptr.dtype.element_ty
    acc_g = tl.zeros((BM, BN), tl.float32)
    acc_u = tl.zeros((BM, BN), tl.float32)
    xa0 = tl.zeros((BM, BLOCK_R), tl.float32)
    xa1 = tl.zeros((BM, BLOCK_R), tl.float32)
    if HAS_LORA:
        slot, rest, s0, r0, s1, r1 = _lora_head(slots_ptr, ranks_ptr, tok, valid)
        a0 = slot_base(a_ptr, s0, e, stride_as, stride_ae)
        a1 = slot_base(a_ptr, s1, e, stride_as, stride_ae)
    if USE_TMA:
        row_g = (e * 2 * inter + pid_n * BN).to(tl.int32)
    else:
        wg_ptrs = w + e * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
    for k0 in range(0, H, BK):
        k_ok = (k0 + offs_k) < H
        xt = tl.load(x_rows + (k0 + offs_k)[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        if USE_TMA:
            acc_g = tl.dot(xt, w.load([row_g, k0]).T, acc_g)
            acc_u = tl.dot(xt, w.load([row_g + inter, k0]).T, acc_u)
        else:
            n_ok = offs_n[None, :] < inter
            wg = tl.load(wg_ptrs + k0, mask=n_ok & k_ok[:, None], other=0.0)
            wu = tl.load(wg_ptrs + inter * stride_wn + k0, mask=n_ok & k_ok[:, None], other=0.0)
            acc_g = tl.dot(xt, wg, acc_g)
            acc_u = tl.dot(xt, wu, acc_u)
        if INLINE_SHRINK:
            xa0 = tl.dot(xt, lora_a_tile(a0, k0, offs_k, H, stride_ar, r0, BLOCK_R).to(dt), xa0)
            xa1 = tl.dot(xt, lora_a_tile(a1, k0, offs_k, H, stride_ar, r1, BLOCK_R).to(dt), xa1)
    if SPREAD:
        k_start = pid_n * spread_k
        if k_start < H:
            _spread_shrink(x_ptr, tok, stride_xt, tl.load(slots_ptr + tok, mask=valid, other=-1), valid, ranks_ptr,
                           a_ptr, e, xa_ptr, offs_m, pid_n, k_start, tl.minimum(k_start + spread_k, H),
                           num_blocks * BM * BLOCK_R, stride_as, stride_ae, stride_ar, BM, BLOCK_R, LORA_BK)
    if HAS_LORA:
        if INLINE_SHRINK:
            acc_g, acc_u = _inline_epilogue(acc_g, acc_u, xa0, xa1, slot, rest, s0, r0, s1, r1, x_ptr, tok,
                                            stride_xt, H, e, ranks_ptr, a_ptr, b_ptr, offs_n, inter, stride_as,
                                            stride_ae, stride_ar, stride_bs, stride_be, stride_bn, BM, BLOCK_R,
                                            LORA_BK, True)
        else:
            acc_g, acc_u = _separate_epilogue(acc_g, acc_u, x_ptr, slot, e, offs_m, ranks_ptr, b_ptr, xa_ptr, offs_n,
                                              inter, stride_bs, stride_be, stride_bn, num_blocks, BM, BLOCK_R,
                                              XA_SPLIT, LORA_RC, EXPAND_LANES, True)
    if STACKED:  # "stacked": xa_stacked @ B_stacked[e] as more K steps, one slot's lane of BLOCK_R columns each
        acc_g, acc_u = _stacked_epilogue(acc_g, acc_u, slots_ptr, ranks_ptr, tok, valid, offs_m, e, xa_ptr, stride_xa,
                                         b_ptr, offs_n, inter, stride_bs, stride_be, stride_bn, n_slots, BLOCK_R, S_P2,
                                         True)
    if LORA_DELTA:  # "route": the delta of each route was computed before this kernel
        d_rows = delta_ptr + route[:, None].to(tl.int64) * stride_dr + offs_n[None, :]
        live = _delta_rows(slots_ptr, ranks_ptr, tok, valid)[:, None] & (offs_n[None, :] < inter)
        acc_g += tl.load(d_rows, mask=live, other=0.0).to(tl.float32)
        acc_u += tl.load(d_rows + inter, mask=live, other=0.0).to(tl.float32)
    h_rows = h_ptr + offs_m[:, None].to(tl.int64) * stride_hp + offs_n[None, :]
    h_mask = valid[:, None] & (offs_n[None, :] < inter)
    if SPREAD:
        live = _delta_rows(slots_ptr, ranks_ptr, tok, valid)[:, None]
        tl.store(h_rows, acc_g.to(h_ptr.dtype.element_ty), mask=h_mask & live)
        tl.store(h_rows + inter, acc_u.to(h_ptr.dtype.element_ty), mask=h_mask & live)
        hv = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        tl.store(h_act_ptr + offs_m[:, None].to(tl.int64) * stride_act + offs_n[None, :],
                 hv.to(h_act_ptr.dtype.element_ty), mask=h_mask & ~live)
    elif RAW_OUT:
        tl.store(h_rows, acc_g.to(h_ptr.dtype.element_ty), mask=h_mask)
        tl.store(h_rows + inter, acc_u.to(h_ptr.dtype.element_ty), mask=h_mask)
    else:
        hv = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        tl.store(h_rows, hv.to(h_ptr.dtype.element_ty), mask=h_mask)


@triton.jit
def act_delta_kernel(gu_ptr, delta_ptr, h_ptr, sorted_ids_ptr, num_padded_ptr, slots_ptr, ranks_ptr, n_routes, top_k,
                     inter, stride_gu, stride_d, stride_h, BM: tl.constexpr, BN: tl.constexpr):
    """h[p] = silu(gate + delta_g) * (up + delta_u) for the plan rows p of block program_id(0), columns
    of program_id(1): gate / up from the unactivated gate_up GEMM (gu [P, 2I]), delta [T*K, 2I] the
    route's gate_up LoRA delta, added for rows whose slot has a gate_up rank > 0 (the others' delta
    rows are never written). Padding rows are left unwritten, as the fused epilogue leaves them."""
    pid_m = tl.program_id(0)
    if pid_m * BM >= tl.load(num_padded_ptr):
        return
    offs_m, route, valid, tok = plan_rows(sorted_ids_ptr, pid_m, n_routes, top_k, BM)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    mask = valid[:, None] & (offs_n[None, :] < inter)
    live = _delta_rows(slots_ptr, ranks_ptr, tok, valid)[:, None] & mask
    gu_rows = gu_ptr + offs_m[:, None].to(tl.int64) * stride_gu + offs_n[None, :]
    d_rows = delta_ptr + route[:, None].to(tl.int64) * stride_d + offs_n[None, :]
    g = tl.load(gu_rows, mask=mask, other=0.0).to(tl.float32) + tl.load(d_rows, mask=live, other=0.0).to(tl.float32)
    u = (tl.load(gu_rows + inter, mask=mask, other=0.0).to(tl.float32)
         + tl.load(d_rows + inter, mask=live, other=0.0).to(tl.float32))
    hv = g / (1.0 + tl.exp(-g)) * u
    tl.store(h_ptr + offs_m[:, None].to(tl.int64) * stride_h + offs_n[None, :], hv.to(h_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def act_spread_kernel(gu_ptr, h_ptr, sorted_ids_ptr, eob_ptr, num_padded_ptr, slots_ptr, gu_ranks_ptr, gu_b_ptr,
                      xa_gu_ptr, d_ranks_ptr, d_a_ptr, xa_d_ptr, n_routes, top_k, inter, num_blocks, stride_gu,
                      stride_h, stride_gbs, stride_gbe, stride_gbn, stride_das, stride_dae, stride_dar,
                      BM: tl.constexpr, BN: tl.constexpr, BLOCK_R: tl.constexpr, GU_SPLIT: tl.constexpr,
                      LORA_RC: tl.constexpr):
    """"spread": h[p] = silu(gate + delta_g) * (up + delta_u) for the plan rows p of block program_id(0)
    with a gate_up delta (the others' h the gate_up GEMM wrote), columns [n BN, (n + 1) BN) of n =
    program_id(1), the delta expanded here from the gate_up shrink's GU_SPLIT partials (xa_gu, written by
    gate_up_kernel's SPREAD programs); then this tile's share of the down shrink, h[p, columns] @
    A_d[slot, e][:rank, columns]^T for every row, into xa_d[n] (fp32), for down_kernel's epilogue to sum
    and expand. Padding rows are left unwritten."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BM >= tl.load(num_padded_ptr):
        return
    e = tl.load(eob_ptr + pid_m).to(tl.int64)
    offs_m, route, valid, tok = plan_rows(sorted_ids_ptr, pid_m, n_routes, top_k, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask = valid[:, None] & (offs_n[None, :] < inter)
    slot = tl.load(slots_ptr + tok, mask=valid, other=-1)
    live = _delta_rows(slots_ptr, gu_ranks_ptr, tok, valid)[:, None]
    gu_rows = gu_ptr + offs_m[:, None].to(tl.int64) * stride_gu + offs_n[None, :]
    g = tl.load(gu_rows, mask=mask & live, other=0.0).to(tl.float32)
    u = tl.load(gu_rows + inter, mask=mask & live, other=0.0).to(tl.float32)
    g, u = _separate_epilogue(g, u, gu_ptr, slot, e, offs_m, gu_ranks_ptr, gu_b_ptr, xa_gu_ptr, offs_n, inter,
                              stride_gbs, stride_gbe, stride_gbn, num_blocks, BM, BLOCK_R, GU_SPLIT, LORA_RC, 0, True)
    h_rows = h_ptr + offs_m[:, None].to(tl.int64) * stride_h + offs_n[None, :]
    hv = (g / (1.0 + tl.exp(-g)) * u).to(h_ptr.dtype.element_ty)
    tl.store(h_rows, hv, mask=mask & live)
    hv = tl.where(live, hv, tl.load(h_rows, mask=mask & ~live, other=0.0))
    xa = tl.zeros((BM, BLOCK_R), tl.float32)
    s = tl.max(slot, axis=0)
    while s >= 0:  # the down shrink's share: the h tile just rounded, as the down GEMM reads it
        sel = slot == s
        rank = tl.load(d_ranks_ptr + s)
        if rank > 0:
            at = lora_a_tile(slot_base(d_a_ptr, s, e, stride_das, stride_dae), pid_n * BN, tl.arange(0, BN), inter,
                             stride_dar, rank, BLOCK_R)
            xa = tl.dot(tl.where(sel[:, None], hv, 0.0).to(hv.dtype), at.to(hv.dtype), xa)
        slot = tl.where(sel, -1, slot)
        s = tl.max(slot, axis=0)
    tl.store(xa_d_ptr + pid_n * (num_blocks * BM * BLOCK_R) + offs_m[:, None].to(tl.int64) * BLOCK_R
             + tl.arange(0, BLOCK_R)[None, :], xa, mask=valid[:, None])


@triton.jit
def down_kernel(
    h, h_ptr, w, y_ptr, topk_w_ptr, sorted_ids_ptr, eob_ptr, num_padded_ptr,
    slots_ptr, ranks_ptr, a_ptr, b_ptr, xa_ptr,
    n_routes, top_k, H, inter, num_blocks,
    stride_hp, stride_we, stride_wn, stride_yr,
    stride_as, stride_ae, stride_ar, stride_bs, stride_be, stride_bn, stride_xa, n_slots,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    HAS_LORA: tl.constexpr, INLINE_SHRINK: tl.constexpr, XA_SPLIT: tl.constexpr, BLOCK_R: tl.constexpr,
    LORA_BK: tl.constexpr, LORA_RC: tl.constexpr, USE_TMA: tl.constexpr, EXPAND_LANES: tl.constexpr = 0,
    STACKED: tl.constexpr = False, S_P2: tl.constexpr = 1,
):
    pid_m, pid_n = _tile_ids(num_blocks, tl.cdiv(H, BN), GROUP_M)
    if pid_m * BM >= tl.load(num_padded_ptr):
        return
    e = tl.load(eob_ptr + pid_m).to(tl.int64)
    offs_m, route, valid, tok = plan_rows(sorted_ids_ptr, pid_m, n_routes, top_k, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    dt = h_ptr.dtype.element_ty
    acc = tl.zeros((BM, BN), tl.float32)
    xa0 = tl.zeros((BM, BLOCK_R), tl.float32)
    xa1 = tl.zeros((BM, BLOCK_R), tl.float32)
    if HAS_LORA:
        slot, rest, s0, r0, s1, r1 = _lora_head(slots_ptr, ranks_ptr, tok, valid)
        a0 = slot_base(a_ptr, s0, e, stride_as, stride_ae)
        a1 = slot_base(a_ptr, s1, e, stride_as, stride_ae)
    if USE_TMA:
        row_w = (e * H + pid_n * BN).to(tl.int32)
    else:
        h_rows = h + offs_m[:, None].to(tl.int64) * stride_hp
        w_ptrs = w + e * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
    for k0 in range(0, inter, BK):
        if USE_TMA:
            ht = h.load([pid_m * BM, k0])
            acc = tl.dot(ht, w.load([row_w, k0]).T, acc)
        else:
            k_ok = (k0 + offs_k) < inter
            ht = tl.load(h_rows + (k0 + offs_k)[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
            wt = tl.load(w_ptrs + k0, mask=(offs_n[None, :] < H) & k_ok[:, None], other=0.0)
            acc = tl.dot(ht, wt, acc)
        if INLINE_SHRINK:
            xa0 = tl.dot(ht, lora_a_tile(a0, k0, offs_k, inter, stride_ar, r0, BLOCK_R).to(dt), xa0)
            xa1 = tl.dot(ht, lora_a_tile(a1, k0, offs_k, inter, stride_ar, r1, BLOCK_R).to(dt), xa1)
    if HAS_LORA:
        if INLINE_SHRINK:
            acc, _ = _inline_epilogue(acc, acc, xa0, xa1, slot, rest, s0, r0, s1, r1, h_ptr, offs_m, stride_hp,
                                      inter, e, ranks_ptr, a_ptr, b_ptr, offs_n, H, stride_as, stride_ae, stride_ar,
                                      stride_bs, stride_be, stride_bn, BM, BLOCK_R, LORA_BK, False)
        else:
            acc, _ = _separate_epilogue(acc, acc, h_ptr, slot, e, offs_m, ranks_ptr, b_ptr, xa_ptr, offs_n, H,
                                        stride_bs, stride_be, stride_bn, num_blocks, BM, BLOCK_R, XA_SPLIT, LORA_RC,
                                        EXPAND_LANES, False)
    if STACKED:  # "stacked", as in gate_up_kernel
        acc, _ = _stacked_epilogue(acc, acc, slots_ptr, ranks_ptr, tok, valid, offs_m, e, xa_ptr, stride_xa, b_ptr,
                                   offs_n, H, stride_bs, stride_be, stride_bn, n_slots, BLOCK_R, S_P2, False)
    wt_route = tl.load(topk_w_ptr + route, mask=valid, other=0.0).to(tl.float32)
    acc = acc * wt_route[:, None]
    tl.store(y_ptr + route[:, None].to(tl.int64) * stride_yr + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < H))


@triton.jit
def combine_kernel(y_ptr, out_ptr, topk_w_ptr, delta_ptr, slots_ptr, ranks_ptr, T, H, stride_yr, stride_ot,
                   stride_dr, TOP_K: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr, HAS_DELTA: tl.constexpr):
    """out[t] = sum_k y[t*K + k] in fp32, in fixed k order (deterministic, no atomics). HAS_DELTA
    (route / block LoRA): each route's down delta, times its routing weight, is added next to its y
    row, for the rows whose slot has a down rank > 0 (the others' delta rows are never written)."""
    offs_t = tl.program_id(0) * BT + tl.arange(0, BT)
    offs_h = tl.program_id(1) * BH + tl.arange(0, BH)
    t_ok = offs_t < T
    mask = t_ok[:, None] & (offs_h[None, :] < H)
    acc = tl.zeros((BT, BH), tl.float32)
    if HAS_DELTA:
        live = _delta_rows(slots_ptr, ranks_ptr, offs_t, t_ok)[:, None] & mask
    for k in tl.static_range(TOP_K):
        rows = (offs_t * TOP_K + k).to(tl.int64)
        acc += tl.load(y_ptr + rows[:, None] * stride_yr + offs_h[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_DELTA:
            w = tl.load(topk_w_ptr + rows, mask=t_ok, other=0.0).to(tl.float32)
            d = tl.load(delta_ptr + rows[:, None] * stride_dr + offs_h[None, :], mask=live, other=0.0)
            acc += w[:, None] * d.to(tl.float32)
    tl.store(out_ptr + offs_t[:, None].to(tl.int64) * stride_ot + offs_h[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask)
