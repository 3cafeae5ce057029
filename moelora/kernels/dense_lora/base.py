"""The protocol of the dense LoRA modes of `lora_linear`, one per file in this package, and what they share.

Shape legend: T tokens, N_in / N_out features, S adapter slots, R pool rank per segment, G output segments
(BLOCK_R = pow2 >= max(16, R)).

A mode is a class with a `name` and `run(x, weight, bias, lora, out, cfg, side_stream)`: it writes
out = x W^T (+ bias) (+ the LoRA delta of `lora`, a `DenseLoRAArgs` with at least one slot, or None) for a
checked call (`lora_linear` checks shapes, allocates `out` and picks the mode: `LoRALinearConfig.mode`).
"""

from __future__ import annotations

import itertools

import torch

from moelora.kernels.checks import lora_tile_rank, next_pow2
from moelora.kernels.reference import DenseLoRAArgs


class Segments:
    """Launch constants of `lora`'s output segments: G, the pool rank R per segment, the output
    column bounds (None when unsegmented) and BLOCK_R (xa columns per segment)."""

    def __init__(self, lora: DenseLoRAArgs):
        self.G = max(1, len(lora.segments))
        self.r_seg = lora.a.shape[1] // self.G
        self.bounds = tuple(itertools.accumulate(lora.segments, initial=0)) if self.G > 1 else None
        self.block_r = lora_tile_rank(self.r_seg, lora.width)
        self.g_p2 = next_pow2(self.G)


def base_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """out = x W^T (+ bias), cuBLAS."""
    if bias is None:
        torch.mm(x, weight.t(), out=out)
    else:
        torch.addmm(bias, x, weight.t(), out=out)
