"""Dense LoRA mode "split": cuBLAS for the base, then a shrink kernel and an expand kernel.

Shape legend: `base`'s, and P shrink splits over N_in.
  shrink: xa [P, T, G BLOCK_R] fp32 = x[t, chunk p] @ A_slot(t)[:rank]^T    (on the side stream when given)
  expand: y[t] += (sum_p xa[p, t]) @ B_slot(t)[:, :rank]^T
Programs (m, ., lane) take the lane-th distinct slot of their rows (the last lane the rest): lanes touch
disjoint rows, so no atomics, and each program's chain of dependent loads stays short.
`expand_first` (one lane; prefill's where "concat" does not run): shrink, then the expand writes y = delta (+ bias)
on every row, then cuBLAS adds x W^T onto it (beta = 1), all on the current stream.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from moelora.kernels.args import DenseLoRAArgs
from moelora.kernels.checks import cdiv, next_pow2
from moelora.kernels.dense_lora.base import Segments, base_gemm
from moelora.kernels.dense_policy import PLANNED_MAX_ROWS
from moelora.kernels.lora_tiles import (
    dense_shrink_program,
    expand_rows,
    expand_tile,
    lane_count,
    lane_rows,
    shrink_rows,
)
from moelora.kernels.pdl import pdl_args, pdl_wait
from moelora.kernels.side_stream import forked, join

# Shrink programs to aim for with one slot per row block (split over N_in when T alone gives fewer):
# about one per SM on an H200 (132); more slots multiply them through the slot lanes.
SHRINK_TARGET_PROGRAMS = 128
SHRINK_BLOCK_M, SHRINK_STAGES = 16, 3  # the shrink's row block and pipeline stages: no default ever moved them
PREFILL_SHRINK_BLOCK_M = 64  # above PLANNED_MAX_ROWS (prefill): A read from L2 once a 64-row block, not a 16-row one


# the row-gathered shrink / expand up to this many rows, ROWS_BT rows a program (a grid axis of row blocks), while a
# [bt, BLOCK_R, depth] gather stays in registers. H100 with every row in one program (51st session): T 1-4 7-13 %
# faster than the slot lanes, T 8 / 16 4-64 % slower (fewer programs, each walking [8 or 16, BLOCK_R, BK] gathers).
# Row blocks of 4 (53rd session, H100, lora_linear 8 adapters r16, splitk, PDL, ms a step, two rounds): o 0.62 / 0.62
# at T 8 / 16 against the lanes' 0.71 / 0.70, q/k/v 1.37 / 1.41 against 1.55 / 1.54; T <= 4 as before (one block).
# One row a program: T 2-16 0-7 % slower than blocks of 4 (o 0.64 at T 4, q/k/v 1.46 at T 16); q/k/v T 8 1.7 % faster.
ROWS_MAX = 16
ROWS_BT = 4  # rows a rows-path program (rounded up to a power of two)
ROWS_TILE = 8192  # elements of a row program's gathered [bt, BLOCK_R, BK] A or [bt, BN, BLOCK_R] B tile


def rows_bt(T: int) -> int:
    """The rows a rows-path program takes at T rows: min(T, ROWS_BT), as a power of two."""
    return next_pow2(max(1, min(next_pow2(T), ROWS_BT)))


def rows_path(T: int, block_r: int) -> bool:
    """Whether T rows take the row-gathered shrink and expand (`shrink_rows`, `expand_rows`)."""
    return T <= ROWS_MAX and rows_bt(T) * block_r * 16 <= ROWS_TILE


class RowsTiles(NamedTuple):
    bt: int  # rows a program (a power of two): cdiv(T, bt) row blocks side by side
    bk: int  # the shrink's K step
    bn: int  # the expand's columns a program


def rows_tiles(T: int, block_r: int, block_n: int) -> RowsTiles | None:
    """The rows path's tiles for T rows (a [bt, BLOCK_R, bk] A and a [bt, bn, BLOCK_R] B gather within ROWS_TILE,
    bt rows a program), or None where the slot lanes take them (`rows_path`)."""
    if not rows_path(T, block_r):
        return None
    bt = rows_bt(T)
    per = ROWS_TILE // (bt * block_r)
    return RowsTiles(bt, min(256, per), min(block_n, per))


class Split:
    name = "split"

    @staticmethod
    def run(x, weight, bias, lora, out, cfg, side_stream=None) -> None:
        T, n_in = x.shape
        if lora is not None and cfg.expand_first:
            # the delta (+ bias) written first, the GEMM adding onto it: no read-modify-write pass over the output
            # after the GEMM (the shrink cannot overlap the GEMM here, so no side stream)
            expand(out, lora, T, out.shape[1], cfg, shrink(x, lora, T, n_in, cfg), bias=bias)
            out.addmm_(x, weight.t())
            return
        shrunk = None
        if lora is not None and side_stream is not None:
            # Fork (contract 2): the side stream reads x, A, the slots and ranks and writes only xa; the
            # GEMM here reads x and W and writes only `out`. Nothing read across the fork is written before
            # the join, and xa (allocated here before the fork) is read by the expand after it.
            shrunk = shrink(x, lora, T, n_in, cfg, side_stream)
        base_gemm(x, weight, bias, out)
        if lora is None:
            return
        if shrunk is None:
            shrunk = shrink(x, lora, T, n_in, cfg)
        else:
            join(side_stream, x.device)  # xa is complete
        expand(out, lora, T, out.shape[1], cfg, shrunk)


class ShrinkLaunch(NamedTuple):
    """The dense shrink's launch and what the expand needs of it (split launches it, splitk folds it in)."""

    xa: torch.Tensor
    lora: DenseLoRAArgs
    seg: Segments
    n_split: int
    chunk: int
    lanes: int
    block_m: int
    block_k: int
    s_p2: int


def shrink_setup(x, lora, T, n_in, cfg) -> ShrinkLaunch:
    """The shrink's launch, its xa allocated here on the current stream; P capped to keep the expand from spilling."""
    seg, S = Segments(lora), lora.a.shape[0]
    n_kb = max(1, cdiv(n_in, cfg.block_k))
    bm = PREFILL_SHRINK_BLOCK_M if T > PLANNED_MAX_ROWS else SHRINK_BLOCK_M
    want = cfg.split_k
    if not want:  # K splits to bring the row blocks up to SHRINK_TARGET_PROGRAMS
        budget = max(1, 32 * 32 * cfg.num_warps // (cfg.block_m * seg.block_r))
        want = min(budget, cdiv(SHRINK_TARGET_PROGRAMS, cdiv(T, bm)))
    chunk = cdiv(n_kb, max(1, min(want, n_kb))) * cfg.block_k
    n_split = max(1, cdiv(n_in, chunk))
    xa = torch.empty(n_split, T, seg.G * seg.block_r, dtype=torch.float32, device=x.device)
    return ShrinkLaunch(xa, lora, seg, n_split, chunk, lane_count(S, T, bm, cfg.slot_lanes), bm, cfg.block_k,
                       next_pow2(S))


def shrink(x, lora, T, n_in, cfg, side_stream=None) -> ShrinkLaunch:
    """Launch the shrink (on `side_stream` when given); xa was allocated before the fork, read after the join. Up
    to ROWS_MAX rows (`rows_path`) one program a (chunk, segment, block of `rows_tiles`' bt rows)
    (`lora_tiles.shrink_rows`)."""
    sh = shrink_setup(x, lora, T, n_in, cfg)
    rt = rows_tiles(T, sh.seg.block_r, cfg.block_n)
    if rt is not None:
        with forked(side_stream, x.device):
            _lora_shrink_rows_kernel[(sh.n_split * sh.seg.G, cdiv(T, rt.bt))](
                x, sh.xa, lora.a, lora.token_slots, lora.slot_ranks, T, n_in, lora.a.shape[0], sh.chunk,
                sh.seg.r_seg, x.stride(0), sh.xa.stride(0), lora.a.stride(0), lora.a.stride(1), BT=rt.bt,
                BLOCK_R=sh.seg.block_r, BK=rt.bk, G=sh.seg.G, num_warps=4,
                **pdl_args(cfg.pdl, x))
        return sh
    with forked(side_stream, x.device):
        _lora_shrink_kernel[(cdiv(T, sh.block_m), sh.n_split * sh.seg.G, sh.lanes)](
            x, sh.xa, lora.a, lora.token_slots, lora.slot_ranks, T, n_in, lora.a.shape[0], sh.chunk, sh.lanes,
            sh.seg.r_seg, x.stride(0), sh.xa.stride(0), lora.a.stride(0), lora.a.stride(1), BM=sh.block_m,
            BLOCK_R=sh.seg.block_r, BK=sh.block_k, S_P2=sh.s_p2, G=sh.seg.G, num_warps=4,
            num_stages=SHRINK_STAGES, **pdl_args(cfg.pdl, x))
    return sh


def expand(out, lora, T, n_out, cfg, sh: ShrinkLaunch, bias=None):
    """out += the delta; `cfg.expand_first`: out = the delta (+ `bias`), every row (zero where no slot). Up to
    ROWS_MAX rows (`rows_path`) one program a (column tile, block of bt rows) (`lora_tiles.expand_rows`)."""
    S = lora.a.shape[0]
    rt = None if cfg.expand_first else rows_tiles(T, sh.seg.block_r, cfg.block_n)
    if rt is not None:
        _lora_expand_rows_kernel[(cdiv(n_out, rt.bn), cdiv(T, rt.bt))](
            sh.xa, out, lora.b, lora.token_slots, lora.slot_ranks, T, n_out, S, sh.xa.stride(0), out.stride(0),
            lora.b.stride(0), lora.b.stride(1), BT=rt.bt, BN=rt.bn, BLOCK_R=sh.seg.block_r, XA_SPLIT=sh.n_split,
            G=sh.seg.G, SEG_BOUNDS=sh.seg.bounds, num_warps=4, **pdl_args(cfg.pdl, out))
        return
    lanes = lane_count(S, T, cfg.block_m, cfg.slot_lanes)  # one under expand_first (its config holds one lane)
    _lora_expand_add_kernel[(cdiv(T, cfg.block_m), cdiv(n_out, cfg.block_n), lanes)](
        sh.xa, out, bias if bias is not None else out, lora.b, lora.token_slots, lora.slot_ranks, T, n_out, S, lanes,
        sh.xa.stride(0), out.stride(0), lora.b.stride(0), lora.b.stride(1), BM=cfg.block_m, BN=cfg.block_n,
        BLOCK_R=sh.seg.block_r, SPLIT=sh.n_split, S_P2=sh.s_p2, G=sh.seg.G, G_P2=sh.seg.g_p2,
        SEG_BOUNDS=sh.seg.bounds, WRITE=cfg.expand_first, HAS_BIAS=bias is not None, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **pdl_args(cfg.pdl, out))


@triton.jit
def _lora_shrink_kernel(
    x_ptr, xa_ptr, a_ptr, slots_ptr, ranks_ptr, T, N_in, n_slots, k_chunk, n_lanes, R_SEG,
    stride_xt, stride_xap, stride_as, stride_ar,
    BM: tl.constexpr, BLOCK_R: tl.constexpr, BK: tl.constexpr, S_P2: tl.constexpr, G: tl.constexpr,
    PDL: tl.constexpr,
):
    """xa[p, t, g] = x[t, chunk p] @ A_g,slot(t)[:rank_g, chunk p]^T (`dense_shrink_program`)."""
    pdl_wait(PDL)
    dense_shrink_program(x_ptr, xa_ptr, a_ptr, slots_ptr, ranks_ptr, tl.program_id(0), tl.program_id(1),
                         tl.program_id(2), T, N_in, n_slots, k_chunk, n_lanes, R_SEG, stride_xt, stride_xap,
                         stride_as, stride_ar, BM, BLOCK_R, BK, S_P2, G)


@triton.jit
def _lora_expand_add_kernel(
    xa_ptr, y_ptr, bias_ptr, b_ptr, slots_ptr, ranks_ptr, T, N_out, n_slots, n_lanes,
    stride_xap, stride_yt, stride_bs, stride_bn,
    BM: tl.constexpr, BN: tl.constexpr, BLOCK_R: tl.constexpr, SPLIT: tl.constexpr, S_P2: tl.constexpr,
    G: tl.constexpr, G_P2: tl.constexpr, SEG_BOUNDS: tl.constexpr, WRITE: tl.constexpr, HAS_BIAS: tl.constexpr,
    PDL: tl.constexpr,
):
    """y[t, n tile] += (sum_p xa[p, t]) @ B_slot(t)[n tile, :rank]^T for the lane's rows (G > 1: `expand_segments`);
    WRITE (one lane): y[t, n tile] = that (+ bias[n tile]) for every row of the tile, zero where no slot."""
    pdl_wait(PDL)
    offs_t = tl.program_id(0) * BM + tl.arange(0, BM)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    lane = tl.program_id(2)
    slot, s, mine, ranks = lane_rows(slots_ptr, ranks_ptr, offs_t, T, n_slots, lane, n_lanes, S_P2, G, G_P2)
    y_ptrs = y_ptr + offs_t[:, None].to(tl.int64) * stride_yt + offs_n[None, :]
    if WRITE:
        acc = expand_tile(xa_ptr, y_ptr, b_ptr, slot, s, ranks, offs_t, offs_n, mine, lane, n_lanes, N_out,
                          stride_xap, stride_bs, stride_bn, BM, BN, BLOCK_R, SPLIT, S_P2, G, G_P2, SEG_BOUNDS)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N_out, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(offs_t[:, None] < T) & (offs_n[None, :] < N_out))
        return
    if s < 0:
        return
    # Everything whose address is known is loaded before the slot loop: y, and the P partials
    # (unrolled, all in flight at once), so the chain is slots -> {y, xa, B} -> store.
    mask = mine[:, None] & (offs_n[None, :] < N_out)
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    acc = expand_tile(xa_ptr, y_ptr, b_ptr, slot, s, ranks, offs_t, offs_n, mine, lane, n_lanes, N_out, stride_xap,
                      stride_bs, stride_bn, BM, BN, BLOCK_R, SPLIT, S_P2, G, G_P2, SEG_BOUNDS)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _lora_shrink_rows_kernel(x_ptr, xa_ptr, a_ptr, slots_ptr, ranks_ptr, T, N_in, n_slots, k_chunk, R_SEG, stride_xt,
                             stride_xap, stride_as, stride_ar, BT: tl.constexpr, BLOCK_R: tl.constexpr,
                             BK: tl.constexpr, G: tl.constexpr, PDL: tl.constexpr):
    """Program (p G + g, b): `shrink_rows` of chunk p, segment g, rows [b BT, (b + 1) BT)."""
    pdl_wait(PDL)
    pid = tl.program_id(0)
    shrink_rows(x_ptr, xa_ptr, a_ptr, slots_ptr, ranks_ptr, pid // G, pid % G, tl.program_id(1) * BT, T, N_in,
                n_slots, k_chunk, R_SEG, stride_xt, stride_xap, stride_as, stride_ar, BT, BLOCK_R, BK, G)


@triton.jit
def _lora_expand_rows_kernel(xa_ptr, y_ptr, b_ptr, slots_ptr, ranks_ptr, T, N_out, n_slots, stride_xap, stride_yt,
                             stride_bs, stride_bn, BT: tl.constexpr, BN: tl.constexpr, BLOCK_R: tl.constexpr,
                             XA_SPLIT: tl.constexpr, G: tl.constexpr, SEG_BOUNDS: tl.constexpr, PDL: tl.constexpr):
    """Program (n tile, b): y[rows of block b on a slot, n tile] += their delta (`expand_rows`); rows on no slot are
    not touched."""
    pdl_wait(PDL)
    t0 = tl.program_id(1) * BT
    offs_t = t0 + tl.arange(0, BT)
    n0 = tl.program_id(0) * BN
    offs_n = n0 + tl.arange(0, BN)
    on = tl.load(slots_ptr + offs_t, mask=offs_t < T, other=-1) >= 0
    mask = on[:, None] & (offs_n < N_out)[None, :]
    y_ptrs = y_ptr + offs_t[:, None].to(tl.int64) * stride_yt + offs_n[None, :]
    acc = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    acc = expand_rows(acc, xa_ptr, b_ptr, slots_ptr, ranks_ptr, t0, n0, T, N_out, n_slots, stride_xap, stride_bs,
                      stride_bn, y_ptr.dtype.element_ty, BT, BN, BLOCK_R, XA_SPLIT, G, SEG_BOUNDS)
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
