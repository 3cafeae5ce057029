"""The softmax router of a decode step in one launch: the router GEMM split over H, then `softmax_topk`'s top k.

Shape legend: T tokens (<= MAX_ROWS), H hidden, E experts (<= MAX_EXPERTS), K top-k, S splits of H.
  router_topk(x [T, H] fp16/bf16, weight [E, H] x's dtype or fp32, K, renormalize, scaling=1.0)
      -> (topk_weights [T, K] fp32, topk_ids [T, K] int32)
An fp32 weight is DeepSeek's router (`layers.router.Router`: x upcast, logits in fp32): its dot runs as three TF32
MMAs ("tf32x3": x is exact in TF32, the weight two TF32 parts, 22 of its 24 bits; every product exact in fp32), an
fp32 dot up to 2^-22 of sum |x w| and the summation order. The "ieee" dot it replaced ran on the FMA units: 1024
fma a thread a step at DeepSeek-V2-Lite's tile, against 48 mma.sync here at 8 warps (sm_90 PTX, counted).
Selection: softmax then top k (Qwen / Mixtral / OLMoE, and DeepSeek-V2's
"greedy": renormalize False), or with `noaux=NoAux(bias, n_group, topk_group)` DeepSeek-V3's and GLM-4-MoE's
"noaux_tc" (`layers.router.grouped_topk`): sigmoid scores, experts chosen on score + bias from the topk_group
groups whose two best biased scores sum highest, weighted by their unbiased scores (renormalised plus 1e-20).
Either way the weights are then times `scaling` (routed_scaling_factor).
Why: at decode the router GEMM (0.5 MB at Qwen3-30B-A3B's shape) and the top-k are two latency-bound launches
(cuBLAS 5.2 + 4.0 us a layer at 8 requests on the H200). Here each of S programs takes a chunk of H for all E
columns; the last to arrive (on an arrival counter the caller owns) sums the fp32 partials in split order, rounds
the logits to the weight's dtype (as the unfused GEMM's output is) and picks the top k with `softmax_topk_rows`.
Numerics: `softmax_topk_ref` of x W^T in the weight's dtype, times `scaling`, up to the GEMM's summation order (as
cuBLAS's own order differs by batch size).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moelora.kernels.checks import cdiv, check_rows, need, next_pow2
from moelora.kernels.pdl import pdl_args, pdl_wait
from moelora.kernels.softmax_topk import NoAux, check_noaux, noaux_args, noaux_rows, softmax_topk_rows

MAX_ROWS = 16  # decode steps; more rows take the GEMM + `softmax_topk`
MAX_EXPERTS = 256
MAX_FP32_EXPERTS = 256  # an fp32 router's [FP32_BLOCK_H, E] weight tile: 64 KB a stage
BLOCK_H = 128


STEPS_PER_SPLIT = 2  # H steps a program (the H200 at Qwen3's shape: 8 programs of 2 x 32 KB)
# An fp32 router of up to 128 experts (DeepSeek-V2's 64 x 2048): tiles of 64 rows of H, one a program (32 programs
# of 16 KB). H100, the kernel alone in a graph of 50 (43rd session), us at 1 / 8 / 16 rows: 8.50 / 8.81 / 8.83 at
# 128-row tiles two a program (8 programs), 5.39 / 5.58 / 5.90 here; more experts (DeepSeek-V3's 256) keep 64-row
# tiles two a program (not measured against this).
FP32_BLOCK_H = 64


@triton.jit
def _router_topk_kernel(x_ptr, w_ptr, part_ptr, sem_ptr, wts_ptr, ids_ptr, bias_ptr, T, E, H, H_CHUNK, scaling,
                        stride_x, stride_w, stride_wts, stride_ids,
                        K: tl.constexpr, RENORMALIZE: tl.constexpr, SPLITS: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H_: tl.constexpr, BLOCK_K: tl.constexpr,
                        NOAUX: tl.constexpr, HAS_BIAS: tl.constexpr, N_GROUP: tl.constexpr,
                        GROUP_SIZE: tl.constexpr, TOPK_GROUP: tl.constexpr, PDL: tl.constexpr):
    """Program s: partial logits over H [s H_CHUNK, (s + 1) H_CHUNK) -> part [S, BLOCK_T, BLOCK_E]; the last of
    the S programs to arrive (sem, one counter) sums them in split order and writes the top k."""
    pdl_wait(PDL)
    split = tl.program_id(0)
    rows = tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    offs_h = tl.arange(0, BLOCK_H_)
    row_ok, col_ok = rows < T, cols < E
    h_lo = split * H_CHUNK
    h_hi = tl.minimum(H, h_lo + H_CHUNK)
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_x + offs_h[None, :]
    w_cols = w_ptr + cols[None, :].to(tl.int64) * stride_w + offs_h[:, None]  # [BLOCK_H, BLOCK_E]
    acc = tl.zeros((BLOCK_T, BLOCK_E), tl.float32)
    for h0 in range(h_lo, h_hi, BLOCK_H_):
        h_ok = (h0 + offs_h) < h_hi
        xt = tl.load(x_rows + h0, mask=row_ok[:, None] & h_ok[None, :], other=0.0)
        wt = tl.load(w_cols + h0, mask=col_ok[None, :] & h_ok[:, None], other=0.0)
        if w_ptr.dtype.element_ty == tl.float32:  # the fp32 router: x upcast, 3xTF32 (module docstring)
            acc = tl.dot(xt.to(tl.float32), wt, acc, input_precision="tf32x3")
        else:
            acc = tl.dot(xt, wt, acc)
    tile_ok = row_ok[:, None] & col_ok[None, :]
    if SPLITS == 1:
        _topk_out(acc, w_ptr, wts_ptr, ids_ptr, bias_ptr, rows, cols, row_ok, col_ok, tile_ok, stride_wts,
                  stride_ids, scaling, K, RENORMALIZE, BLOCK_T, BLOCK_E, BLOCK_K, NOAUX, HAS_BIAS, N_GROUP, GROUP_SIZE,
                  TOPK_GROUP)
    else:
        parts = part_ptr + rows[:, None] * BLOCK_E + cols[None, :]
        tl.store(parts + split * BLOCK_T * BLOCK_E, acc, mask=tile_ok)
        tl.debug_barrier()  # every thread's partial is written before the release below publishes them
        if tl.atomic_add(sem_ptr, 1, sem="acq_rel") == SPLITS - 1:
            acc = tl.zeros((BLOCK_T, BLOCK_E), tl.float32)
            for s in tl.static_range(SPLITS):  # in split order: the sum does not depend on who came last
                acc += tl.load(parts + s * BLOCK_T * BLOCK_E, mask=tile_ok, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(sem_ptr, 0)
            _topk_out(acc, w_ptr, wts_ptr, ids_ptr, bias_ptr, rows, cols, row_ok, col_ok, tile_ok, stride_wts,
                      stride_ids, scaling, K, RENORMALIZE, BLOCK_T, BLOCK_E, BLOCK_K, NOAUX, HAS_BIAS, N_GROUP,
                      GROUP_SIZE, TOPK_GROUP)


@triton.jit
def _topk_out(acc, w_ptr, wts_ptr, ids_ptr, bias_ptr, rows, cols, row_ok, col_ok, tile_ok, stride_wts, stride_ids,
              scaling, K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
              BLOCK_K: tl.constexpr, NOAUX: tl.constexpr, HAS_BIAS: tl.constexpr, N_GROUP: tl.constexpr,
              GROUP_SIZE: tl.constexpr, TOPK_GROUP: tl.constexpr):
    logits = tl.where(tile_ok, acc.to(w_ptr.dtype.element_ty).to(tl.float32), float("-inf"))  # the GEMM's dtype
    if NOAUX:
        weights, ids = noaux_rows(logits, bias_ptr, tile_ok, cols, col_ok, K, RENORMALIZE, BLOCK_T, BLOCK_E,
                                  BLOCK_K, HAS_BIAS, N_GROUP, GROUP_SIZE, TOPK_GROUP)
    else:
        weights, ids = softmax_topk_rows(logits, row_ok, tile_ok, cols, K, RENORMALIZE, BLOCK_E, BLOCK_K)
    weights = weights * scaling  # routed_scaling_factor (1.0: exact)
    ks = tl.arange(0, BLOCK_K)
    out_ok = row_ok[:, None] & (ks < K)[None, :]
    rows64 = rows.to(tl.int64)
    tl.store(wts_ptr + rows64[:, None] * stride_wts + ks[None, :], weights, mask=out_ok)
    tl.store(ids_ptr + rows64[:, None] * stride_ids + ks[None, :], ids, mask=out_ok)


def router_topk_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `router_topk` takes this step: decode rows of half-precision x, a router of at most MAX_EXPERTS in
    x's dtype or fp32."""
    return (x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.dtype in (torch.float16, torch.bfloat16)
            and weight.dtype in (x.dtype, torch.float32) and weight.dim() == 2 and weight.shape[1] == x.shape[1]
            and weight.shape[0] <= (MAX_EXPERTS if weight.dtype == x.dtype else MAX_FP32_EXPERTS)
            and weight.stride(1) == 1 and x.stride(1) == 1)


