"""Sparse MoE block: router, routed experts with their LoRA, optional shared expert(s).

Shape legend: T tokens, H hidden, I expert intermediate, E experts, K top-k, S adapter slots,
R max rank. Parameter names follow transformers 5 (`gate.weight`, `experts.gate_up_proj
[E, 2I, H]`, `experts.down_proj [E, H, I]`; Qwen2's gated `shared_expert.*` +
`shared_expert_gate.weight`, or DeepSeek/GLM's ungated `shared_experts.*`; DeepSeek/GLM's fp32
`gate.weight` and `gate.e_score_correction_bias`).
Expert LoRA slots: gate_up a [S, E, R, H] / b [S, E, 2I, R]; down a [S, E, R, I] / b [S, E, H, R];
site ranks [S] int32: `lora_gate_up_ranks`, `lora_down_ranks` (each projection's rank in the slot, 0
when the adapter has no LoRA there or the slot is empty), each read by its own projection's kernels:
an adapter with no LoRA on a projection costs that projection no LoRA work.
FP8 (`quant`, contract 10): `gate_up_proj` / `down_proj` are e4m3 with `gate_up_proj_scale_inv`
[E, 2 ceil(I/128), ceil(H/128)] (the gate and up halves blocked each on its own) and `down_proj_scale_inv`
[E, ceil(H/128), ceil(I/128)], or per row [E, 2I, 1] / [E, H, 1]; the Triton backend runs the FP8 expert
GEMMs on them (`kernels/fp8_moe.py`: W8A8 when the config quantizes activations, else W8A16), the torch twin
reads them dequantized (`moelora.quant.storage.dense_weight`); routing plan and LoRA as in bf16. The router, Qwen2's
`shared_expert_gate` and the fp32 `Router` are never quantized.
"""

from __future__ import annotations

import torch
from torch import nn

from moelora.kernels.args import ExpertLoRAArgs, FP8Rows
from moelora.kernels.reference import fused_moe_ref
from moelora.layers.linear import Linear
from moelora.layers.mlp import DenseMLP
from moelora.layers.norm import settle
from moelora.layers.options import DEFAULT_OPTIONS, LayerOptions
from moelora.layers.router import Router, RoutingSpec, kernel_selection, route
from moelora.lora.adapter import LoRAWeights
from moelora.lora.batch import LoRABatch
from moelora.quant.config import FP8Config
from moelora.quant.storage import activation_quantizer, dense_weight, fp8_parameters

# routing methods whose decode rows may take `router_topk` (one launch: the GEMM and the top k)
ONE_LAUNCH_METHODS = ("softmax", "greedy", "noaux_tc")


