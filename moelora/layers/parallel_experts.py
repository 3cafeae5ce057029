"""Expert-parallel routed experts: this rank holds experts [first, first + E_r) whole, with their LoRA.

Shape legend: T tokens, H hidden, I expert intermediate, E experts, E_r local experts, K top-k.
The router runs whole on every rank (same input, same weights: the same routes). `forward` hands the
global routes to the experts with `expert_map` [E] int32 (global id -> local id, -1 for another rank's
expert): the routing plan keeps only the routes to local experts (`kernels.moe_plan.build_routing_plan`;
the torch twin skips the others alike), so another rank's routes cost this rank no GEMM row and add exactly
0; the MoE block's one all-reduce adds the ranks' shares. All-to-all dispatch (each token's hidden vector
sent only to the ranks of its experts) is the next step, for several hosts (docs/parallel.md).
"""

from __future__ import annotations

import torch

from moelora.layers.moe import Experts
from moelora.lora.batch import LoRABatch


class ExpertParallelExperts(Experts):
    def __init__(self, first: int, num_local: int, hidden: int, inter: int, *, num_experts: int, **kw):
        super().__init__(num_local, hidden, inter, **kw)
        self.first, self.num_local = first, num_local
        ids = torch.arange(num_experts, dtype=torch.int32) - first
        mine = (ids >= 0) & (ids < num_local)
        self.register_buffer("expert_map", torch.where(mine, ids, torch.full_like(ids, -1)), persistent=False)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                lora: LoRABatch | None, x_fp8=None) -> torch.Tensor:
        return super().forward(x, topk_weights, topk_ids, lora, expert_map=self.expert_map, x_fp8=x_fp8)
