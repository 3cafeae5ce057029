"""What the "route" and "block" paths share: each route's whole delta, computed before the GEMM that adds it.

Shape legend: `base`'s.
  delta_gu [T*K, 2I], delta_d [T*K, H] (x's dtype; fp32 for "route" on pools wider than 16 columns)
The gate_up epilogue (or `act_delta_kernel`) adds delta_gu; the top-k combine adds delta_d times the routing
weight, so the down delta runs beside the down GEMM on the side stream (both read h only).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moelora.kernels.checks import cdiv, next_pow2
from moelora.kernels.moe_lora.base import LORA_RC, MoELoRAPath
from moelora.kernels.moe_rows import delta_rows, plan_rows
from moelora.kernels.pdl import pdl_args, pdl_wait
from moelora.kernels.side_stream import forked, join

GATE_UP_DELTA_AT = ("epilogue", "activation")


class DeltaPath(MoELoRAPath):
    """A path whose `delta(src, delta, which)` writes every route's delta of one projection."""

    wide_fp32 = False  # delta in fp32 for pools of BLOCK_R > 16 (chunks summed in the buffer)

    def __init__(self, call, cfg):
        super().__init__(call, cfg)
        x, n_routes = call.x, call.x.shape[0] * call.topk_ids.shape[1]
        d_dtype = torch.float32 if self.wide_fp32 and call.block_r > LORA_RC else x.dtype
        self.delta_gu = torch.empty(n_routes, 2 * call.inter, dtype=d_dtype, device=x.device)
        self.delta_d = torch.empty(n_routes, x.shape[1], dtype=d_dtype, device=x.device)
        self.late_gu = cfg.gate_up_at == "activation"

    def delta(self, src: torch.Tensor, delta: torch.Tensor, which: str) -> None:
        raise NotImplementedError

    def gate_up_out(self, h: torch.Tensor) -> torch.Tensor:
        if not self.late_gu:
            return h
        return torch.empty(h.shape[0], 2 * self.call.inter, dtype=h.dtype, device=h.device)

    def before_gate_up(self) -> None:
        # Fork when late_gu (contract 2): the side stream reads x, the plan, topk_ids and the LoRA slots and
        # writes only delta_gu; the GEMM here reads x and writes only its output. Both were allocated on this
        # stream before the fork and stay referenced past the join in after_gate_up.
        with forked(self.call.side_stream if self.late_gu else None, self.call.x.device):
            self.delta(self.call.x, self.delta_gu, "gate_up")

    def gate_up_args(self) -> dict:
        return {**super().gate_up_args(), **self._delta_args(None if self.late_gu else self.delta_gu),
                "RAW_OUT": self.late_gu}

    def after_gate_up(self, gu_out: torch.Tensor, h: torch.Tensor) -> None:
        if not self.late_gu:
            return
        call, plan, lora = self.call, self.call.plan, self.call.lora
        join(call.side_stream, call.x.device)  # delta_gu is complete
        bn = min(256, next_pow2(call.inter))
        act_delta_kernel[(plan.max_blocks, cdiv(call.inter, bn))](
            gu_out, self.delta_gu, h, plan.sorted_route_ids, plan.num_padded, lora.token_slots, lora.gate_up_ranks,
            plan.num_routes, plan.top_k, call.inter, gu_out.stride(0), self.delta_gu.stride(0), h.stride(0),
            BM=plan.block_m, BN=bn, num_warps=4, **pdl_args(call.pdl, gu_out))

    def before_down(self, h: torch.Tensor) -> None:
        # Fork (contract 2): the side stream reads h, the plan, topk_ids and the LoRA slots and writes only
        # delta_d; the down GEMM on this stream reads h and writes only y. delta_d, h and y were allocated on
        # this stream before the fork and stay referenced until after the join (before_combine), so no block
        # is reused while the side stream still touches it; delta_d is read after the join.
        with forked(self.call.side_stream, h.device):
            self.delta(h, self.delta_d, "down")

    def before_combine(self) -> None:
        join(self.call.side_stream, self.call.x.device)  # delta_d is complete

    def combine_args(self) -> dict:
        lora = self.call.lora
        return dict(delta_ptr=self.delta_d, slots_ptr=lora.token_slots, ranks_ptr=lora.down_ranks,
                    stride_dr=self.delta_d.stride(0), HAS_DELTA=True)


@triton.jit
def act_delta_kernel(gu_ptr, delta_ptr, h_ptr, sorted_ids_ptr, num_padded_ptr, slots_ptr, ranks_ptr, n_routes, top_k,
                     inter, stride_gu, stride_d, stride_h, BM: tl.constexpr, BN: tl.constexpr, PDL: tl.constexpr):
    """h[p] = silu(gate + delta_g) * (up + delta_u) for block program_id(0)'s plan rows, columns of program_id(1);
    rows on no gate_up rank get no delta; padding rows are left unwritten."""
    pdl_wait(PDL)
    pid_m = tl.program_id(0)
    if pid_m * BM >= tl.load(num_padded_ptr):
        return
    offs_m, route, valid, tok = plan_rows(sorted_ids_ptr, pid_m, n_routes, top_k, BM)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    mask = valid[:, None] & (offs_n[None, :] < inter)
    live = delta_rows(slots_ptr, ranks_ptr, tok, valid)[:, None] & mask
    gu_rows = gu_ptr + offs_m[:, None].to(tl.int64) * stride_gu + offs_n[None, :]
    d_rows = delta_ptr + route[:, None].to(tl.int64) * stride_d + offs_n[None, :]
    g = tl.load(gu_rows, mask=mask, other=0.0).to(tl.float32) + tl.load(d_rows, mask=live, other=0.0).to(tl.float32)
    u = (tl.load(gu_rows + inter, mask=mask, other=0.0).to(tl.float32)
         + tl.load(d_rows + inter, mask=live, other=0.0).to(tl.float32))
    hv = g / (1.0 + tl.exp(-g)) * u
    tl.store(h_ptr + offs_m[:, None].to(tl.int64) * stride_h + offs_n[None, :], hv.to(h_ptr.dtype.element_ty),
             mask=mask)
