"""Triton kernels of the routed-expert GEMMs over a `MoERoutingPlan`, with the routed LoRA's epilogues.

Shape legend: `moe_lora.base`'s.
  x [T, H], w_gate_up [E, 2I, H] -> h [P, I] (plan row order); h, w_down [E, H, I] -> y [T*K, H] (route order)
Program (pid_m, pid_n): plan block pid_m (one expert) x BN columns; LoRA runs in this layout (contract 3),
its epilogues switched on by the paths' flags (HAS_LORA, STACKED, LORA_DELTA, RAW_OUT, SPREAD, HAS_DELTA).
"""

from __future__ import annotations

import triton
import triton.language as tl

from moelora.kernels.fp8_moe import fp8_down_steps, fp8_gate_up_steps
from moelora.kernels.moe_lora.separate import separate_epilogue
from moelora.kernels.moe_lora.spread import spread_shrink
from moelora.kernels.moe_lora.stacked import stacked_epilogue
from moelora.kernels.moe_rows import delta_rows, plan_rows
from moelora.kernels.pdl import pdl_wait


@triton.jit
def _tile_ids(num_blocks, num_n, GROUP_M: tl.constexpr):
    """Grouped order: GROUP_M consecutive blocks (often one expert) share each weight tile in L2."""
    pid = tl.program_id(0)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    size = tl.minimum(num_blocks - first_m, GROUP_M)
    return first_m + (pid % width) % size, (pid % width) // size


