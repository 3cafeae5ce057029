"""Top-k routing: every family's scoring and expert selection, as transformers 5 computes it.

Shape legend: T tokens, E experts, K top-k, G groups. logits [T, E] -> (weights [T, K] fp32, ids [T, K]).

- "softmax" (Qwen2/3-MoE, Mixtral, OLMoE): softmax in fp32 over all experts, take the top k, and
  renormalise the k weights when `renormalize` (Mixtral always; Qwen/OLMoE per `norm_topk_prob`).
  Mixtral's "top-k of logits, then softmax of those k" is the same function.
- "greedy" (DeepSeek-V2): softmax, top k, weights * routed_scaling_factor (never renormalised).
- "group_limited_greedy" (DeepSeek-V2): as greedy, but only from the `topk_group` groups (of
  `n_group` contiguous experts) whose best expert scores highest; other experts' scores become 0.
- "noaux_tc" (DeepSeek-V3, GLM-4-MoE): sigmoid scores; selection on score + e_score_correction_bias,
  only from the `topk_group` groups with the highest sum of their two best biased scores (others
  -inf); weights are the unbiased scores of the chosen experts, renormalised (sum + 1e-20) when
  `renormalize`, then * routed_scaling_factor.
The DeepSeek/GLM router weight and bias are fp32 and the logits are computed in fp32 (`Router`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moelora.layers.derived import Derived
from moelora.layers.linear import Linear
from moelora.lora.batch import LoRABatch


@dataclass(frozen=True)
class RoutingSpec:
    method: str  # softmax | greedy | group_limited_greedy | noaux_tc
    top_k: int
    renormalize: bool
    n_group: int = 1
    topk_group: int = 1
    scaling: float = 1.0  # routed_scaling_factor

    @property
    def fp32_router(self) -> bool:
        return self.method != "softmax"


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _keep_groups(choice: torch.Tensor, group_scores: torch.Tensor, topk_group: int, fill: float) -> torch.Tensor:
    """choice [T, E] with every expert outside the `topk_group` best groups (group_scores [T, G]) set to fill."""
    T, G = group_scores.shape
    best = torch.topk(group_scores, topk_group, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, best, True)
    keep = keep[:, :, None].expand(T, G, choice.shape[1] // G).reshape(T, -1)
    return choice.masked_fill(~keep, fill)


def grouped_topk(logits: torch.Tensor, spec: RoutingSpec,
                 correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The DeepSeek / GLM routers (see module docstring). logits [T, E] fp32."""
    T, E = logits.shape
    logits = logits.float()
    if spec.method in ("greedy", "group_limited_greedy"):
        scores = logits.softmax(dim=-1)
        if spec.method == "group_limited_greedy":
            group_best = scores.view(T, spec.n_group, E // spec.n_group).amax(dim=-1)
            scores = _keep_groups(scores, group_best, spec.topk_group, 0.0)
        weights, ids = torch.topk(scores, spec.top_k, dim=-1)
        return weights * spec.scaling, ids
    assert spec.method == "noaux_tc", spec.method
    scores = logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    group_top2 = choice.view(T, spec.n_group, E // spec.n_group).topk(2, dim=-1).values.sum(dim=-1)
    choice = _keep_groups(choice, group_top2, spec.topk_group, float("-inf"))
    ids = torch.topk(choice, spec.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if spec.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * spec.scaling, ids


def kernel_selection(spec: RoutingSpec, correction_bias: torch.Tensor | None) -> dict:
    """The Triton top k's selection arguments of a softmax, greedy or noaux_tc `spec` (`kernels.softmax_topk`, and
    decode's `router_topk`): renormalize, scaling and noaux."""
    from moelora.kernels.softmax_topk import NoAux

    greedy = spec.method == "greedy"  # DeepSeek-V2's: never renormalised, then scaled
    noaux = NoAux(correction_bias, spec.n_group, spec.topk_group) if spec.method == "noaux_tc" else None
    return dict(renormalize=spec.renormalize and not greedy, scaling=1.0 if spec.method == "softmax" else spec.scaling,
                noaux=noaux)


def route(logits: torch.Tensor, spec: RoutingSpec, correction_bias: torch.Tensor | None = None,
          backend: str = "torch", pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, K] fp32, ids [T, K]). Under backend "triton" the softmax, greedy and noaux_tc routers (groups
    `noaux_fits` takes) are one kernel (`moelora.kernels.softmax_topk`, int32 ids; `pdl` its launch's); in torch
    (int64 ids) the rest, and every router of the torch backend."""
    if backend == "triton" and spec.method in ("softmax", "greedy", "noaux_tc"):
        from moelora.kernels.softmax_topk import noaux_fits
        from moelora.kernels.softmax_topk import softmax_topk as topk_kernel

        if spec.method != "noaux_tc" or noaux_fits(logits.shape[1], spec.n_group):
            return topk_kernel(logits, spec.top_k, **kernel_selection(spec, correction_bias), pdl=pdl)
    if spec.method == "softmax":
        return softmax_topk(logits, spec.top_k, spec.renormalize)
    return grouped_topk(logits, spec, correction_bias)


# torch.mm(.., out_dtype=): bf16 operands, an fp32 result (cuBLAS; torch's `aten::mm.dtype`, not in every torch
# the package accepts): without it the router takes the fp32 GEMM
_MM_OUT_DTYPE = "dtype" in torch.ops.aten.mm.overloads()


class Router(Linear):
    """The fp32 router of DeepSeek / GLM (`gate.weight` [E, H] and optional `gate.e_score_correction_bias`
    [E], both fp32 whatever the model dtype; its LoRA slots are fp32 too). x [T, H] -> logits [T, E] fp32.
    On the Triton backend, bf16 x on a GPU and no LoRA live on the router: `bf16_parts_logits` (the same fp32 dot
    on the bf16 tensor cores, no fp32 copy of x); else x upcast and an fp32 GEMM."""

    def __init__(self, hidden: int, num_experts: int, *, correction_bias: bool, **kw):
        super().__init__(hidden, num_experts, **dict(kw, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(num_experts, dtype=torch.float32)) if correction_bias else None
        self._parts = Derived()

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        if (x.is_cuda and x.dtype == torch.bfloat16 and self.options.kernel_backend == "triton" and _MM_OUT_DTYPE
                and self.bias is None and self.lora_args(lora) is None):
            return bf16_parts_logits(x, self._parts.get((self.weight,), lambda: bf16_parts(self.weight)))
        return super().forward(x.float(), lora)


def bf16_parts(weight: torch.Tensor) -> torch.Tensor:
    """An fp32 weight [E, H] as P bf16 parts [P, E, H] (P <= 3) whose sum is the weight: each part the rounding of
    what the ones before left (8 of the 24 bits a part, so three hold any fp32 value of bf16's range exactly,
    subnormal remainders aside). A part left all zero ends the split: a checkpoint's bf16 router (DeepSeek's,
    GLM's) is one part."""
    rest, parts = weight.float(), []
    for _ in range(3):
        part = rest.to(torch.bfloat16)
        parts.append(part)
        rest = rest - part.float()
        if not rest.any():
            break
    return torch.stack(parts)


def bf16_parts_logits(x: torch.Tensor, parts: torch.Tensor) -> torch.Tensor:
    """x [T, H] bf16 times the weight that `parts` [P, E, H] splits, in fp32 -> [T, E]: one bf16 GEMM with fp32
    output (every product exact in fp32, as in an fp32 GEMM of x upcast), then the P partial logits summed. Equal
    to x.float() @ weight.t() up to the order of the fp32 sums."""
    P, E, H = parts.shape
    out = torch.mm(x, parts.view(P * E, H).t(), out_dtype=torch.float32)
    return out if P == 1 else out.view(-1, P, E).sum(1)
