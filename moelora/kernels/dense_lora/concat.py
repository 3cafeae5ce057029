"""Dense LoRA mode "concat" (prefill rows): the delta as more K columns of the one cuBLAS GEMM.

Shape legend: `base`'s, U the step's slots with rows (`lora.slots`, n of them), L the lane width (BLOCK_R),
C = G n L lane columns; column N_in + (g n + c) L + r is rank row r of segment g of slot U[c]; K_ext = N_in + C
rounded up to K_MULTIPLE (zero columns past the lanes).
  x_ext [T, K_ext] = [x | xa]: row t's lanes of its own slot hold x[t] @ A_g,slot(t)[:rank]^T, others 0
  w_ext [N_out, K_ext] = [W | B]: output row j of segment g holds B_g,U[c][j, :rank] in lanes (g, c), others 0
  out = x_ext @ w_ext^T (+ bias): one GEMM, the delta summed in its fp32 accumulator (one rounding)
Why: at prefill rows "split" (expand_first) writes y = delta and cuBLAS reads it back (2 |y|, a launch); here the
extra traffic is one copy of x (written by the shrink, which reads x anyway) and of W. Calls it does not serve
(no `lora.slots`, more than 3 segments, K_ext - N_in above `CONCAT_MAX_COLS`) take
split's expand_first. Twin: `lora_linear_ref`.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from moelora.kernels.checks import cdiv, next_pow2
from moelora.kernels.dense_lora.base import Segments, base_gemm
from moelora.kernels.dense_lora.split import Split
from moelora.kernels.pdl import pdl_args, pdl_wait

# The shrink's one [BM, CW] accumulator: at most this many lane columns. At 256 (q/k/v, 4 slots) with 64-row blocks,
# 64-deep steps and 2-3 stages the lane columns came out wrong on the H200 (Triton 3.6; right with one stage,
# 32-deep steps or 32-row blocks): never launched until that is understood.
CONCAT_MAX_COLS = 128
K_MULTIPLE = 64  # the extended depth rounded up to this (zero columns past C): cuBLAS's tiles and row alignment
MAX_SEGMENTS = 3


def split_prefill_config(T: int, n_in: int, n_out: int, pdl: bool):
    """The config concat's fallback runs: split's own at T rows (one lane, expand first), not concat's tiles."""
    from moelora.kernels.lora_linear import default_lora_linear_config  # lora_linear imports this module

    return replace(default_lora_linear_config(T, "split", n_in=n_in, n_out=n_out, pdl=pdl), slot_lanes=1,
                   expand_first=True)


class Concat:
    name = "concat"

    @staticmethod
    def run(x, weight, bias, lora, out, cfg, side_stream=None) -> None:
        if lora is None:
            base_gemm(x, weight, bias, out)
            return
        seg, slots = Segments(lora), lora.slots
        T, n_in = x.shape
        n = None if slots is None else slots.shape[0]
        if n == 0:  # no row on an adapter with weights
            base_gemm(x, weight, bias, out)
            return
        C = 0 if n is None else seg.G * n * seg.block_r
        k_ext = cdiv(n_in + C, K_MULTIPLE) * K_MULTIPLE
        if n is None or seg.G > MAX_SEGMENTS or k_ext - n_in > CONCAT_MAX_COLS:
            Split.run(x, weight, bias, lora, out, split_prefill_config(T, n_in, out.shape[1], cfg.pdl))
            return
        n_out = out.shape[1]
        x_ext = torch.empty(T, k_ext, dtype=x.dtype, device=x.device)
        w_ext = torch.empty(n_out, k_ext, dtype=weight.dtype, device=x.device)
        bounds = seg.bounds or (0, n_out)
        b1, b2 = (tuple(bounds[1:-1]) + (n_out, n_out))[:2]
        S = lora.a.shape[0]
        pdl = pdl_args(cfg.pdl, x)
        cw = max(16, next_pow2(k_ext - n_in))
        _concat_shrink_kernel[(cdiv(T, cfg.block_m),)](
            x, x_ext, lora.a, lora.token_slots, lora.slot_ranks, slots, T, n_in, n, S, C, k_ext - n_in, seg.r_seg,
            x.stride(0), x_ext.stride(0), lora.a.stride(0), lora.a.stride(1), BM=cfg.block_m, BK=cfg.block_k,
            CW=cw, LANE=seg.block_r, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl)
        bn, bk = cfg.block_n, cfg.plan_cols
        _concat_weight_kernel[(cdiv(n_out, bn), cdiv(k_ext, bk))](
            weight, w_ext, lora.b, lora.slot_ranks, slots, n_out, n_in, n, S, C, k_ext, weight.stride(0),
            w_ext.stride(0), lora.b.stride(0), lora.b.stride(1), B1=b1, B2=b2, BN=bn, BK=bk, LANE=seg.block_r,
            num_warps=4, **pdl)
        base_gemm(x_ext, w_ext, bias, out)