@triton.jit(do_not_specialize=["num_blocks"])  # not a function of T's class: warmup.py
def gate_up_kernel(
    x_ptr, w, h_ptr, sorted_ids_ptr, eob_ptr, num_padded_ptr,
    slots_ptr, ranks_ptr, a_ptr, b_ptr, xa_ptr, delta_ptr,
    n_routes, top_k, H, inter, num_blocks,
    stride_xt, stride_we, stride_wn, stride_hp, stride_dr,
    stride_as, stride_ae, stride_ar, stride_bs, stride_be, stride_bn, stride_xa, n_slots,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    HAS_LORA: tl.constexpr, XA_SPLIT: tl.constexpr, BLOCK_R: tl.constexpr,
    LORA_BK: tl.constexpr, LORA_RC: tl.constexpr, USE_TMA: tl.constexpr, LORA_DELTA: tl.constexpr,
    RAW_OUT: tl.constexpr, PDL: tl.constexpr, STACKED: tl.constexpr = False, S_P2: tl.constexpr = 1,
    SPREAD: tl.constexpr = False, spread_k=0, h_act_ptr=None, stride_act=0,
    ws_ptr=None, stride_wse=0, stride_wsn=0, stride_wsk=0, ws_gate_rows=0, aq_ptr=None, aqs_ptr=None, stride_aq=0,
    stride_aqs=0, B_FP8: tl.constexpr = False, A_FP8: tl.constexpr = False, SCALE_GN: tl.constexpr = 128,
):
    """h[plan row] = silu(gate) * up of x[token] @ W_gu[e]^T (+ LoRA); RAW_OUT: gate and up unactivated into h
    [P, 2I] for a kernel after it; SPREAD: also the gate_up shrink of this tile's x columns into xa[n], rows
    with no gate_up delta activated here into h_act (bit for bit the no-LoRA value)."""
    pdl_wait(PDL)
    pid_m, pid_n = _tile_ids(num_blocks, tl.cdiv(inter, BN), GROUP_M)
    if pid_m * BM >= tl.load(num_padded_ptr):
        return
    e = tl.load(eob_ptr + pid_m).to(tl.int64)
    offs_m, route, valid, tok = plan_rows(sorted_ids_ptr, pid_m, n_routes, top_k, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    x_rows = x_ptr + tok[:, None].to(tl.int64) * stride_xt
    acc_g = tl.zeros((BM, BN), tl.float32)
    acc_u = tl.zeros((BM, BN), tl.float32)
    if HAS_LORA:
        slot = tl.load(slots_ptr + tok, mask=valid, other=-1)
    if B_FP8:  # e4m3 weights with their scales (fp8_moe): W8A8 or W8A16 K steps, the same epilogues
        tok64 = tok.to(tl.int64)
        acc_g, acc_u = fp8_gate_up_steps(x_ptr + tok64 * stride_xt, aq_ptr + tok64 * stride_aq,
                                         aqs_ptr + tok64 * stride_aqs, valid, w + e * stride_we,
                                         ws_ptr + e * stride_wse, offs_n, H, inter, stride_wn, stride_wsn, stride_wsk,
                                         ws_gate_rows, BM, BN, BK, SCALE_GN, A_FP8)
    else:
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
    if SPREAD:
        k_start = pid_n * spread_k
        if k_start < H:
            spread_shrink(x_ptr, tok, stride_xt, tl.load(slots_ptr + tok, mask=valid, other=-1), valid, ranks_ptr,
                           a_ptr, e, xa_ptr, offs_m, pid_n, k_start, tl.minimum(k_start + spread_k, H),
                           num_blocks * BM * BLOCK_R, stride_as, stride_ae, stride_ar, BM, BLOCK_R, LORA_BK)
    if HAS_LORA:
        acc_g, acc_u = separate_epilogue(acc_g, acc_u, x_ptr, slot, e, offs_m, ranks_ptr, b_ptr, xa_ptr, offs_n,
                                          inter, stride_bs, stride_be, stride_bn, num_blocks, BM, BLOCK_R,
                                          XA_SPLIT, LORA_RC, True)
    if STACKED:  # "stacked": xa_stacked @ B_stacked[e] as more K steps, one slot's lane of BLOCK_R columns each
        acc_g, acc_u = stacked_epilogue(acc_g, acc_u, slots_ptr, ranks_ptr, tok, valid, offs_m, e, xa_ptr, stride_xa,
                                         b_ptr, offs_n, inter, stride_bs, stride_be, stride_bn, n_slots, BLOCK_R, S_P2,
                                         True)
    if LORA_DELTA:  # "route": the delta of each route was computed before this kernel
        d_rows = delta_ptr + route[:, None].to(tl.int64) * stride_dr + offs_n[None, :]
        live = delta_rows(slots_ptr, ranks_ptr, tok, valid)[:, None] & (offs_n[None, :] < inter)
        acc_g += tl.load(d_rows, mask=live, other=0.0).to(tl.float32)
        acc_u += tl.load(d_rows + inter, mask=live, other=0.0).to(tl.float32)
    h_rows = h_ptr + offs_m[:, None].to(tl.int64) * stride_hp + offs_n[None, :]
    h_mask = valid[:, None] & (offs_n[None, :] < inter)
    if SPREAD:
        live = delta_rows(slots_ptr, ranks_ptr, tok, valid)[:, None]
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


@triton.jit(do_not_specialize=["num_blocks"])  # not a function of T's class: warmup.py
def down_kernel(
    h, h_ptr, w, y_ptr, topk_w_ptr, sorted_ids_ptr, eob_ptr, num_padded_ptr,
    slots_ptr, ranks_ptr, a_ptr, b_ptr, xa_ptr,
    n_routes, top_k, H, inter, num_blocks,
    stride_hp, stride_we, stride_wn, stride_yr,
    stride_as, stride_ae, stride_ar, stride_bs, stride_be, stride_bn, stride_xa, n_slots,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    HAS_LORA: tl.constexpr, XA_SPLIT: tl.constexpr, BLOCK_R: tl.constexpr,
    LORA_BK: tl.constexpr, LORA_RC: tl.constexpr, USE_TMA: tl.constexpr, PDL: tl.constexpr,
    STACKED: tl.constexpr = False, S_P2: tl.constexpr = 1,
    ws_ptr=None, stride_wse=0, stride_wsn=0, stride_wsk=0, ws_gate_rows=0, aq_ptr=None, aqs_ptr=None, stride_aq=0,
    stride_aqs=0, B_FP8: tl.constexpr = False, A_FP8: tl.constexpr = False, SCALE_GN: tl.constexpr = 128,
):
    pdl_wait(PDL)
    pid_m, pid_n = _tile_ids(num_blocks, tl.cdiv(H, BN), GROUP_M)
    if pid_m * BM >= tl.load(num_padded_ptr):
        return
    e = tl.load(eob_ptr + pid_m).to(tl.int64)
    offs_m, route, valid, tok = plan_rows(sorted_ids_ptr, pid_m, n_routes, top_k, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), tl.float32)
    if HAS_LORA:
        slot = tl.load(slots_ptr + tok, mask=valid, other=-1)
    if B_FP8:  # as in gate_up_kernel
        m64 = offs_m.to(tl.int64)
        acc = fp8_down_steps(h + m64 * stride_hp, aq_ptr + m64 * stride_aq, aqs_ptr + m64 * stride_aqs, valid,
                             w + e * stride_we, ws_ptr + e * stride_wse, offs_n, H, inter, stride_wn, stride_wsn,
                             stride_wsk, BM, BN, BK, SCALE_GN, A_FP8)
    else:
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
    if HAS_LORA:
        acc, _ = separate_epilogue(acc, acc, h_ptr, slot, e, offs_m, ranks_ptr, b_ptr, xa_ptr, offs_n, H,
                                    stride_bs, stride_be, stride_bn, num_blocks, BM, BLOCK_R, XA_SPLIT, LORA_RC, False)
    if STACKED:  # "stacked", as in gate_up_kernel
        acc, _ = stacked_epilogue(acc, acc, slots_ptr, ranks_ptr, tok, valid, offs_m, e, xa_ptr, stride_xa, b_ptr,
                                   offs_n, H, stride_bs, stride_be, stride_bn, n_slots, BLOCK_R, S_P2, False)
    wt_route = tl.load(topk_w_ptr + route, mask=valid, other=0.0).to(tl.float32)
    acc = acc * wt_route[:, None]
    tl.store(y_ptr + route[:, None].to(tl.int64) * stride_yr + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < H))


