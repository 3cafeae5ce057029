"""Routed-expert LoRA path "route": each route's whole delta, shrink and expand as two GEMVs in one program.

Shape legend: `base`'s, and RC = 16 rank columns.
  lora_route_delta_kernel: delta[route] = (src row @ A^T) @ B^T, RC rank columns a pass (one pass at the pool's
  width for slots of rank > 32), one program per route (or plan row) and N split
Why: no dependence on the block's other rows, which at decode sit on as many slots.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import triton
import triton.language as tl

from moelora.kernels.checks import cdiv, need_one_of
from moelora.kernels.lora_tiles import lora_b_tile
from moelora.kernels.moe_lora.base import LORA_RC, site
from moelora.kernels.moe_lora.deltas import GATE_UP_DELTA_AT, DeltaPath
from moelora.kernels.pdl import pdl_args, pdl_wait

ROUTE_PROGRAMS = 264  # programs a delta launch aims for: two per H200 SM (docs/performance.md)
ROUTE_STEP = 4096 // LORA_RC  # [RC, 256] A / B loads, 4096 elements each (docs/performance.md)


@dataclass(frozen=True)
class RouteConfig:
    """warps a program; order: gate_up by "token" or "plan" (an expert's routes adjacent); gate_up_at: as Block."""

    path: ClassVar[str] = "route"
    warps: int = 4
    order: str = "token"
    gate_up_at: str = "epilogue"

    def __post_init__(self):
        need_one_of("RouteConfig", "warps", self.warps, (1, 2, 4, 8, 16))
        need_one_of("RouteConfig", "order", self.order, ("token", "plan"))
        need_one_of("RouteConfig", "gate_up_at", self.gate_up_at, GATE_UP_DELTA_AT)


class Route(DeltaPath):
    name = "route"
    config = RouteConfig
    wide_fp32 = True  # wide slots in rank chunks summed in the buffer
    # 8 warps; an expert's routes side by side; the gate_up delta beside its GEMM
    refinements = (dict(warps=8), dict(order="plan"), dict(gate_up_at="activation"))

    @classmethod
    def trials(cls, block_m: int) -> list:
        return [RouteConfig()]

    def delta(self, src, delta, which: str) -> None:
        """delta [T*K, N] of every route with LoRA (gate_up: N = 2I from x; down: N = H from h [P, I])."""
        call, cfg, plan, lora = self.call, self.cfg, self.call.plan, self.call.lora
        a, b, ranks = site(lora, which)
        by_row = which == "down" or cfg.order == "plan"
        n_out, k_dim = b.shape[2], a.shape[3]
        rows = plan.sorted_route_ids.shape[0] if by_row else plan.num_routes
        # enough programs to cover the SMs even at a few routes, each streaming whole B rows
        n_split = max(1, min(cdiv(n_out, ROUTE_STEP), cdiv(ROUTE_PROGRAMS, plan.num_routes)))
        per_split = cdiv(cdiv(n_out, n_split), ROUTE_STEP) * ROUTE_STEP
        lora_route_delta_kernel[(rows, cdiv(n_out, per_split))](
            src, delta, call.topk_ids, plan.sorted_route_ids, plan.expert_of_block, plan.num_padded, lora.token_slots,
            ranks, a, b, plan.num_routes, plan.top_k, k_dim, n_out, per_split, src.stride(0), delta.stride(0),
            a.stride(0), a.stride(1), a.stride(2), b.stride(0), b.stride(1), b.stride(2), BY_PLAN_ROW=by_row,
            SRC_BY_TOKEN=which == "gate_up", BM=plan.block_m, RC=LORA_RC, BK=ROUTE_STEP, BN=ROUTE_STEP,
            WIDE_RC=max(LORA_RC, call.block_r), WIDE_MIN=2 * LORA_RC, num_warps=cfg.warps, **pdl_args(call.pdl, src))


@triton.jit
def lora_route_delta_kernel(
    src_ptr, delta_ptr, ids_ptr, sorted_ids_ptr, eob_ptr, num_padded_ptr, slots_ptr, ranks_ptr, a_ptr, b_ptr,
    n_routes, top_k, k_dim, n_out, n_per_split, stride_src, stride_d,
    stride_as, stride_ae, stride_ar, stride_bs, stride_be, stride_bn,
    BY_PLAN_ROW: tl.constexpr, BM: tl.constexpr, RC: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr,
    WIDE_RC: tl.constexpr, WIDE_MIN: tl.constexpr, SRC_BY_TOKEN: tl.constexpr, PDL: tl.constexpr,
):
    """delta[route, n] for split program_id(1); BY_PLAN_ROW: program pid takes plan row pid (an expert's routes
    share their A/B in L2), else route pid."""
    pdl_wait(PDL)
    pid = tl.program_id(0)
    if BY_PLAN_ROW:
        if pid >= tl.load(num_padded_ptr):
            return
        route = tl.load(sorted_ids_ptr + pid)
        if route >= n_routes:
            return
        e = tl.load(eob_ptr + pid // BM).to(tl.int64)
        if SRC_BY_TOKEN:
            src = src_ptr + (route // top_k).to(tl.int64) * stride_src
        else:
            src = src_ptr + pid.to(tl.int64) * stride_src
    else:  # gate_up: route pid reads its token's row of x
        route = pid
        e = tl.load(ids_ptr + pid).to(tl.int64)
        if e < 0:  # another rank's route (an expert map): in no plan block, no delta
            return
        src = src_ptr + (pid // top_k).to(tl.int64) * stride_src
    s = tl.load(slots_ptr + route // top_k)
    if s < 0:
        return
    rank = tl.load(ranks_ptr + s)
    if rank == 0:
        return
    a_base = a_ptr + s.to(tl.int64) * stride_as + e * stride_ae
    b_base = b_ptr + s.to(tl.int64) * stride_bs + e * stride_be
    n_start = tl.program_id(1) * n_per_split
    n_end = tl.minimum(n_out, n_start + n_per_split)
    d_row = delta_ptr + route.to(tl.int64) * stride_d
    if WIDE_RC > RC:  # a pool wider than RC: slots of rank > WIDE_MIN take one wide pass (x and the
        if rank > WIDE_MIN:  # delta row touched once), the others RC columns at a time (cost ~ rank)
            _delta_pass(src, a_base, b_base, d_row, 0, rank, k_dim, n_start, n_end, stride_ar, stride_bn,
                        WIDE_RC, 4096 // WIDE_RC, 4096 // WIDE_RC)
            return
    for r0 in range(0, rank, RC):
        _delta_pass(src, a_base, b_base, d_row, r0, rank, k_dim, n_start, n_end, stride_ar, stride_bn, RC, BK, BN)


@triton.jit
def _delta_pass(src, a_base, b_base, d_row, r0, rank, k_dim, n_start, n_end, stride_ar, stride_bn,
                RC: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr):
    """Rank columns [r0, r0 + RC) of one route's delta: xa = src . A^T (src's dtype), d_row (+)= B . xa."""
    offs_r = r0 + tl.arange(0, RC)
    r_ok = offs_r < rank
    xa = tl.zeros((RC,), tl.float32)
    # num_stages=1: not software-pipelined (deeper pipelining was tried and removed: docs/performance.md)
    for k0 in tl.range(0, k_dim, BK, num_stages=1):
        offs_k = k0 + tl.arange(0, BK)
        k_ok = offs_k < k_dim
        xv = tl.load(src + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        a = tl.load(a_base + offs_r[:, None] * stride_ar + offs_k[None, :], mask=r_ok[:, None] & k_ok[None, :],
                    other=0.0)
        xa += tl.sum(a.to(tl.float32) * xv[None, :], axis=1)
    xa = xa.to(src.dtype.element_ty).to(tl.float32)
    for n0 in tl.range(n_start, n_end, BN, num_stages=1):
        offs_n = n0 + tl.arange(0, BN)
        n_ok = offs_n < n_end
        bt = lora_b_tile(b_base, offs_n, n_end, stride_bn, rank, r0, RC)  # [RC, BN]
        d = tl.sum(bt.to(tl.float32) * xa[:, None], axis=0)
        if r0 > 0:  # this program stored the earlier chunks' sum here
            d += tl.load(d_row + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(d_row + offs_n, d.to(d_row.dtype.element_ty), mask=n_ok)
