"""Expert-parallel routed experts: this rank holds experts [first, first + E_r) whole, with their LoRA.

Shape legend: T tokens, H hidden, I expert intermediate, E experts, E_r local experts, K top-k.
The router runs whole on every rank (same input, same weights: the same routes). `forward` keeps the
routes to local experts and gives every other route weight 0 on local expert 0, so the result is this
rank's share of the routed sum (exactly 0 from the others' routes); the MoE block's one all-reduce adds
the ranks' shares. The dropped routes still cost local expert 0 their GEMM rows: a routing plan that skips
them (an expert map in `kernels.moe_plan`) is the next step, and all-to-all dispatch the one after, for
several hosts (docs/parallel.md).
"""

from __future__ import annotations

import torch

from moelora.layers.moe import Experts
from moelora.lora.batch import LoRABatch


class ExpertParallelExperts(Experts):
    def __init__(self, first: int, num_local: int, hidden: int, inter: int, **kw):
        super().__init__(num_local, hidden, inter, **kw)
        self.first, self.num_local = first, num_local

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                lora: LoRABatch | None) -> torch.Tensor:
        local = topk_ids - self.first
        mine = (local >= 0) & (local < self.num_local)
        ids = torch.where(mine, local, torch.zeros_like(local))
        weights = torch.where(mine, topk_weights, torch.zeros_like(topk_weights))
        return super().forward(x, weights, ids, lora)
