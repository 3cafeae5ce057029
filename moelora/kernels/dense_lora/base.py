"""The protocol of the dense LoRA modes of `lora_linear`, and what they share.

Shape legend: T tokens, N_in / N_out features, S adapter slots, R pool rank per segment, G output segments
(BLOCK_R = pow2 >= max(16, R)). A mode has a `name` and `run(x, weight, bias, lora, out, cfg, side_stream)`,
writing out = x W^T (+ bias) (+ the delta of `lora`) for a call `lora_linear` has checked, its launches with
programmatic dependent launch where `cfg.pdl` and the GPU has it (`kernels.pdl`).
"""

from __future__ import annotations

import itertools

import torch

from moelora.kernels.args import DenseLoRAArgs
from moelora.kernels.checks import lora_tile_rank, next_pow2


class Segments:
    """Launch constants of `lora`'s output segments: G, pool rank R a segment, column bounds (or None), BLOCK_R."""

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
