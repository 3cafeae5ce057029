"""The softmax router of Qwen2/3-MoE, Mixtral and OLMoE in one launch: softmax, top-k, renormalise.

Shape legend: T tokens, E experts (<= 1024), K top-k (<= E).
  softmax_topk(logits [T, E] fp16/bf16/fp32, K, renormalize)
      -> (topk_weights [T, K] fp32, topk_ids [T, K] int32)
Numerics are `softmax_topk_ref`'s; on equal probabilities (frequent with bf16 logits) the lowest expert id
wins, as torch.topk on CUDA keeps; the order inside the top k may differ from torch's (the same pairs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moelora.kernels.checks import cdiv, check_rows, need, next_pow2, output
from moelora.kernels.pdl import pdl_args, pdl_wait

_MAX_EXPERTS = 1024


@triton.jit
def softmax_topk_rows(logits, row_ok, mask, cols, K: tl.constexpr, RENORMALIZE: tl.constexpr,
                      BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """logits [BLOCK_T, BLOCK_E] fp32 (masked entries -inf) -> (weights [BLOCK_T, BLOCK_K] fp32, ids int32)."""
    top = tl.max(logits, axis=1)
    top = tl.where(row_ok, top, 0.0)  # padding rows: no -inf - -inf ...
    p = tl.where(mask, tl.exp(logits - top[:, None]), 0.0)
    p = p / tl.where(row_ok, tl.sum(p, axis=1), 1.0)[:, None]  # ... and no 0 / 0
    cand = tl.where(mask, p, -1.0)  # probabilities are >= 0: -1 is never picked before a real expert
    ks = tl.arange(0, BLOCK_K)
    weights = tl.zeros((logits.shape[0], BLOCK_K), tl.float32)
    ids = tl.zeros((logits.shape[0], BLOCK_K), tl.int32)
    for i in tl.static_range(K):
        best = tl.max(cand, axis=1)
        pick = tl.min(tl.where(cand == best[:, None], cols[None, :], BLOCK_E), axis=1)  # lowest id on ties
        weights = tl.where(ks[None, :] == i, best[:, None], weights)
        ids = tl.where(ks[None, :] == i, pick[:, None], ids)
        cand = tl.where(cols[None, :] == pick[:, None], -1.0, cand)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=1)[:, None]
    return weights, ids


@triton.jit
def _softmax_topk_kernel(logits_ptr, w_ptr, ids_ptr, T, E, stride_l, stride_w, stride_i,
                         K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr,
                         BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < T
    mask = row_ok[:, None] & (cols < E)[None, :]
    rows64 = rows.to(tl.int64)
    logits = tl.load(logits_ptr + rows64[:, None] * stride_l + cols[None, :], mask=mask,
                     other=float("-inf")).to(tl.float32)
    weights, ids = softmax_topk_rows(logits, row_ok, mask, cols, K, RENORMALIZE, BLOCK_E, BLOCK_K)
    ks = tl.arange(0, BLOCK_K)
    out_mask = row_ok[:, None] & (ks < K)[None, :]
    tl.store(w_ptr + rows64[:, None] * stride_w + ks[None, :], weights, mask=out_mask)
    tl.store(ids_ptr + rows64[:, None] * stride_i + ks[None, :], ids, mask=out_mask)


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool, *,
                 out: tuple[torch.Tensor, torch.Tensor] | None = None, pdl: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights [T, K] fp32, topk_ids [T, K] int32) of logits [T, E]; `out`: the caller's buffers; `pdl`:
    programmatic dependent launch where the GPU has it."""
    need(logits.dim() == 2, lambda: f"logits must be [T, E], got {tuple(logits.shape)}")
    check_rows("logits", logits)
    T, E = logits.shape
    need(0 < E <= _MAX_EXPERTS, f"the kernel takes 1..{_MAX_EXPERTS} experts, got E={E}")
    need(0 < top_k <= E, f"top_k must be in [1, E={E}], got {top_k}")
    w_buf, i_buf = out if out is not None else (None, None)
    weights = output(w_buf, (T, top_k), torch.float32, logits.device, (logits,), "out[0]")
    ids = output(i_buf, (T, top_k), torch.int32, logits.device, (logits, weights), "out[1]")
    if T == 0:
        return weights, ids
    block_e = next_pow2(E)
    block_t = max(1, min(16, 2048 // block_e))
    _softmax_topk_kernel[(cdiv(T, block_t),)](
        logits, weights, ids, T, E, logits.stride(0), weights.stride(0), ids.stride(0), K=top_k,
        RENORMALIZE=bool(renormalize), BLOCK_T=block_t, BLOCK_E=block_e,
        BLOCK_K=next_pow2(top_k), num_warps=4 if block_t * block_e >= 1024 else 1, **pdl_args(pdl, logits))
    return weights, ids
