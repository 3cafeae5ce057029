"""The routers' top k on logits in one launch: softmax (Qwen2/3-MoE, Mixtral, OLMoE; DeepSeek-V2's "greedy" with
its scaling) or "noaux_tc" (DeepSeek-V3, GLM-4-MoE: sigmoid scores, selection on score + bias from the best groups).

Shape legend: T tokens, E experts (<= 1024), K top-k (<= E), G groups.
  softmax_topk(logits [T, E] fp16/bf16/fp32, K, renormalize, scaling=1.0, noaux=None)
      -> (topk_weights [T, K] fp32, topk_ids [T, K] int32)
Numerics are `softmax_topk_ref`'s (times `scaling`), with `noaux` `layers.router.grouped_topk`'s; on equal
probabilities (frequent with bf16 logits) the lowest expert id wins, as torch.topk on CUDA keeps; the order inside
the top k may differ from torch's (the same pairs). The selections are also the epilogue of decode's one-launch
router (`router_topk`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from moelora.kernels.checks import cdiv, check_rows, check_vector, need, next_pow2, output
from moelora.kernels.pdl import pdl_args, pdl_wait

_MAX_EXPERTS = 1024


class NoAux(NamedTuple):
    """DeepSeek-V3 / GLM-4-MoE's "noaux_tc" selection: the correction bias (fp32 [E], or None) and the groups."""
    bias: torch.Tensor | None
    n_group: int
    topk_group: int


def noaux_fits(num_experts: int, n_group: int) -> bool:
    """Whether the kernel's "noaux_tc" takes these groups: one group, or equal groups of a power-of-two size
    (>= 2: a group's score is its two best)."""
    size = num_experts // n_group
    return n_group == 1 or (num_experts % n_group == 0 and size >= 2 and next_pow2(size) == size)


def check_noaux(noaux: NoAux | None, E: int, top_k: int, device: torch.device) -> torch.Tensor | None:
    """`noaux`'s groups and bias for E experts and top_k (ValueError naming what is wrong) -> its bias."""
    if noaux is None:
        return None
    need(noaux_fits(E, noaux.n_group), lambda: f"noaux_tc groups must be one, or equal groups of a power-of-two "
         f"size >= 2: E={E}, n_group={noaux.n_group}")
    need(1 <= noaux.topk_group <= noaux.n_group and top_k <= noaux.topk_group * E // noaux.n_group,
         lambda: f"noaux_tc needs 1 <= topk_group <= n_group and top_k <= the kept groups' experts, got "
         f"topk_group={noaux.topk_group}, n_group={noaux.n_group}, top_k={top_k}, E={E}")
    bias = noaux.bias
    if bias is not None:
        check_vector("noaux.bias", bias, E, device)
        need(bias.dtype == torch.float32, lambda: f"noaux.bias must be fp32, got {bias.dtype}")
    return bias


def noaux_args(noaux: NoAux | None, E: int) -> dict:
    """The selection's launch constants (`noaux_rows`)."""
    return dict(NOAUX=noaux is not None, HAS_BIAS=noaux is not None and noaux.bias is not None,
                N_GROUP=noaux.n_group if noaux else 1, GROUP_SIZE=E // noaux.n_group if noaux else 1,
                TOPK_GROUP=noaux.topk_group if noaux else 1)


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
def noaux_rows(logits, bias_ptr, tile_ok, cols, col_ok, K: tl.constexpr, RENORMALIZE: tl.constexpr,
               BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
               N_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr, TOPK_GROUP: tl.constexpr):
    """logits [BLOCK_T, BLOCK_E] fp32 -> (weights, ids) [BLOCK_T, BLOCK_K] of "noaux_tc" (`layers.router.
    grouped_topk`); with N_GROUP > 1 the groups are GROUP_SIZE = E // N_GROUP contiguous columns (a power of two,
    checked by the launcher), the tile's columns past E whole groups of -inf, never kept before a real one."""
    scores = 1.0 / (1.0 + tl.exp(-logits))
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + cols, mask=col_ok, other=0.0)[None, :]
    choice = tl.where(tile_ok, choice, float("-inf"))
    if N_GROUP > 1:
        GS: tl.constexpr = GROUP_SIZE
        NG: tl.constexpr = BLOCK_E // GROUP_SIZE  # N_GROUP real groups, then padding
        c3 = tl.reshape(choice, (BLOCK_T, NG, GS))
        member = tl.arange(0, GS)[None, None, :]
        top1 = tl.max(c3, axis=2)
        first = tl.min(tl.where(c3 == top1[:, :, None], member, GS), axis=2)  # one copy of the best out ...
        top2 = tl.max(tl.where(member == first[:, :, None], float("-inf"), c3), axis=2)  # ... the second best
        group_score = top1 + top2
        g = tl.arange(0, NG)[None, :]
        keep = tl.zeros((BLOCK_T, NG), tl.int32)
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.max(group_score, axis=1)
            pick = tl.min(tl.where(group_score == best[:, None], g, NG), axis=1)
            keep = tl.where(g == pick[:, None], 1, keep)
            group_score = tl.where(g == pick[:, None], float("-inf"), group_score)
        kept = tl.reshape(tl.broadcast_to(keep[:, :, None], (BLOCK_T, NG, GS)), (BLOCK_T, BLOCK_E))
        choice = tl.where(kept != 0, choice, float("-inf"))
    ks = tl.arange(0, BLOCK_K)
    weights = tl.zeros((BLOCK_T, BLOCK_K), tl.float32)
    ids = tl.zeros((BLOCK_T, BLOCK_K), tl.int32)
    for i in tl.static_range(K):
        best = tl.max(choice, axis=1)
        pick = tl.min(tl.where(choice == best[:, None], cols[None, :], BLOCK_E), axis=1)  # lowest id on ties
        chosen = cols[None, :] == pick[:, None]
        weights = tl.where(ks[None, :] == i, tl.sum(tl.where(chosen, scores, 0.0), axis=1)[:, None], weights)
        ids = tl.where(ks[None, :] == i, pick[:, None], ids)
        choice = tl.where(chosen, float("-inf"), choice)
    if RENORMALIZE:
        weights = weights / (tl.sum(weights, axis=1)[:, None] + 1e-20)
    return weights, ids


