"""Routed-expert LoRA path "spread": no LoRA launch; the shrinks ride in the programs of the kernel before the expand.

Shape legend: `base`'s.
  gate_up GEMM tile n: x columns [n k, (n + 1) k) @ A_gu^T -> xa_gu [parts, P, BLOCK_R] fp32, gate / up raw
  act_spread_kernel: sum, expand, SiLU * up, its h columns @ A_d^T -> xa_d partials; down epilogue expands
Why: at one token each (slot, expert) pair is read once, with no side stream (docs/performance.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import triton
import triton.language as tl

from moelora.kernels.checks import cdiv, need_pow2, next_pow2
from moelora.kernels.lora_tiles import lora_a_tile, lora_shrink_rows
from moelora.kernels.moe_lora.base import LORA_RC, MoELoRAPath
from moelora.kernels.moe_lora.separate import separate_epilogue
from moelora.kernels.moe_rows import delta_rows, plan_rows, slot_base
from moelora.kernels.pdl import pdl_args, pdl_wait


@dataclass(frozen=True)
class SpreadConfig:
    """block_k: the rounding of each gate_up program's shrink share; block_n: act_spread_kernel's columns."""

    path: ClassVar[str] = "spread"
    block_k: int = 128
    block_n: int = 64

    def __post_init__(self):
        need_pow2("SpreadConfig", block_k=self.block_k, block_n=self.block_n)


class Spread(MoELoRAPath):
    name = "spread"
    config = SpreadConfig

    @classmethod
    def trials(cls, block_m: int) -> list:
        return [SpreadConfig(), SpreadConfig(block_k=256, block_n=128)]

    def __init__(self, call, cfg: SpreadConfig):
        super().__init__(call, cfg)
        H, inter = call.x.shape[1], call.inter
        n_tiles = cdiv(inter, call.gate_up_bn)
        self.gu_k = cdiv(cdiv(H, n_tiles), cfg.block_k) * cfg.block_k  # x columns a gate_up program
        self.gu_parts = cdiv(H, self.gu_k)
        self.d_n = min(cfg.block_n, next_pow2(inter))  # h columns an act_spread_kernel program
        self.d_parts = cdiv(inter, self.d_n)
        # the gate_up shrink's partials, then the down shrink's
        self.xa = torch.empty(self.gu_parts + self.d_parts, call.rows, call.block_r, dtype=torch.float32,
                              device=call.x.device)

    def gate_up_out(self, h: torch.Tensor) -> torch.Tensor:
        return torch.empty(h.shape[0], 2 * self.call.inter, dtype=h.dtype, device=h.device)

    def gate_up_args(self) -> dict:
        return {**super().gate_up_args(), "RAW_OUT": True, "SPREAD": True, "spread_k": self.gu_k, "xa_ptr": self.xa,
                "stride_xa": self.xa.stride(0), "LORA_BK": self.cfg.block_k}

    def after_gate_up(self, gu_out: torch.Tensor, h: torch.Tensor) -> None:
        call, plan, lora = self.call, self.call.plan, self.call.lora
        gb, da = lora.gate_up_b, lora.down_a
        act_spread_kernel[(plan.max_blocks, self.d_parts)](
            gu_out, h, plan.sorted_route_ids, plan.expert_of_block, plan.num_padded, lora.token_slots,
            lora.gate_up_ranks, gb, self.xa, lora.down_ranks, da, self.xa[self.gu_parts:], plan.num_routes,
            plan.top_k, call.inter, plan.max_blocks, gu_out.stride(0), h.stride(0), gb.stride(0), gb.stride(1),
            gb.stride(2), da.stride(0), da.stride(1), da.stride(2), BM=plan.block_m, BN=self.d_n,
            BLOCK_R=call.block_r, GU_SPLIT=self.gu_parts, LORA_RC=LORA_RC, num_warps=4, **pdl_args(call.pdl, gu_out))

    def down_args(self) -> dict:
        return {**super().down_args(), "xa_ptr": self.xa[self.gu_parts:], "XA_SPLIT": self.d_parts, "HAS_LORA": True,
                "stride_xa": self.xa.stride(0), "LORA_BK": self.cfg.block_k}


@triton.jit
def spread_shrink(src_ptr, src_rows, stride_src, slot, valid, ranks_ptr, a_ptr, e, xa_ptr, offs_m, part, k_start,
                  k_end, part_stride, stride_as, stride_ae, stride_ar, BM: tl.constexpr, BLOCK_R: tl.constexpr,
                  LORA_BK: tl.constexpr):
    """"spread": xa[part, rows] = src[rows, k_start:k_end] @ A[slot, e][:rank, k_start:k_end]^T, a dot per slot."""
    xa = tl.zeros((BM, BLOCK_R), tl.float32)
    s = tl.max(slot, axis=0)
    while s >= 0:
        sel = slot == s
        rank = tl.load(ranks_ptr + s)
        if rank > 0:
            xa += lora_shrink_rows(src_ptr, src_rows, stride_src, sel, slot_base(a_ptr, s, e, stride_as, stride_ae),
                                  stride_ar, rank, k_start, k_end, BM, BLOCK_R, LORA_BK)
        slot = tl.where(sel, -1, slot)
        s = tl.max(slot, axis=0)
    tl.store(xa_ptr + part * part_stride + offs_m[:, None].to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)[None, :], xa,
             mask=valid[:, None])


@triton.jit(do_not_specialize=["num_blocks"])  # not a function of T's class: warmup.py
def act_spread_kernel(gu_ptr, h_ptr, sorted_ids_ptr, eob_ptr, num_padded_ptr, slots_ptr, gu_ranks_ptr, gu_b_ptr,
                      xa_gu_ptr, d_ranks_ptr, d_a_ptr, xa_d_ptr, n_routes, top_k, inter, num_blocks, stride_gu,
                      stride_h, stride_gbs, stride_gbe, stride_gbn, stride_das, stride_dae, stride_dar,
                      BM: tl.constexpr, BN: tl.constexpr, BLOCK_R: tl.constexpr, GU_SPLIT: tl.constexpr,
                      LORA_RC: tl.constexpr, PDL: tl.constexpr):
    """"spread": h = silu(gate + delta_g) * (up + delta_u) for the rows with a gate_up delta (columns of
    program_id(1)), the delta expanded from xa_gu; then this tile's share of the down shrink into xa_d[n]."""
    pdl_wait(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BM >= tl.load(num_padded_ptr):
        return
    e = tl.load(eob_ptr + pid_m).to(tl.int64)
    offs_m, route, valid, tok = plan_rows(sorted_ids_ptr, pid_m, n_routes, top_k, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask = valid[:, None] & (offs_n[None, :] < inter)
    slot = tl.load(slots_ptr + tok, mask=valid, other=-1)
    live = delta_rows(slots_ptr, gu_ranks_ptr, tok, valid)[:, None]
    gu_rows = gu_ptr + offs_m[:, None].to(tl.int64) * stride_gu + offs_n[None, :]
    g = tl.load(gu_rows, mask=mask & live, other=0.0).to(tl.float32)
    u = tl.load(gu_rows + inter, mask=mask & live, other=0.0).to(tl.float32)
    g, u = separate_epilogue(g, u, gu_ptr, slot, e, offs_m, gu_ranks_ptr, gu_b_ptr, xa_gu_ptr, offs_n, inter,
                             stride_gbs, stride_gbe, stride_gbn, num_blocks, BM, BLOCK_R, GU_SPLIT, LORA_RC, True)
    h_rows = h_ptr + offs_m[:, None].to(tl.int64) * stride_h + offs_n[None, :]
    hv = (g / (1.0 + tl.exp(-g)) * u).to(h_ptr.dtype.element_ty)
    tl.store(h_rows, hv, mask=mask & live)
    hv = tl.where(live, hv, tl.load(h_rows, mask=mask & ~live, other=0.0))
    xa = tl.zeros((BM, BLOCK_R), tl.float32)
    s = tl.max(slot, axis=0)
    while s >= 0:  # the down shrink's share: the h tile just rounded, as the down GEMM reads it
        sel = slot == s
        rank = tl.load(d_ranks_ptr + s)
        if rank > 0:
            at = lora_a_tile(slot_base(d_a_ptr, s, e, stride_das, stride_dae), pid_n * BN, tl.arange(0, BN), inter,
                             stride_dar, rank, BLOCK_R)
            xa = tl.dot(tl.where(sel[:, None], hv, 0.0).to(hv.dtype), at.to(hv.dtype), xa)
        slot = tl.where(sel, -1, slot)
        s = tl.max(slot, axis=0)
    tl.store(xa_d_ptr + pid_n * (num_blocks * BM * BLOCK_R) + offs_m[:, None].to(tl.int64) * BLOCK_R
             + tl.arange(0, BLOCK_R)[None, :], xa, mask=valid[:, None])
