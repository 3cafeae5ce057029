"""RMSNorm. Shape legend: [..., D] -> [..., D]; computed in fp32, returned in the input dtype.

The weight stays fp32 whatever the model dtype; the product is cast back to the input dtype, which
for a bf16/fp16 checkpoint (weights exactly representable) equals transformers' product in that dtype."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf.to(x.dtype)).to(x.dtype)
