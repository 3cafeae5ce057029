"""Linear layer with its own multi-LoRA delta (contract 1: LoRA is part of the layer).

Shape legend: T tokens, N_in / N_out features, S adapter slots, R max rank.
Slot buffers `lora_a [S, R, N_in]`, `lora_b [S, N_out, R]` and `lora_ranks [S]` int32 have a
fixed address for the model's lifetime (CUDA graphs capture them); loading an adapter copies into
a slot, unloading zeroes it. A slot the adapter does not cover at this site stays zero.

`lora_ranks` is this site's own rank per slot (0: the slot is empty or its adapter has no LoRA
here), and it is what the kernels read (`DenseLoRAArgs.slot_ranks`), not the adapter's global
rank in `LoRABatch.slot_ranks`: a site an adapter does not cover (e.g. the router `mlp.gate`)
then costs no LoRA work. The torch twin loops over `LoRABatch.active` with the host-side global
rank instead (reading the device ranks would sync); that is exact, as columns beyond a site's own
rank are zero.
"""

from __future__ import annotations

import torch
from torch import nn

from moelora.kernels.reference import DenseLoRAArgs, lora_linear_ref
from moelora.lora.adapter import LoRAWeights
from moelora.lora.batch import LoRABatch


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, *, bias: bool = False,
                 max_loras: int = 0, max_rank: int = 0, backend: str = "torch",
                 dtype: torch.dtype | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.backend = backend
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None
        self.has_lora = max_loras > 0 and max_rank > 0
        if self.has_lora:
            self.register_buffer("lora_a", torch.zeros(max_loras, max_rank, in_features, dtype=dtype),
                                 persistent=False)
            self.register_buffer("lora_b", torch.zeros(max_loras, out_features, max_rank, dtype=dtype),
                                 persistent=False)
            self.register_buffer("lora_ranks", torch.zeros(max_loras, dtype=torch.int32), persistent=False)

    def set_lora_slot(self, slot: int, weights: LoRAWeights | None) -> None:
        """Copy `weights` (a [r, N_in], b [N_out, r]) into `slot` and set its site rank to r, or
        zero the slot and its rank. Runs between steps (adapter load / eviction), never in a graph."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        r = 0 if weights is None else weights.rank
        if r:
            self.lora_a[slot, :r].copy_(weights.a, non_blocking=True)
            self.lora_b[slot, :, :r].copy_(weights.b, non_blocking=True)
        self.lora_ranks[slot] = r

    def lora_args(self, lora: LoRABatch | None) -> DenseLoRAArgs | None:
        if lora is None or not self.has_lora:
            return None
        return DenseLoRAArgs(self.lora_a, self.lora_b, lora.token_slots, self.lora_ranks, lora.active)

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        args = self.lora_args(lora)
        if self.backend == "triton":
            from moelora.kernels.lora_linear import lora_linear

            return lora_linear(x, self.weight, self.bias, args)
        return lora_linear_ref(x, self.weight, self.bias, args)

    def forward_one_slot(self, x: torch.Tensor, slot: torch.Tensor | None) -> torch.Tensor:
        """Rows that all belong to one adapter slot, given as a 0-d int device tensor (-1: none), so
        rows outside the step (an MLA layer's cached latents) get their request's LoRA with no host
        sync. The slot's full R columns are used: a lower-rank slot is zero beyond its rank."""
        y = self.forward(x)
        if slot is None or not self.has_lora:
            return y
        index = slot.clamp(min=0).long().view(1)
        a = self.lora_a.index_select(0, index)[0].to(x.dtype)  # [R, N_in]
        b = self.lora_b.index_select(0, index)[0].to(x.dtype)  # [N_out, R]
        return y + ((x @ a.t()) @ b.t()) * (slot >= 0).to(x.dtype)
