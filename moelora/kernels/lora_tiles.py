"""Triton building blocks shared by the LoRA kernels (routed experts and dense linears).

Shape legend: BM rows, BN output columns, R rank (BLOCK_R = pow2 >= 16 >= R), k_dim the input features.
A [R, k_dim] and B [N, R] are one (slot, expert) or one slot's matrices, unit last stride. Loads are masked to
the slot's rank, so an adapter of rank r moves r rows of A / columns of B whatever the pool's R.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def lora_shrink_rows(src_ptr, rows, stride_src, sel, a_ptr, stride_ar, rank, k_start, k_end,
                     BM: tl.constexpr, BLOCK_R: tl.constexpr, LORA_BK: tl.constexpr):
    """[BM, BLOCK_R] fp32: src[rows, k_start:k_end] @ A[:, k_start:k_end]^T for the rows in `sel`, rank-masked."""
    offs_r = tl.arange(0, BLOCK_R)
    xa = tl.zeros((BM, BLOCK_R), tl.float32)
    for k0 in range(k_start, k_end, LORA_BK):
        offs_k = k0 + tl.arange(0, LORA_BK)
        kmask = offs_k < k_end
        xt = tl.load(src_ptr + rows[:, None].to(tl.int64) * stride_src + offs_k[None, :],
                     mask=sel[:, None] & kmask[None, :], other=0.0)
        at = tl.load(a_ptr + offs_r[None, :] * stride_ar + offs_k[:, None],
                     mask=(offs_r[None, :] < rank) & kmask[:, None], other=0.0)
        xa += tl.dot(xt, at.to(xt.dtype))
    return xa


@triton.jit
def rank_chunks(rank, r_limit):
    """B columns a tile loads for a slot of `rank`: whole 16-column chunks (at most r_limit), so the loads are vectors,
    not the 2-byte element loads a per-column rank mask compiles to; the tile then zeroes the columns past the rank."""
    return tl.minimum(tl.cdiv(rank, 16) * 16, r_limit)


@triton.jit
def lora_b_tile_cols(b_ptr, offs_n, cols, stride_bn, rank, col0, BLOCK_R: tl.constexpr, CHUNKS: tl.constexpr = True):
    """[BLOCK_R, BN] tile of B^T (B is [N, R]) for the output rows offs_n where `cols` holds (one segment of a merged
    projection's B), rank columns from col0: whole rank chunks and the select (CHUNKS), or masks."""
    offs_r = tl.arange(0, BLOCK_R)
    ptrs = b_ptr + col0 + offs_n[None, :] * stride_bn + offs_r[:, None]
    left = rank - col0  # the slot's columns from col0 on
    if CHUNKS:
        bt = tl.load(ptrs, mask=(offs_r[:, None] < rank_chunks(left, stride_bn - col0)) & cols[None, :], other=0.0)
        bt = tl.where(offs_r[:, None] < left, bt, 0.0)
    else:
        bt = tl.load(ptrs, mask=(offs_r[:, None] < left) & cols[None, :], other=0.0)
    return bt


@triton.jit
def lora_b_tile(b_ptr, offs_n, n_limit, stride_bn, rank, col0, BLOCK_R: tl.constexpr, CHUNKS: tl.constexpr = True):
    """`lora_b_tile_cols` of the output rows below n_limit."""
    return lora_b_tile_cols(b_ptr, offs_n, offs_n < n_limit, stride_bn, rank, col0, BLOCK_R, CHUNKS)


@triton.jit
def add_expand(acc_g, acc_u, xs, b_se, offs_n, n_limit, stride_bn, rank, col0, R: tl.constexpr, TWO: tl.constexpr):
    """acc_g (+ acc_u with TWO: the up half, B rows n_limit + offs_n) += xs [BM, R] @ B^T over B rows offs_n."""
    acc_g = tl.dot(xs, lora_b_tile(b_se, offs_n, n_limit, stride_bn, rank, col0, R).to(xs.dtype), acc_g)
    if TWO:
        acc_u = tl.dot(xs, lora_b_tile(b_se + n_limit * stride_bn, offs_n, n_limit, stride_bn, rank, col0,
                                       R).to(xs.dtype), acc_u)
    return acc_g, acc_u


@triton.jit
def lora_a_tile(a_ptr, k0, offs_k, k_dim, stride_ar, rank, BLOCK_R: tl.constexpr):
    """[BK, BLOCK_R] tile of A^T (A is [R, k_dim]) at depth k0, rank- and depth-masked."""
    offs_r = tl.arange(0, BLOCK_R)
    return tl.load(a_ptr + offs_r[None, :] * stride_ar + (k0 + offs_k)[:, None],
                   mask=(offs_r[None, :] < rank) & ((k0 + offs_k) < k_dim)[:, None], other=0.0)


# the "stacked" routed-expert LoRA: column c of S * BLOCK_R stands for rank row c % BLOCK_R of slot c // BLOCK_R
@triton.jit
def stacked_slot_ranks(slot, ranks_ptr, n_slots, S_P2: tl.constexpr):
    """[S_P2]: each slot's rank if some row of `slot` is on it, else 0 (so the stacked masks need no load)."""
    offs_s = tl.arange(0, S_P2)
    present = tl.max((slot[:, None] == offs_s[None, :]).to(tl.int32), axis=0) > 0
    return tl.load(ranks_ptr + offs_s, mask=present & (offs_s < n_slots), other=0)


@triton.jit
def stacked_columns(slot_ranks, c0, BLOCK_R: tl.constexpr, CW: tl.constexpr, S_P2: tl.constexpr):
    """Stacked columns [c0, c0 + CW): (columns, their slots, their rank rows, live); a dead column moves no bytes."""
    cols = c0 + tl.arange(0, CW)
    s_col = cols // BLOCK_R
    r_col = cols % BLOCK_R
    hit = s_col[:, None] == tl.arange(0, S_P2)[None, :]
    rank_col = tl.sum(tl.where(hit, slot_ranks[None, :], 0), axis=1)
    return cols, s_col, r_col, r_col < rank_col


@triton.jit
def drop_largest_slots(slot, lane):
    """(slot vector with its `lane` largest distinct slots set to -1, the largest one left or -1)."""
    s = tl.max(slot, axis=0)
    for _ in range(lane):
        slot = tl.where(slot == s, -1, slot)
        s = tl.max(slot, axis=0)
    return slot, s


def lane_count(S: int, T: int, block_m: int, cap: int) -> int:
    """Slot lanes of a LoRA grid (dense shrink / expand, the routed block delta): at most the pool's S slots, `cap`
    (the config's), and the distinct slots a row block can hold, min(T tokens, block_m rows): a one-row decode step
    launches one lane, not `cap` programs a tile that find no slot and return (the last lane takes every slot left,
    so fewer lanes are always complete)."""
    return max(1, min(S, T, block_m, cap))


@triton.jit
def load_slot_ranks(ranks_ptr, n_slots, S_P2: tl.constexpr, G: tl.constexpr, G_P2: tl.constexpr):
    """Every slot's rank: [S_P2] from ranks [S] (G == 1), or [G_P2, S_P2] from ranks [G, S]; zero past S and G."""
    offs_s = tl.arange(0, S_P2)
    if G == 1:
        ranks = tl.load(ranks_ptr + offs_s, mask=offs_s < n_slots, other=0)
    else:
        offs_g = tl.arange(0, G_P2)
        ranks = tl.load(ranks_ptr + offs_g[:, None] * n_slots + offs_s[None, :],
                        mask=(offs_g[:, None] < G) & (offs_s[None, :] < n_slots), other=0)
    return ranks


@triton.jit
def segment_rank(ranks, s, g, S_P2: tl.constexpr, G_P2: tl.constexpr):
    """Rank of slot s at segment g, from `load_slot_ranks`' [G_P2, S_P2] tile (no memory access)."""
    hit = (tl.arange(0, G_P2)[:, None] == g) & (tl.arange(0, S_P2)[None, :] == s)
    return tl.sum(tl.sum(tl.where(hit, ranks, 0), axis=1), axis=0)


# dense multi-LoRA (`dense_lora` split and splitk): slot lanes and the expand of a tile
@triton.jit
def lane_rows(slots_ptr, ranks_ptr, offs_t, T, n_slots, lane, n_lanes, S_P2: tl.constexpr, G: tl.constexpr,
               G_P2: tl.constexpr):
    """The rows a lane owns: (slots left, first slot or -1, the lane's row mask, slot ranks); the last lane takes every
    slot left. The ranks are loaded with the slots: no extra round trip."""
    slot = tl.load(slots_ptr + offs_t, mask=offs_t < T, other=-1)
    ranks = load_slot_ranks(ranks_ptr, n_slots, S_P2, G, G_P2)
    slot, s = drop_largest_slots(slot, lane)
    mine = (slot >= tl.where(lane == n_lanes - 1, 0, s)) & (slot <= s)  # slots left are all <= s
    return slot, s, mine, ranks


@triton.jit
def rank_of(ranks, s, S_P2: tl.constexpr):
    return tl.sum(tl.where(tl.arange(0, S_P2) == s, ranks, 0), axis=0)


@triton.jit
def dense_shrink_program(x_ptr, xa_ptr, a_ptr, slots_ptr, ranks_ptr, pid_m, pid_pg, lane, T, N_in, n_slots, k_chunk,
                         n_lanes, R_SEG, stride_xt, stride_xap, stride_as, stride_ar,
                         BM: tl.constexpr, BLOCK_R: tl.constexpr, BK: tl.constexpr, S_P2: tl.constexpr,
                         G: tl.constexpr):
    """Program (m, p G + g, lane) of the dense shrink: xa[p, t, g] = x[t, chunk p] @ A_g,slot(t)[:rank_g, chunk p]^T.
    One program per segment g, not one over all G*R rows: a [128, 256] A tile (q/k/v at r64) spilled on sm_90."""
    offs_t = pid_m * BM + tl.arange(0, BM)
    p = pid_pg // G
    g = pid_pg % G
    slot, s, mine, ranks = lane_rows(slots_ptr, ranks_ptr + g * n_slots, offs_t, T, n_slots, lane, n_lanes, S_P2,
                                      1, 1)
    if s >= 0:
        k_start = p * k_chunk
        k_end = tl.minimum(k_start + k_chunk, N_in)
        a_g = a_ptr + (g * R_SEG).to(tl.int64) * stride_ar
        xa = tl.zeros((BM, BLOCK_R), tl.float32)
        while s >= 0:  # masked loads move no bytes: each row of x is read once, A once per slot
            sel = slot == s
            rank = rank_of(ranks, s, S_P2)
            if rank > 0:
                xa += lora_shrink_rows(x_ptr, offs_t, stride_xt, sel, a_g + s.to(tl.int64) * stride_as, stride_ar,
                                       rank, k_start, k_end, BM, BLOCK_R, BK)
            slot = tl.where(sel, -1, slot)
            s = tl.where(lane == n_lanes - 1, tl.max(slot, axis=0), -1)
        offs_r = tl.arange(0, BLOCK_R)
        xa_ptrs = (xa_ptr + p.to(tl.int64) * stride_xap + offs_t[:, None].to(tl.int64) * (G * BLOCK_R) + g * BLOCK_R
                   + offs_r[None, :])
        tl.store(xa_ptrs, xa, mask=mine[:, None])


@triton.jit
def expand_tile(xa_ptr, y_ptr, b_ptr, slot, s, ranks, offs_t, offs_n, mine, lane, n_lanes, N_out, stride_xap,
                stride_bs, stride_bn, BM: tl.constexpr, BN: tl.constexpr, BLOCK_R: tl.constexpr,
                SPLIT: tl.constexpr, S_P2: tl.constexpr, G: tl.constexpr, G_P2: tl.constexpr,
                SEG_BOUNDS: tl.constexpr):
    """[BM, BN] fp32 delta of an output tile for the rows in `mine`, from the P partials xa [P, T, G * BLOCK_R]."""
    if G == 1:
        offs_r = tl.arange(0, BLOCK_R)
        xa = tl.zeros((BM, BLOCK_R), tl.float32)
        for p in tl.static_range(SPLIT):
            xa += tl.load(xa_ptr + p * stride_xap + offs_t[:, None].to(tl.int64) * BLOCK_R + offs_r[None, :],
                          mask=mine[:, None], other=0.0)
        xa = xa.to(y_ptr.dtype.element_ty)
        acc = tl.zeros((BM, BN), tl.float32)
        while s >= 0:
            sel = slot == s
            bt = lora_b_tile(b_ptr + s.to(tl.int64) * stride_bs, offs_n, N_out, stride_bn, rank_of(ranks, s, S_P2),
                             0, BLOCK_R)
            acc = tl.dot(tl.where(sel[:, None], xa, 0.0).to(xa.dtype), bt.to(xa.dtype), acc)
            slot = tl.where(sel, -1, slot)
            s = tl.where(lane == n_lanes - 1, tl.max(slot, axis=0), -1)
    else:
        acc = expand_segments(xa_ptr, y_ptr, b_ptr, slot, s, ranks, offs_t, offs_n, mine, lane, n_lanes, stride_xap,
                              stride_bs, stride_bn, BM, BN, BLOCK_R, SPLIT, S_P2, G, G_P2, SEG_BOUNDS)
    return acc


@triton.jit
def expand_segments(xa_ptr, y_ptr, b_ptr, slot0, s0, ranks, offs_t, offs_n, mine, lane, n_lanes, stride_xap,
                     stride_bs, stride_bn, BM: tl.constexpr, BN: tl.constexpr, BLOCK_R: tl.constexpr,
                     SPLIT: tl.constexpr, S_P2: tl.constexpr, G: tl.constexpr, G_P2: tl.constexpr,
                     SEG_BOUNDS: tl.constexpr):
    """[BM, BN] fp32 delta of an output tile of a merged projection, segment by segment (rank-0 segments skipped)."""
    n0 = tl.program_id(1) * BN
    offs_r = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BM, BN), tl.float32)
    for g in tl.static_range(G):
        lo = SEG_BOUNDS[g]
        hi = SEG_BOUNDS[g + 1]
        if (n0 < hi) & (n0 + BN > lo):
            xa = tl.zeros((BM, BLOCK_R), tl.float32)
            for p in tl.static_range(SPLIT):
                xa += tl.load(xa_ptr + p * stride_xap + offs_t[:, None].to(tl.int64) * (G * BLOCK_R) + g * BLOCK_R
                              + offs_r[None, :], mask=mine[:, None], other=0.0)
            xa = xa.to(y_ptr.dtype.element_ty)
            slot = slot0
            s = s0
            while s >= 0:
                sel = slot == s
                rank = segment_rank(ranks, s, g, S_P2, G_P2)
                if rank > 0:
                    # column masks here: chunked tiles cost this kernel occupancy (docs/performance.md, dense tiles)
                    bt = lora_b_tile_cols(b_ptr + s.to(tl.int64) * stride_bs, offs_n, (offs_n >= lo) & (offs_n < hi),
                                          stride_bn, rank, 0, BLOCK_R, CHUNKS=False)
                    acc = tl.dot(tl.where(sel[:, None], xa, 0.0).to(xa.dtype), bt.to(xa.dtype), acc)
                slot = tl.where(sel, -1, slot)
                s = tl.where(lane == n_lanes - 1, tl.max(slot, axis=0), -1)
    return acc