class Experts(nn.Module):
    """Routed experts (Triton: `fused_moe` with `options.fused_moe_table`). The LoRA batch's side stream, if
    any, runs the route / block down-projection LoRA delta concurrently with the down GEMM."""

    def __init__(self, num_experts: int, hidden: int, inter: int, *, max_loras: int, max_rank: int,
                 options: LayerOptions = DEFAULT_OPTIONS, dtype: torch.dtype | None = None,
                 quant: FP8Config | None = None):
        super().__init__()
        E, H, inner = num_experts, hidden, inter
        self.options, self.quant = options, quant
        self.route_rows: dict = {}  # fused_moe's per-route plan rows, per batch shape (plan_per_route)
        if quant is None:
            self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * inner, H, dtype=dtype))
            self.down_proj = nn.Parameter(torch.empty(E, H, inner, dtype=dtype))
        else:
            self.gate_up_proj, self.gate_up_proj_scale_inv = fp8_parameters(quant, (inner, inner), H, (E,))
            self.down_proj, self.down_proj_scale_inv = fp8_parameters(quant, (H,), inner, (E,))
        self.has_lora = max_loras > 0 and max_rank > 0
        if self.has_lora:
            S, R = max_loras, max_rank
            for name, shape in (("lora_gate_up_a", (S, E, R, H)), ("lora_gate_up_b", (S, E, 2 * inner, R)),
                                ("lora_down_a", (S, E, R, inner)), ("lora_down_b", (S, E, H, R))):
                self.register_buffer(name, torch.zeros(shape, dtype=dtype), persistent=False)
            for name in ("lora_gate_up_ranks", "lora_down_ranks"):
                self.register_buffer(name, torch.zeros(S, dtype=torch.int32), persistent=False)

    def set_lora_slot(self, slot: int, proj: str, weights: LoRAWeights | None) -> None:
        """proj: "gate_up" or "down"; weights a [E, r, in], b [E, out, r], or None to zero. Sets the
        projection's site rank (r or 0). Runs between steps, never in a graph."""
        a, b = getattr(self, f"lora_{proj}_a"), getattr(self, f"lora_{proj}_b")
        a[slot].zero_()
        b[slot].zero_()
        r = 0 if weights is None else weights.rank
        if r:
            a[slot, :, :r].copy_(weights.a, non_blocking=True)
            b[slot, :, :, :r].copy_(weights.b, non_blocking=True)
        getattr(self, f"lora_{proj}_ranks")[slot] = r

    def lora_args(self, lora: LoRABatch | None) -> ExpertLoRAArgs | None:
        if lora is None or not self.has_lora or lora.skips(self):
            return None
        return ExpertLoRAArgs(self.lora_gate_up_a, self.lora_gate_up_b, self.lora_down_a, self.lora_down_b,
                              lora.token_slots, self.lora_gate_up_ranks, self.lora_down_ranks, lora.active,
                              width=lora.max_rank)

    def fp8_weights(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """(weight, scale, row segments) of the FP8 expert parameters (`quant.storage.fp8_weight_sites`)."""
        inner, hidden = self.down_proj.shape[2], self.down_proj.shape[1]
        return [("gate_up_proj", "gate_up_proj_scale_inv", (inner, inner)),
                ("down_proj", "down_proj_scale_inv", (hidden,))]

    def dense_weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [E, 2I, H], down [E, H, I]) as the expert GEMMs read them: the parameters, or the FP8
        ones dequantized into transients (the FP8 fused-MoE kernels plug in here)."""
        if self.quant is None:
            return self.gate_up_proj, self.down_proj
        gate_up, down = (dense_weight(getattr(self, w), getattr(self, s), self.quant, segments, dtype)
                         for w, s, segments in self.fp8_weights())
        return gate_up, down

    def fp8_scales(self):
        """The FP8 expert kernels' scales and activation mode (`kernels.fp8_moe.FP8ExpertScales`), None in bf16."""
        if self.quant is None:
            return None
        from moelora.kernels.fp8_moe import FP8ExpertScales

        q = self.quant
        return FP8ExpertScales(self.gate_up_proj_scale_inv, self.down_proj_scale_inv, block=q.weights == "block",
                               quantize_activations=activation_quantizer(q) is not None)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                lora: LoRABatch | None, expert_map: torch.Tensor | None = None, x_fp8: FP8Rows | None = None
                ) -> torch.Tensor:
        """expert_map: expert parallelism's global -> local expert ids (`layers.parallel_experts`); x_fp8: x
        quantized for the W8A8 gate_up by the norm that wrote it (the Triton path reads it)."""
        args = self.lora_args(lora)
        if self.options.kernel_backend == "triton":
            from moelora.kernels.fused_moe import fused_moe

            return fused_moe(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids, lora=args,
                             side_stream=None if lora is None else lora.side_stream,
                             table=self.options.fused_moe_table, route_rows=self.route_rows, expert_map=expert_map,
                             fp8=self.fp8_scales(), x_fp8=x_fp8, pdl=self.options.pdl)
        w_gate_up, w_down = self.dense_weights(x.dtype)
        act_quant = activation_quantizer(self.quant)  # the W8A8 twin; None: the bf16 call as it always was
        extra = {k: v for k, v in (("act_quant", act_quant), ("expert_map", expert_map)) if v is not None}
        return fused_moe_ref(x, w_gate_up, w_down, topk_weights, topk_ids, lora=args, **extra)


