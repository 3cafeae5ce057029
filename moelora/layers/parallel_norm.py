"""RMSNorm over a width split across ranks (OLMoE's whole-width q/k norm under tensor parallelism).

Shape legend: T tokens, W_r this rank's columns, N ranks. The mean of squares is the all-reduced sum of
the ranks' squares over W_r * N columns: the full width when the columns are split, and also when they are
replicated (KV heads fewer than ranks: each column is then counted N / Nkv times in both). fp32, cast back
to the input dtype, as `kernels.reference.rms_norm_ref`.
"""

from __future__ import annotations

import torch
from torch import nn


class ShardedRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, shard):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.shard = eps, shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        sq = self.shard.all_reduce(xf.pow(2).sum(-1, keepdim=True))
        y = xf * torch.rsqrt(sq / (x.shape[-1] * self.shard.size) + self.eps)
        return (self.weight * y.to(x.dtype)).to(x.dtype)
