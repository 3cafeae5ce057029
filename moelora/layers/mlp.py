"""Dense SwiGLU MLP (dense layers and shared experts), each projection with its own LoRA.

Shape legend: T tokens, H hidden, I intermediate. x [T, H] -> [T, H].
gate and up are one `MergedLinear` (`gate_up_proj`: weight [2I, H], one GEMM and one LoRA shrink + expand
where two projections took two of each); `gate_proj` and `up_proj` are its segments, each still a LoRA site and
checkpoint name of its own (as attention's q/k/v). Under backend "triton" silu(gate) * up is one launch
(`moelora.kernels.silu_mul`, reading the two halves of the merged output); under W8A8 that launch also writes h
quantized for the down projection (`silu_mul_fp8`, as the norms do for gate_up). `LayerOptions.merge_gate_up`
False (`EngineConfig.merge_gate_up`) is the off switch: the two segments run as two projections.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moelora.kernels.args import FP8Rows
from moelora.layers.linear import Linear, MergedLinear
from moelora.lora.batch import LoRABatch
from moelora.quant.storage import activation_quantizer


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, **linear_kw):
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = MergedLinear(hidden, (intermediate, intermediate), **linear_kw)
        self.gate_proj, self.up_proj = self.gate_up_proj.segments
        self.down_proj = Linear(intermediate, hidden, **linear_kw)
        self.options = self.down_proj.options
        # W8A8 on the Triton kernels: the activation writes h quantized for the down projection too
        self.fp8_h = self.options.kernel_backend == "triton" and activation_quantizer(self.down_proj.quant) is not None

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None, x_fp8: FP8Rows | None = None) -> torch.Tensor:
        """x_fp8: x quantized for the W8A8 gate and up projections by the norm that wrote it."""
        if self.options.merge_gate_up:  # gate, up: the column halves of one [T, 2I] output
            gate_up = self.gate_up_proj(x, lora, x_fp8)
            gate, up = gate_up[:, :self.intermediate], gate_up[:, self.intermediate:]
        else:
            gate, up = self.gate_proj(x, lora, x_fp8), self.up_proj(x, lora, x_fp8)
        if self.fp8_h:
            from moelora.kernels.silu_mul import silu_mul_fp8

            h, h_fp8 = silu_mul_fp8(gate, up, pdl=self.options.pdl)
            return self.down_proj(h, lora, h_fp8)
        if self.options.kernel_backend == "triton":
            from moelora.kernels.silu_mul import silu_mul

            h = silu_mul(gate, up, pdl=self.options.pdl)
        else:
            h = F.silu(gate) * up
        return self.down_proj(h, lora)