class SparseMoE(nn.Module):
    """`options.overlap_shared_experts`: run the shared expert(s) on a second CUDA stream, concurrently with
    the routed experts (ignored on the CPU).

    `shared_inter`: Qwen2's sigmoid-gated `shared_expert`; `shared_experts_inter`: DeepSeek/GLM's
    ungated `shared_experts` (moe_intermediate_size * n_shared_experts). `routing` defaults to the
    softmax router of the first four families (`gate` in the model dtype); the other methods use the
    fp32 `Router`.
    """

    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int, renormalize: bool,
                 shared_inter: int = 0, *, routing: RoutingSpec | None = None, shared_experts_inter: int = 0,
                 correction_bias: bool = False, experts: Experts | None = None, **kw):
        super().__init__()
        self.routing = routing or RoutingSpec("softmax", top_k, renormalize)
        self.top_k, self.renormalize = top_k, renormalize
        self.options: LayerOptions = kw.get("options", DEFAULT_OPTIONS)  # the router's, and the overlap
        plain = dict(kw, quant=None)  # routers and Qwen2's shared-expert gate stay high precision
        if self.routing.fp32_router:
            self.gate = Router(hidden, num_experts, correction_bias=correction_bias, **plain)
        else:
            self.gate = Linear(hidden, num_experts, **plain)
        if self.routing.method in ONE_LAUNCH_METHODS:
            # `router_topk`'s split arrival counter (decode's one-launch router; a layer's calls never overlap)
            self.register_buffer("router_counter", torch.zeros(1, dtype=torch.int32), persistent=False)
        # `experts`: a rank's expert-parallel share (`layers.parallel_experts`); default all E experts
        self.experts = experts if experts is not None else Experts(num_experts, hidden, inter, **kw)
        self.shared_expert = DenseMLP(hidden, shared_inter, **kw) if shared_inter else None
        self.shared_expert_gate = Linear(hidden, 1, **plain) if shared_inter else None
        self.shared_experts = DenseMLP(hidden, shared_experts_inter, **kw) if shared_experts_inter else None
        self.has_shared = self.shared_expert is not None or self.shared_experts is not None

    def _shared(self, x: torch.Tensor, lora: LoRABatch | None, x_fp8: FP8Rows | None) -> torch.Tensor:
        if self.shared_experts is not None:
            return self.shared_experts(x, lora, x_fp8)
        return torch.sigmoid(self.shared_expert_gate(x, lora)) * self.shared_expert(x, lora, x_fp8)

    def _routed(self, x: torch.Tensor, lora: LoRABatch | None, x_fp8: FP8Rows | None) -> torch.Tensor:
        if self._one_launch_router(x, lora):  # decode: the router GEMM and its top k in one launch
            from moelora.kernels.router_topk import router_topk

            selection = kernel_selection(self.routing, getattr(self.gate, "e_score_correction_bias", None))
            weights, ids = router_topk(x, self.gate.weight, self.routing.top_k, **selection,
                                       counter=self.router_counter, pdl=self.options.pdl)
        else:
            bias = getattr(self.gate, "e_score_correction_bias", None)
            weights, ids = route(self.gate(x, lora), self.routing, bias, self.options.kernel_backend,
                                 self.options.pdl)
        return self.experts(x, weights, ids, lora, x_fp8=x_fp8)

    def _one_launch_router(self, x: torch.Tensor, lora: LoRABatch | None) -> bool:
        """The Triton backend's softmax, greedy (DeepSeek-V2) or noaux_tc (DeepSeek-V3, GLM-4-MoE; groups the
        kernel takes) router on decode rows, with no LoRA live on the router (`router_topk`)."""
        if (self.options.kernel_backend != "triton" or self.routing.method not in ONE_LAUNCH_METHODS
                or self.gate.bias is not None):
            return False
        from moelora.kernels.router_topk import router_topk_fits
        from moelora.kernels.softmax_topk import noaux_fits

        if self.routing.method == "noaux_tc" and not noaux_fits(self.gate.weight.shape[0], self.routing.n_group):
            return False
        return router_topk_fits(x, self.gate.weight) and self.gate.lora_args(lora) is None

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None, x_fp8: FP8Rows | None = None) -> torch.Tensor:
        """x_fp8: x quantized for the W8A8 experts and shared experts by the norm that wrote it."""
        return settle(self.forward_parts(x, lora, x_fp8))

    def forward_parts(self, x: torch.Tensor, lora: LoRABatch | None = None, x_fp8: FP8Rows | None = None):
        """`forward` before its last add: routed alone, or the pair (routed, shared), which the next norm adds
        into the residual in its launch (`RMSNorm.add_forward`; `settle` sums it for any other reader)."""
        if not self.has_shared:
            return self._routed(x, lora, x_fp8)
        if not (self.options.overlap_shared_experts and x.is_cuda):
            return self._routed(x, lora, x_fp8), self._shared(x, lora, x_fp8)
        # Fork. Side stream reads: x (and x_fp8), the LoRABatch tensors, shared-expert(s) weights and LoRA slots;
        # writes: only `shared` (new tensors it allocates). Main stream reads the same inputs and
        # writes only new tensors (router logits, routed output). Nothing read across the fork is
        # written before the join: x is the caller's, never written in place (contract 2).
        from moelora.kernels.side_stream import layer_streams

        main = torch.cuda.current_stream(x.device)
        side = layer_streams(x.device).shared_experts
        side.wait_stream(main)  # the fork point, before the routed launches
        # Routed first: captured in a graph, the router then follows the norm on its stream (with its programmatic
        # dependent launch), where the shared experts' first launch took both when enqueued first (H200 trace).
        routed = self._routed(x, lora, x_fp8)
        with torch.cuda.stream(side):
            shared = self._shared(x, lora, x_fp8)
        main.wait_stream(side)  # join: `shared` is complete before main reads it
        shared.record_stream(main)  # allocated on side, freed on main's timeline
        for t in (x,) if x_fp8 is None else (x, *x_fp8):
            t.record_stream(side)
        return routed, shared