# decode's few rows, a block of BT at once (rows t0 to t0 + BT - 1 of T): each row's A / B rows gathered by its slot
# (dense_lora.split.rows_path)
@triton.jit
def shrink_rows(x_ptr, xa_ptr, a_ptr, slots_ptr, ranks_ptr, p, g, t0, T, N_in, n_slots, k_chunk, R_SEG, stride_xt,
                 stride_xap, stride_as, stride_ar, BT: tl.constexpr, BLOCK_R: tl.constexpr, BK: tl.constexpr,
                 G: tl.constexpr):
    """xa[p, t, g BLOCK_R + r] = x[t, chunk p] @ A_g,slot(t)[r, chunk p] for every row t of the block from t0 (zero on
    rows of no slot and past the slot's rank): each row's A rows gathered by its slot, products summed in fp32."""
    offs_t = t0 + tl.arange(0, BT)
    offs_r = tl.arange(0, BLOCK_R)
    t_ok = offs_t < T
    slot = tl.load(slots_ptr + offs_t, mask=t_ok, other=-1)
    on = slot >= 0
    s_safe = tl.where(on, slot, 0)
    rank = tl.load(ranks_ptr + g * n_slots + s_safe, mask=on, other=0)
    a_rows = (a_ptr + s_safe[:, None, None].to(tl.int64) * stride_as
              + (g * R_SEG + offs_r)[None, :, None].to(tl.int64) * stride_ar)
    a_ok = on[:, None, None] & (offs_r[None, :, None] < rank[:, None, None])
    k_start = p * k_chunk
    k_end = tl.minimum(k_start + k_chunk, N_in)
    xa = tl.zeros((BT, BLOCK_R), tl.float32)
    for k0 in range(k_start, k_end, BK):
        offs_k = k0 + tl.arange(0, BK)
        k_ok = offs_k < k_end
        xt = tl.load(x_ptr + offs_t[:, None].to(tl.int64) * stride_xt + offs_k[None, :],
                     mask=on[:, None] & k_ok[None, :], other=0.0)
        at = tl.load(a_rows + offs_k[None, None, :], mask=a_ok & k_ok[None, None, :], other=0.0)
        xa += tl.sum(xt.to(tl.float32)[:, None, :] * at.to(tl.float32), axis=2)
    tl.store(xa_ptr + p.to(tl.int64) * stride_xap + offs_t[:, None].to(tl.int64) * (G * BLOCK_R) + g * BLOCK_R
             + offs_r[None, :], xa, mask=t_ok[:, None])


