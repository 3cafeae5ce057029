"""Triton helpers shared by the routed-expert kernels. Shape legend: P plan rows, BM block_m, T*K routes, S slots, E."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def plan_rows(sorted_ids_ptr, pid_m, n_routes, top_k, BM: tl.constexpr):
    """Plan block pid_m: (its plan rows, their routes, valid: a route and not padding, their tokens)."""
    offs_m = pid_m * BM + tl.arange(0, BM)
    route = tl.load(sorted_ids_ptr + offs_m)
    valid = route < n_routes
    return offs_m, route, valid, route // top_k


@triton.jit
def slot_base(ptr, s, e, stride_s, stride_e):
    """Slot s's (>= 0, or -1 read as 0) matrix of expert e in a [S, E, ...] LoRA tensor."""
    return ptr + tl.maximum(s, 0).to(tl.int64) * stride_s + e * stride_e


@triton.jit
def delta_rows(slots_ptr, ranks_ptr, tok, valid):
    """Rows whose route has a LoRA delta: a slot, of rank > 0 at this site (as the delta kernels skip)."""
    slot = tl.load(slots_ptr + tok, mask=valid, other=-1)
    rank = tl.load(ranks_ptr + tl.maximum(slot, 0), mask=slot >= 0, other=0)
    return rank > 0
