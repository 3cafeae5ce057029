"""Sparse MoE block: router, routed experts with their LoRA, optional gated shared expert.

Shape legend: T tokens, H hidden, I expert intermediate, E experts, K top-k, S adapter slots,
R max rank. Parameter names follow transformers 5 (`gate.weight`, `experts.gate_up_proj
[E, 2I, H]`, `experts.down_proj [E, H, I]`, `shared_expert.*`, `shared_expert_gate.weight`).
Expert LoRA slots: gate_up a [S, E, R, H] / b [S, E, 2I, R]; down a [S, E, R, I] / b [S, E, H, R].
"""

from __future__ import annotations

import torch
from torch import nn

from moelora.kernels.reference import ExpertLoRAArgs, fused_moe_ref
from moelora.layers.linear import Linear
from moelora.layers.mlp import DenseMLP
from moelora.layers.router import softmax_topk
from moelora.lora.adapter import LoRAWeights
from moelora.lora.batch import LoRABatch


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, inter: int, *, max_loras: int, max_rank: int,
                 backend: str, dtype: torch.dtype | None = None):
        super().__init__()
        E, H, inner = num_experts, hidden, inter
        self.backend = backend
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * inner, H, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(E, H, inner, dtype=dtype))
        self.has_lora = max_loras > 0 and max_rank > 0
        if self.has_lora:
            S, R = max_loras, max_rank
            for name, shape in (("lora_gate_up_a", (S, E, R, H)), ("lora_gate_up_b", (S, E, 2 * inner, R)),
                                ("lora_down_a", (S, E, R, inner)), ("lora_down_b", (S, E, H, R))):
                self.register_buffer(name, torch.zeros(shape, dtype=dtype), persistent=False)

    def set_lora_slot(self, slot: int, proj: str, weights: LoRAWeights | None) -> None:
        """proj: "gate_up" or "down"; weights a [E, r, in], b [E, out, r], or None to zero."""
        a, b = getattr(self, f"lora_{proj}_a"), getattr(self, f"lora_{proj}_b")
        a[slot].zero_()
        b[slot].zero_()
        if weights is not None:
            r = weights.rank
            a[slot, :, :r].copy_(weights.a)
            b[slot, :, :, :r].copy_(weights.b)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                lora: LoRABatch | None) -> torch.Tensor:
        args = None
        if lora is not None and self.has_lora:
            args = ExpertLoRAArgs(self.lora_gate_up_a, self.lora_gate_up_b, self.lora_down_a,
                                  self.lora_down_b, lora.token_slots, lora.slot_ranks, lora.active)
        if self.backend == "triton":
            from moelora.kernels.fused_moe import fused_moe

            return fused_moe(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids, lora=args)
        return fused_moe_ref(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids, lora=args)


class SparseMoE(nn.Module):
    """`overlap_shared`: run the shared expert on a second CUDA stream, concurrently with the
    routed experts (set by the engine from its config; ignored on the CPU)."""

    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int, renormalize: bool,
                 shared_inter: int = 0, **kw):
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.overlap_shared = False
        self._side_stream: torch.cuda.Stream | None = None
        self.gate = Linear(hidden, num_experts, **kw)
        self.experts = Experts(num_experts, hidden, inter, **kw)
        self.shared_expert = DenseMLP(hidden, shared_inter, **kw) if shared_inter else None
        self.shared_expert_gate = Linear(hidden, 1, **kw) if shared_inter else None

    def _shared(self, x: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        return torch.sigmoid(self.shared_expert_gate(x, lora)) * self.shared_expert(x, lora)

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        if self.shared_expert is None:
            weights, ids = softmax_topk(self.gate(x, lora), self.top_k, self.renormalize)
            return self.experts(x, weights, ids, lora)
        if not (self.overlap_shared and x.is_cuda):
            weights, ids = softmax_topk(self.gate(x, lora), self.top_k, self.renormalize)
            return self.experts(x, weights, ids, lora) + self._shared(x, lora)
        # Fork. Side stream reads: x, the LoRABatch tensors, shared-expert weights and LoRA slots;
        # writes: only `shared` (new tensors it allocates). Main stream reads the same inputs and
        # writes only new tensors (router logits, routed output). Nothing read across the fork is
        # written before the join: x is the caller's, never written in place (contract 2).
        main = torch.cuda.current_stream(x.device)
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(x.device)
        side = self._side_stream
        side.wait_stream(main)
        with torch.cuda.stream(side):
            shared = self._shared(x, lora)
        weights, ids = softmax_topk(self.gate(x, lora), self.top_k, self.renormalize)
        routed = self.experts(x, weights, ids, lora)
        main.wait_stream(side)  # join: `shared` is complete before main reads it
        shared.record_stream(main)  # allocated on side, freed on main's timeline
        x.record_stream(side)
        return routed + shared