@triton.jit
def combine_kernel(y_ptr, out_ptr, topk_w_ptr, ids_ptr, delta_ptr, slots_ptr, ranks_ptr, T, H, stride_yr, stride_ot,
                   stride_dr, TOP_K: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr, HAS_DELTA: tl.constexpr,
                   HAS_MAP: tl.constexpr, PDL: tl.constexpr):
    """out[t] = sum_k y[t*K + k] in fp32, fixed k order; HAS_DELTA: + each route's down delta x its weight;
    HAS_MAP: ids [T*K] are local expert ids, a route at -1 (another rank's: no y row) is skipped."""
    pdl_wait(PDL)
    offs_t = tl.program_id(0) * BT + tl.arange(0, BT)
    offs_h = tl.program_id(1) * BH + tl.arange(0, BH)
    t_ok = offs_t < T
    mask = t_ok[:, None] & (offs_h[None, :] < H)
    acc = tl.zeros((BT, BH), tl.float32)
    if HAS_DELTA:
        live = delta_rows(slots_ptr, ranks_ptr, offs_t, t_ok)[:, None] & mask
    for k in tl.static_range(TOP_K):
        rows = (offs_t * TOP_K + k).to(tl.int64)
        here = mask
        if HAS_MAP:
            here = mask & (tl.load(ids_ptr + rows, mask=t_ok, other=-1) >= 0)[:, None]
        acc += tl.load(y_ptr + rows[:, None] * stride_yr + offs_h[None, :], mask=here, other=0.0).to(tl.float32)
        if HAS_DELTA:
            w = tl.load(topk_w_ptr + rows, mask=t_ok, other=0.0).to(tl.float32)
            d = tl.load(delta_ptr + rows[:, None] * stride_dr + offs_h[None, :], mask=live & here, other=0.0)
            acc += w[:, None] * d.to(tl.float32)
    tl.store(out_ptr + offs_t[:, None].to(tl.int64) * stride_ot + offs_h[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask)
