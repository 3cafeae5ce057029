"""Triton building blocks shared by the LoRA kernels (routed experts and dense linears).

Shape legend: BM rows, BN output columns, R rank (BLOCK_R = pow2 >= 16 >= R), k_dim the input
features. A [R, k_dim] and B [N, R] are one (slot, expert) or one slot's matrices, unit last
stride. Loads are masked to the slot's rank: an adapter of rank r moves r rows of A / columns
of B whatever the pool's R.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def lora_shrink_rows(src_ptr, rows, stride_src, sel, a_ptr, stride_ar, rank, k_start, k_end,
                     BM: tl.constexpr, BLOCK_R: tl.constexpr, LORA_BK: tl.constexpr):
    """[BM, BLOCK_R] fp32: src[rows, k_start:k_end] @ A[:, k_start:k_end]^T for the rows in `sel`
    (zero elsewhere), rank-masked."""
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
def lora_b_tile(b_ptr, offs_n, n_limit, stride_bn, rank, BLOCK_R: tl.constexpr):
    """[BLOCK_R, BN] tile of B^T (B is [N, R]), rank- and column-masked."""
    offs_r = tl.arange(0, BLOCK_R)
    return tl.load(b_ptr + offs_n[None, :] * stride_bn + offs_r[:, None],
                   mask=(offs_r[:, None] < rank) & (offs_n[None, :] < n_limit), other=0.0)


@triton.jit
def lora_a_tile(a_ptr, k0, offs_k, k_dim, stride_ar, rank, BLOCK_R: tl.constexpr):
    """[BK, BLOCK_R] tile of A^T (A is [R, k_dim]) at depth k0, rank- and depth-masked."""
    offs_r = tl.arange(0, BLOCK_R)
    return tl.load(a_ptr + offs_r[None, :] * stride_ar + (k0 + offs_k)[:, None],
                   mask=(offs_r[None, :] < rank) & ((k0 + offs_k) < k_dim)[:, None], other=0.0)


@triton.jit
def lora_b_tile_cols(b_ptr, offs_n, n_lo, n_hi, stride_bn, rank, BLOCK_R: tl.constexpr):
    """[BLOCK_R, BN] tile of B^T (B is [N, R]) for output rows in [n_lo, n_hi) only: one segment of
    a merged projection's B, rank- and segment-masked."""
    offs_r = tl.arange(0, BLOCK_R)
    cols = (offs_n >= n_lo) & (offs_n < n_hi)
    return tl.load(b_ptr + offs_n[None, :] * stride_bn + offs_r[:, None],
                   mask=(offs_r[:, None] < rank) & cols[None, :], other=0.0)


@triton.jit
def drop_largest_slots(slot, lane):
    """(slot vector with its `lane` largest distinct slots set to -1, the largest one left or -1):
    how a slot lane finds the slot it handles."""
    s = tl.max(slot, axis=0)
    for _ in range(lane):
        slot = tl.where(slot == s, -1, slot)
        s = tl.max(slot, axis=0)
    return slot, s


@triton.jit
def load_slot_ranks(ranks_ptr, n_slots, S_P2: tl.constexpr, G: tl.constexpr, G_P2: tl.constexpr):
    """Every slot's rank: [S_P2] from ranks [S] (G == 1), or [G_P2, S_P2] from ranks [G, S] (contiguous);
    zero past S and G."""
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