@triton.jit
def expand_rows(acc, xa_ptr, b_ptr, slots_ptr, ranks_ptr, t0, n0, T, N_out, n_slots, stride_xap, stride_bs,
                 stride_bn, y_dtype: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, BLOCK_R: tl.constexpr,
                 XA_SPLIT: tl.constexpr, G: tl.constexpr, SEG_BOUNDS: tl.constexpr):
    """acc [BT, BN] (rows t0 to t0 + BT - 1) + each row's delta: its xa (the P partials summed, rounded to the output
    dtype, as the lanes' dot reads it) times its slot's B rows of this column tile, segment by segment, gathered by
    slot."""
    offs_t = t0 + tl.arange(0, BT)
    offs_r = tl.arange(0, BLOCK_R)
    offs_n = n0 + tl.arange(0, BN)
    t_ok = offs_t < T
    slot = tl.load(slots_ptr + offs_t, mask=t_ok, other=-1)
    on = slot >= 0
    s_safe = tl.where(on, slot, 0)
    b_rows = b_ptr + s_safe[:, None, None].to(tl.int64) * stride_bs + offs_n[None, :, None] * stride_bn
    for g in tl.static_range(G):
        if G == 1:
            lo = 0
            hi = N_out
        else:
            lo = SEG_BOUNDS[g]
            hi = SEG_BOUNDS[g + 1]
        if (n0 < hi) & (n0 + BN > lo):
            rank = tl.load(ranks_ptr + g * n_slots + s_safe, mask=on, other=0)
            xa = tl.zeros((BT, BLOCK_R), tl.float32)
            for p in tl.static_range(XA_SPLIT):
                xa += tl.load(xa_ptr + p * stride_xap + offs_t[:, None].to(tl.int64) * (G * BLOCK_R) + g * BLOCK_R
                              + offs_r[None, :], mask=on[:, None], other=0.0)
            xa = xa.to(y_dtype).to(tl.float32)
            cols = (offs_n >= lo) & (offs_n < hi) & (offs_n < N_out)
            bt = tl.load(b_rows + offs_r[None, None, :],
                         mask=on[:, None, None] & cols[None, :, None] & (offs_r[None, None, :] < rank[:, None, None]),
                         other=0.0)
            acc += tl.sum(xa[:, None, :] * bt.to(tl.float32), axis=2)
    return acc