@triton.jit
def _softmax_topk_kernel(logits_ptr, w_ptr, ids_ptr, bias_ptr, T, E, stride_l, stride_w, stride_i, scaling,
                         K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr,
                         BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, NOAUX: tl.constexpr, HAS_BIAS: tl.constexpr,
                         N_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr, TOPK_GROUP: tl.constexpr,
                         PDL: tl.constexpr):
    pdl_wait(PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < T
    col_ok = cols < E
    mask = row_ok[:, None] & col_ok[None, :]
    rows64 = rows.to(tl.int64)
    logits = tl.load(logits_ptr + rows64[:, None] * stride_l + cols[None, :], mask=mask,
                     other=float("-inf")).to(tl.float32)
    if NOAUX:
        weights, ids = noaux_rows(logits, bias_ptr, mask, cols, col_ok, K, RENORMALIZE, BLOCK_T, BLOCK_E, BLOCK_K,
                                  HAS_BIAS, N_GROUP, GROUP_SIZE, TOPK_GROUP)
    else:
        weights, ids = softmax_topk_rows(logits, row_ok, mask, cols, K, RENORMALIZE, BLOCK_E, BLOCK_K)
    weights = weights * scaling  # routed_scaling_factor (1.0: exact)
    ks = tl.arange(0, BLOCK_K)
    out_mask = row_ok[:, None] & (ks < K)[None, :]
    tl.store(w_ptr + rows64[:, None] * stride_w + ks[None, :], weights, mask=out_mask)
    tl.store(ids_ptr + rows64[:, None] * stride_i + ks[None, :], ids, mask=out_mask)


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool, *, scaling: float = 1.0,
                 noaux: NoAux | None = None, out: tuple[torch.Tensor, torch.Tensor] | None = None, pdl: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights [T, K] fp32 times `scaling`, topk_ids [T, K] int32) of logits [T, E]: softmax's, or with
    `noaux` "noaux_tc"'s (module docstring); `out`: the caller's buffers; `pdl`: programmatic dependent launch
    where the GPU has it."""
    need(logits.dim() == 2, lambda: f"logits must be [T, E], got {tuple(logits.shape)}")
    check_rows("logits", logits)
    T, E = logits.shape
    need(0 < E <= _MAX_EXPERTS, f"the kernel takes 1..{_MAX_EXPERTS} experts, got E={E}")
    need(0 < top_k <= E, f"top_k must be in [1, E={E}], got {top_k}")
    bias = check_noaux(noaux, E, top_k, logits.device)
    w_buf, i_buf = out if out is not None else (None, None)
    weights = output(w_buf, (T, top_k), torch.float32, logits.device, (logits,), "out[0]")
    ids = output(i_buf, (T, top_k), torch.int32, logits.device, (logits, weights), "out[1]")
    if T == 0:
        return weights, ids
    block_e = next_pow2(E)
    block_t = max(1, min(16, 2048 // block_e))
    _softmax_topk_kernel[(cdiv(T, block_t),)](
        logits, weights, ids, weights if bias is None else bias, T, E, logits.stride(0), weights.stride(0),
        ids.stride(0), float(scaling), K=top_k, RENORMALIZE=bool(renormalize), BLOCK_T=block_t, BLOCK_E=block_e,
        BLOCK_K=next_pow2(top_k), **noaux_args(noaux, E), num_warps=4 if block_t * block_e >= 1024 else 1,
        **pdl_args(pdl, logits))
    return weights, ids
