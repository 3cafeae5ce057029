"""Dense LoRA mode "splitk": a split-K decode GEMM whose reduction adds the bias and the LoRA expand.

Shape legend: `base`'s (T <= SPLITK_MAX_ROWS), and P split-K chunks.
  partials: x [T, N_in] @ W [N_out, N_in]^T over chunk p of N_in -> ws [P, T, N_out] fp32
            (+ LoRA: the dense shrink, xa [P', T, G BLOCK_R] fp32, in the same launch)
  reduce:   y [T, N_out] = sum_p ws[p] (+ bias) (+ xa @ B_slot(t)^T per row), rounded once
Why: the expand rides in the reduce a split-K GEMM needs anyway and the shrink in the partials' launch, so
LoRA adds no launch, stream or join at decode. Fixed summation order: deterministic.
Up to `split.ROWS_MAX` rows (decode) the shrink and the expand work on blocks of `split.ROWS_BT` rows, each row's
A / B rows gathered by its slot (`lora_tiles.shrink_rows`, `expand_rows`): one program a (chunk, segment, row block)
of the shrink and a (column tile, row block) of the reduce.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moelora.kernels.checks import cdiv, next_pow2
from moelora.kernels.dense_lora.split import RowsTiles, ShrinkLaunch, Split, rows_tiles, shrink_setup
from moelora.kernels.lora_tiles import (
    dense_shrink_program,
    expand_rows,
    expand_tile,
    lane_count,
    lane_rows,
    shrink_rows,
)
from moelora.kernels.pdl import pdl_args, pdl_wait

# replaces cuBLAS for rows up to this many (decode), in fp16/bf16; beyond, or in fp32, "split"
SPLITK_MAX_ROWS = 64


class SplitK:
    name = "splitk"

    @staticmethod
    def run(x, weight, bias, lora, out, cfg, side_stream=None) -> None:
        if x.shape[0] <= SPLITK_MAX_ROWS and x.dtype != torch.float32 and weight.stride(1) == 1:
            splitk_linear(x, weight, bias, lora, out, cfg)
        else:
            Split.run(x, weight, bias, lora, out, cfg, side_stream)


def splitk_linear(x, weight, bias, lora, out, cfg) -> None:
    """One launch of split-K partials (+ the shrink's programs), then one reduce that adds bias and the expand."""
    if lora is None:
        splitk_reduce(splitk_partials(x, weight, cfg.gemm_split_k, cfg.gemm_block_n, cfg.gemm_block_k, pdl=cfg.pdl),
                      out, bias, None, None, cfg.block_m, cfg.block_n, cfg.slot_lanes, cfg.num_warps, pdl=cfg.pdl)
        return
    sh = shrink_setup(x, lora, x.shape[0], x.shape[1], cfg)
    rows = rows_tiles(x.shape[0], sh.seg.block_r, cfg.block_n)
    ws = splitk_partials(x, weight, cfg.gemm_split_k, cfg.gemm_block_n, cfg.gemm_block_k, shrink=sh, rows=rows,
                         pdl=cfg.pdl)
    splitk_reduce(ws, out, bias, lora, sh, cfg.block_m, cfg.block_n, cfg.slot_lanes, cfg.num_warps, rows=rows,
                  pdl=cfg.pdl)


@triton.jit
def splitk_partial_kernel(
    x_ptr, w_ptr, ws_ptr, T, N_in, N_out, k_chunk, stride_xt, stride_wn, stride_wsp, n_tiles_n, n_split,
    xa_ptr, a_ptr, slots_ptr, ranks_ptr, n_slots, s_chunk, n_lanes, R_SEG, stride_xap, stride_as, stride_ar,
    n_shrink_pg, n_shrink,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, HAS_LORA: tl.constexpr, S_BM: tl.constexpr,
    BLOCK_R: tl.constexpr, S_BK: tl.constexpr, S_P2: tl.constexpr, G: tl.constexpr, ROWS: tl.constexpr,
    PDL: tl.constexpr,
):
    """ws[p, t, n tile] = x[t, chunk p] @ W[n tile, chunk p]^T (fp32); with HAS_LORA the first n_shrink programs
    are the dense shrink's (ROWS: one a (chunk, segment, block of S_BM rows), (chunk, segment) fastest: pid =
    block n_shrink_pg + p G + g); then (n tile, p, m block), n fastest."""
    pdl_wait(PDL)
    pid = tl.program_id(0)
    if HAS_LORA:
        if ROWS & (pid < n_shrink):
            pg = pid % n_shrink_pg
            shrink_rows(x_ptr, xa_ptr, a_ptr, slots_ptr, ranks_ptr, pg // G, pg % G, (pid // n_shrink_pg) * S_BM, T,
                        N_in, n_slots, s_chunk, R_SEG, stride_xt, stride_xap, stride_as, stride_ar, S_BM, BLOCK_R,
                        S_BK, G)
            return
        if pid < n_shrink:
            dense_shrink_program(x_ptr, xa_ptr, a_ptr, slots_ptr, ranks_ptr, pid // (n_lanes * n_shrink_pg),
                                 (pid // n_lanes) % n_shrink_pg, pid % n_lanes, T, N_in, n_slots, s_chunk, n_lanes,
                                 R_SEG, stride_xt, stride_xap, stride_as, stride_ar, S_BM, BLOCK_R, S_BK, S_P2, G)
            return
        pid -= n_shrink
    offs_n = (pid % n_tiles_n) * BN + tl.arange(0, BN)
    p = (pid // n_tiles_n) % n_split
    offs_t = (pid // (n_tiles_n * n_split)) * BM + tl.arange(0, BM)
    offs_k = tl.arange(0, BK)
    t_ok = offs_t < T
    n_ok = offs_n < N_out
    k_start = p * k_chunk
    k_end = tl.minimum(k_start + k_chunk, N_in)
    x_rows = x_ptr + offs_t[:, None].to(tl.int64) * stride_xt
    w_cols = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in range(k_start, k_end, BK):
        kk = k0 + offs_k
        k_ok = kk < k_end
        xt = tl.load(x_rows + kk[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0)
        wt = tl.load(w_cols + kk[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(xt, wt, acc)
    tl.store(ws_ptr + p.to(tl.int64) * stride_wsp + offs_t[:, None].to(tl.int64) * N_out + offs_n[None, :], acc,
             mask=t_ok[:, None] & n_ok[None, :])


@triton.jit
def _partials_sum(ws_ptr, bias_ptr, offs_t, offs_n, mask, N_out, stride_wsp, HAS_BIAS: tl.constexpr,
                  SPLIT_K: tl.constexpr):
    """[rows, BN] fp32: the split-K partials of an output tile summed in split order (+ bias)."""
    ws_rows = ws_ptr + offs_t[:, None].to(tl.int64) * N_out + offs_n[None, :]
    acc = tl.zeros(ws_rows.shape, tl.float32)
    for p in tl.static_range(SPLIT_K):  # fixed order: deterministic
        acc += tl.load(ws_rows + p * stride_wsp, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N_out, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def splitk_reduce_rows_kernel(
    ws_ptr, y_ptr, bias_ptr, xa_ptr, b_ptr, slots_ptr, ranks_ptr, T, N_out, n_slots, stride_wsp, stride_yt,
    stride_xap, stride_bs, stride_bn,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, BLOCK_R: tl.constexpr,
    XA_SPLIT: tl.constexpr, G: tl.constexpr, SEG_BOUNDS: tl.constexpr, PDL: tl.constexpr,
):
    """Program (n tile, b): y[rows of block b, n tile] = sum_p ws[p] (+ bias) (+ each row's expand, `expand_rows`),
    the block's BT rows from b BT."""
    pdl_wait(PDL)
    t0 = tl.program_id(1) * BT
    offs_t = t0 + tl.arange(0, BT)
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    mask = (offs_t < T)[:, None] & (offs_n < N_out)[None, :]
    acc = _partials_sum(ws_ptr, bias_ptr, offs_t, offs_n, mask, N_out, stride_wsp, HAS_BIAS, SPLIT_K)
    acc = expand_rows(acc, xa_ptr, b_ptr, slots_ptr, ranks_ptr, t0, tl.program_id(0) * BN, T, N_out, n_slots,
                       stride_xap, stride_bs, stride_bn, y_ptr.dtype.element_ty, BT, BN, BLOCK_R, XA_SPLIT, G,
                       SEG_BOUNDS)
    tl.store(y_ptr + offs_t[:, None].to(tl.int64) * stride_yt + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def splitk_reduce_kernel(
    ws_ptr, y_ptr, bias_ptr, xa_ptr, b_ptr, slots_ptr, ranks_ptr, T, N_out, n_slots, n_lanes,
    stride_wsp, stride_yt, stride_xap, stride_bs, stride_bn,
    HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, SPLIT_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    BLOCK_R: tl.constexpr, XA_SPLIT: tl.constexpr, S_P2: tl.constexpr, G: tl.constexpr, G_P2: tl.constexpr,
    SEG_BOUNDS: tl.constexpr, PDL: tl.constexpr,
):
    """y[rows of this lane, n tile] = sum_p ws[p] (+ bias) (+ LoRA expand); see the module docstring."""
    pdl_wait(PDL)
    offs_t = tl.program_id(0) * BM + tl.arange(0, BM)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    lane = tl.program_id(2)
    t_ok = offs_t < T
    mine = t_ok
    if HAS_LORA:
        raw = tl.load(slots_ptr + offs_t, mask=t_ok, other=-1)
        slot, s, mine, ranks = lane_rows(slots_ptr, ranks_ptr, offs_t, T, n_slots, tl.maximum(lane - 1, 0), n_lanes,
                                         S_P2, G, G_P2)
        if (lane > 0) & (s < 0):  # fewer distinct slots than lanes
            return
        mine = tl.where(lane == 0, t_ok & (raw < 0), mine)
        s = tl.where(lane == 0, -1, s)
    if tl.max(mine.to(tl.int32), axis=0) == 0:
        return
    mask = mine[:, None] & (offs_n[None, :] < N_out)
    acc = _partials_sum(ws_ptr, bias_ptr, offs_t, offs_n, mask, N_out, stride_wsp, HAS_BIAS, SPLIT_K)
    if HAS_LORA:
        if s >= 0:
            acc += expand_tile(xa_ptr, y_ptr, b_ptr, slot, s, ranks, offs_t, offs_n, mine, lane - 1, n_lanes, N_out,
                               stride_xap, stride_bs, stride_bn, BM, BN, BLOCK_R, XA_SPLIT, S_P2, G, G_P2, SEG_BOUNDS)
    tl.store(y_ptr + offs_t[:, None].to(tl.int64) * stride_yt + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mask)


def splitk_partials(x: torch.Tensor, weight: torch.Tensor, split_k: int, block_n: int, block_k: int,
                    shrink: ShrinkLaunch | None = None, *, rows: RowsTiles | None = None,
                    pdl: bool = False) -> torch.Tensor:
    """ws [P, T, N_out] fp32; with `shrink`, the same launch also fills shrink.xa (`rows`: `shrink_rows`, a block of
    rows.bt rows of a (chunk, segment) a program); `pdl`: programmatic dependent launch where the GPU has it
    (`kernels.pdl`, as `splitk_reduce`'s)."""
    T, n_in = x.shape
    n_out = weight.shape[0]
    chunk = cdiv(cdiv(n_in, split_k), block_k) * block_k
    n_split = cdiv(n_in, chunk)
    ws = torch.empty(n_split, T, n_out, dtype=torch.float32, device=x.device)
    bm = min(64, max(16, next_pow2(T)))
    n_tiles_n = cdiv(n_out, block_n)
    n_gemm = n_tiles_n * n_split * cdiv(T, bm)
    if shrink is None:
        lora = (ws, ws, ws, ws, 0, 0, 1, 0, 0, 0, 0, 1, 0)
        consts = dict(HAS_LORA=False, S_BM=16, BLOCK_R=16, S_BK=16, S_P2=1, G=1, ROWS=False)
    else:
        sh, a = shrink, shrink.lora.a
        n_pg = sh.n_split * sh.seg.G
        n_shrink = n_pg * cdiv(T, rows.bt) if rows else cdiv(T, sh.block_m) * n_pg * sh.lanes
        lora = (sh.xa, a, sh.lora.token_slots, sh.lora.slot_ranks, a.shape[0], sh.chunk, sh.lanes, sh.seg.r_seg,
                sh.xa.stride(0), a.stride(0), a.stride(1), n_pg, n_shrink)
        consts = dict(HAS_LORA=True, S_BM=rows.bt if rows else sh.block_m, BLOCK_R=sh.seg.block_r,
                      S_BK=rows.bk if rows else sh.block_k, S_P2=sh.s_p2, G=sh.seg.G, ROWS=rows is not None)
    splitk_partial_kernel[(lora[-1] + n_gemm,)](
        x, weight, ws, T, n_in, n_out, chunk, x.stride(0), weight.stride(0), ws.stride(0), n_tiles_n, n_split,
        *lora, BM=bm, BN=block_n, BK=block_k, num_warps=4, num_stages=3, **consts, **pdl_args(pdl, x))
    return ws


def splitk_reduce(ws: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None, lora, shrink: ShrinkLaunch | None,
                  block_m: int, block_n: int, slot_lanes: int, num_warps: int = 4, *, rows: RowsTiles | None = None,
                  pdl: bool = False) -> None:
    """out = sum of the partials (+ bias) (+ the expand of `lora` from `shrink`'s xa; `rows`: `expand_rows`, a
    (column tile, block of rows.bt rows) a program)."""
    T, n_out = out.shape
    if lora is not None and rows:
        sh = shrink
        splitk_reduce_rows_kernel[(cdiv(n_out, rows.bn), cdiv(T, rows.bt))](
            ws, out, ws if bias is None else bias, sh.xa, lora.b, lora.token_slots, lora.slot_ranks, T, n_out,
            lora.a.shape[0], ws.stride(0), out.stride(0), sh.xa.stride(0), lora.b.stride(0), lora.b.stride(1),
            HAS_BIAS=bias is not None, SPLIT_K=ws.shape[0], BT=rows.bt, BN=rows.bn, BLOCK_R=sh.seg.block_r,
            XA_SPLIT=sh.n_split, G=sh.seg.G, SEG_BOUNDS=sh.seg.bounds, num_warps=4, **pdl_args(pdl, ws))
        return
    if lora is not None:
        sh, S = shrink, lora.a.shape[0]
        lanes = lane_count(S, T, block_m, slot_lanes)
        lora_args = (sh.xa, lora.b, lora.token_slots, lora.slot_ranks, S, lanes, sh.xa.stride(0), lora.b.stride(0),
                     lora.b.stride(1))
        consts = dict(BLOCK_R=sh.seg.block_r, XA_SPLIT=sh.n_split, S_P2=sh.s_p2, G=sh.seg.G, G_P2=sh.seg.g_p2,
                      SEG_BOUNDS=sh.seg.bounds)
    else:
        lanes = 0
        lora_args = (ws, ws, ws, ws, 0, 0, 0, 0, 0)
        consts = dict(BLOCK_R=16, XA_SPLIT=1, S_P2=1, G=1, G_P2=1, SEG_BOUNDS=None)
    xa_, b_, slots_, ranks_, n_slots, n_lanes, stride_xap, stride_bs, stride_bn = lora_args
    splitk_reduce_kernel[(cdiv(T, block_m), cdiv(n_out, block_n), 1 + lanes)](
        ws, out, ws if bias is None else bias, xa_, b_, slots_, ranks_, T, n_out, n_slots, n_lanes, ws.stride(0),
        out.stride(0), stride_xap, stride_bs, stride_bn, HAS_BIAS=bias is not None, HAS_LORA=lora is not None,
        SPLIT_K=ws.shape[0], BM=block_m, BN=block_n, num_warps=num_warps, **consts, **pdl_args(pdl, ws))
