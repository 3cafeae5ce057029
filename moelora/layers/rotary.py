"""Rotary position embedding: default or YaRN frequencies; rotate-half, partial or interleaved pairs.

Shape legend: T tokens, N heads, D head_dim, Dr rotary dims (Dr <= D).
`RotaryEmbedding(Dr, theta, yarn)(positions [T]) -> (cos, sin)` each [T, Dr] in fp32 (YaRN folds
its attention factor into both, as transformers does).
`apply_rotary(x [T, N, D], cos, sin)`: rotate-half over the first Dr dims, the rest passes through
(GLM's partial rotary; Dr = D is the usual full rotary).
`apply_rotary_interleaved(x [T, N, Dr], cos, sin)`: DeepSeek's pairs (x0, x1), (x2, x3)...; the result
is laid out de-interleaved (rotated evens, then rotated odds). Only q.k products are taken of it, and q
and k are permuted alike, so this equals transformers' interleaved output up to that permutation.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from moelora.config import YarnRope


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_softmax_scale(yarn: YarnRope | None) -> float:
    """The factor DeepSeek multiplies its softmax scale by under YaRN (mscale_all_dim squared)."""
    if yarn is None or not yarn.mscale_all_dim:
        return 1.0
    m = yarn_mscale(yarn.factor, yarn.mscale_all_dim)
    return m * m


def _yarn_inv_freq(dim: int, theta: float, yarn: YarnRope) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim/2], cos/sin factor): interpolate low frequencies, keep high ones, ramp between."""
    attention_factor = yarn.attention_factor
    if attention_factor is None:
        if yarn.mscale and yarn.mscale_all_dim:
            attention_factor = yarn_mscale(yarn.factor, yarn.mscale) / yarn_mscale(yarn.factor, yarn.mscale_all_dim)
        else:
            attention_factor = yarn_mscale(yarn.factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolate = 1 - ramp
    inv_freq = (1.0 / (yarn.factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float, yarn: YarnRope | None = None):
        super().__init__()
        if yarn is None:
            inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
            self.attention_factor = 1.0
        else:
            inv_freq, self.attention_factor = _yarn_inv_freq(head_dim, theta, yarn)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin) each [T, Dr] in fp32."""
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        if self.attention_factor == 1.0:
            return emb.cos(), emb.sin()
        return emb.cos() * self.attention_factor, emb.sin() * self.attention_factor


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rd = cos.shape[-1]
    if rd < x.shape[-1]:  # partial rotary: only the first rd dims of each head turn
        return torch.cat((apply_rotary(x[..., :rd], cos, sin), x[..., rd:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    return x * cos + rotated * sin


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = cos.shape[-1] // 2  # cos = cat(freqs, freqs): the first half holds one angle per pair
    cos, sin = cos[:, None, :half].to(x.dtype), sin[:, None, :half].to(x.dtype)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)
