"""Top-k routing for the softmax-router families (Qwen2/3-MoE, Mixtral, OLMoE).

Shape legend: T tokens, E experts, K top-k. logits [T, E] -> (weights [T, K] fp32, ids [T, K]).
All four families compute softmax in fp32 over all experts, take the top k, and renormalise the
k weights when `renormalize` (Mixtral always; Qwen/OLMoE per `norm_topk_prob`). Mixtral's
"top-k of logits, then softmax of those k" is the same function.
"""

from __future__ import annotations

import torch


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids
