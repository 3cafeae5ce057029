"""Dense SwiGLU MLP (dense layers and shared experts), each projection with its own LoRA.

Shape legend: T tokens, H hidden, I intermediate. x [T, H] -> [T, H].
Under backend "triton" silu(gate) * up is one launch (`moelora.kernels.silu_mul`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moelora.kernels.args import FP8Rows
from moelora.layers.linear import Linear
from moelora.lora.batch import LoRABatch


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, **linear_kw):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, **linear_kw)
        self.up_proj = Linear(hidden, intermediate, **linear_kw)
        self.down_proj = Linear(intermediate, hidden, **linear_kw)
        self.options = self.down_proj.options

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None, x_fp8: FP8Rows | None = None) -> torch.Tensor:
        """x_fp8: x quantized for the W8A8 gate and up projections by the norm that wrote it."""
        gate, up = self.gate_proj(x, lora, x_fp8), self.up_proj(x, lora, x_fp8)
        if self.options.kernel_backend == "triton":
            from moelora.kernels.silu_mul import silu_mul

            h = silu_mul(gate, up, pdl=self.options.pdl)
        else:
            h = F.silu(gate) * up
        return self.down_proj(h, lora)