@triton.jit
def _lanes(c, n_used, slots_ptr, ranks_ptr, n_slots, C, LANE: tl.constexpr):
    """Extra columns c (from 0): (segment, slot, rank row, the slot's rank at that segment; 0 past C)."""
    ok = c < C
    g = c // (n_used * LANE)
    ci = (c % (n_used * LANE)) // LANE
    slot = tl.load(slots_ptr + ci, mask=ok, other=0)
    rank = tl.load(ranks_ptr + g * n_slots + slot, mask=ok, other=0)
    return g, slot, c % LANE, rank


@triton.jit
def _concat_shrink_kernel(x_ptr, xe_ptr, a_ptr, tslots_ptr, ranks_ptr, slots_ptr, T, N_in, n_used, n_slots, C, C_PAD,
                          R_SEG,
                          stride_x, stride_xe, stride_as, stride_ar, BM: tl.constexpr, BK: tl.constexpr,
                          CW: tl.constexpr, LANE: tl.constexpr, PDL: tl.constexpr):
    """Rows [m BM, +BM): x_ext[:, :N_in] = x, x_ext[:, N_in:] = every lane's x @ A^T kept on the row's own slot."""
    pdl_wait(PDL)
    offs_t = tl.program_id(0) * BM + tl.arange(0, BM)
    t_ok = offs_t < T
    c = tl.arange(0, CW)
    g, slot, r, rank = _lanes(c, n_used, slots_ptr, ranks_ptr, n_slots, C, LANE)
    live = r < rank
    a_cols = a_ptr + slot.to(tl.int64) * stride_as + (g * R_SEG + r) * stride_ar
    x_rows = x_ptr + offs_t[:, None].to(tl.int64) * stride_x
    xe_rows = xe_ptr + offs_t[:, None].to(tl.int64) * stride_xe
    acc = tl.zeros((BM, CW), tl.float32)
    for k0 in range(0, N_in, BK):
        offs_k = k0 + tl.arange(0, BK)
        k_ok = offs_k < N_in
        xt = tl.load(x_rows + offs_k[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0)
        tl.store(xe_rows + offs_k[None, :], xt, mask=t_ok[:, None] & k_ok[None, :])
        at = tl.load(a_cols[None, :] + offs_k[:, None], mask=live[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(xt, at.to(xt.dtype), acc)
    own = tl.load(tslots_ptr + offs_t, mask=t_ok, other=-1)[:, None] == slot[None, :]
    xa = tl.where(own & live[None, :], acc, 0.0)
    tl.store(xe_rows + N_in + c[None, :], xa.to(xe_ptr.dtype.element_ty), mask=t_ok[:, None] & (c < C_PAD)[None, :])


@triton.jit
def _concat_weight_kernel(w_ptr, we_ptr, b_ptr, ranks_ptr, slots_ptr, N_out, N_in, n_used, n_slots, C, K_EXT,
                          stride_w, stride_we, stride_bs, stride_bn, B1: tl.constexpr, B2: tl.constexpr,
                          BN: tl.constexpr, BK: tl.constexpr, LANE: tl.constexpr, PDL: tl.constexpr):
    """w_ext[n tile, k tile]: W's columns, then each lane's B column on its segment's rows (0 elsewhere)."""
    pdl_wait(PDL)
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    offs_k = tl.program_id(1) * BK + tl.arange(0, BK)
    n_ok = offs_n < N_out
    in_w = offs_k < N_in
    tile = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_w + offs_k[None, :],
                   mask=n_ok[:, None] & in_w[None, :], other=0.0)
    if (tl.program_id(1) + 1) * BK > N_in:  # the tile holds lane columns
        c = offs_k - N_in
        g, slot, r, rank = _lanes(tl.maximum(c, 0), n_used, slots_ptr, ranks_ptr, n_slots, C, LANE)
        seg_n = tl.where(offs_n < B1, 0, tl.where(offs_n < B2, 1, 2))
        take = (c >= 0)[None, :] & (c < C)[None, :] & (seg_n[:, None] == g[None, :]) & (r < rank)[None, :]
        bt = tl.load(b_ptr + slot[None, :].to(tl.int64) * stride_bs + offs_n[:, None].to(tl.int64) * stride_bn
                     + r[None, :], mask=take & n_ok[:, None], other=0.0)
        tile = tl.where(in_w[None, :], tile, bt.to(tile.dtype))
    tl.store(we_ptr + offs_n[:, None].to(tl.int64) * stride_we + offs_k[None, :], tile,
             mask=n_ok[:, None] & (offs_k < K_EXT)[None, :])