def router_topk(x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool, *, scaling: float = 1.0,
                noaux: NoAux | None = None, splits: int | None = None, counter: torch.Tensor | None = None,
                pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights [T, K] fp32, times `scaling`, topk_ids [T, K] int32) of softmax(x W^T), or of "noaux_tc"
    with `noaux` (module docstring); `splits`: of H (default: the FP32_BLOCK_H / STEPS_PER_SPLIT rule); `counter`:
    the split arrival counter the caller owns (int32 [>= 1], zero between calls, left zero; None: a zeroed one for this
    call); `pdl`: programmatic dependent launch where the GPU has it."""
    need(router_topk_fits(x, weight), lambda: f"router_topk takes x [T <= {MAX_ROWS}, H] fp16/bf16 and a router "
         f"weight [E <= {MAX_EXPERTS}, H] of x's dtype or [E <= {MAX_FP32_EXPERTS}, H] fp32, unit last strides; "
         f"got {tuple(x.shape)} {x.dtype}, {tuple(weight.shape)} {weight.dtype}")
    check_rows("x", x)
    T, H = x.shape
    E = weight.shape[0]
    need(0 < top_k <= E, f"top_k must be in [1, E={E}], got {top_k}")
    bias = check_noaux(noaux, E, top_k, x.device)
    weights = torch.empty(T, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(T, top_k, dtype=torch.int32, device=x.device)
    if T == 0:
        return weights, ids
    block_e = max(16, next_pow2(E))
    fp32 = weight.dtype == torch.float32
    block_h = FP32_BLOCK_H if fp32 else BLOCK_H
    steps = cdiv(H, block_h)
    splits = splits or cdiv(steps, 1 if fp32 and block_e <= 128 else STEPS_PER_SPLIT)
    chunk = cdiv(steps, splits) * block_h
    splits = cdiv(H, chunk)
    part, sem = weights, ids  # placeholders with one split
    if splits > 1:
        part = torch.empty(splits, MAX_ROWS, block_e, dtype=torch.float32, device=x.device)
        if counter is None:
            sem = torch.zeros(1, dtype=torch.int32, device=x.device)
        else:
            need(counter.dtype == torch.int32 and counter.numel() >= 1 and counter.device == x.device,
                 lambda: f"counter must be int32 [>= 1] on {x.device}, got {tuple(counter.shape)} {counter.dtype} "
                 f"on {counter.device}")
            sem = counter
    _router_topk_kernel[(splits,)](
        x, weight, part, sem, weights, ids, weights if bias is None else bias, T, E, H, chunk, float(scaling),
        x.stride(0), weight.stride(0), weights.stride(0), ids.stride(0), K=top_k, RENORMALIZE=bool(renormalize),
        SPLITS=splits, BLOCK_T=MAX_ROWS, BLOCK_E=block_e, BLOCK_H_=block_h, BLOCK_K=next_pow2(top_k),
        **noaux_args(noaux, E), num_warps=8 if weight.dtype == torch.float32 else 4,
        num_stages=2, **pdl_args(pdl, x))
    return weights, ids
