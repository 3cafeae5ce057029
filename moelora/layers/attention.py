"""GQA self-attention with its own LoRA on q/k/v/o, optional q/k norm, rotary, and a KV cache.

Shape legend: T tokens in the step (all sequences concatenated), H hidden, N query heads,
N_kv key/value heads, D head_dim, L cached length of one sequence.
The KV cache belongs to the caller (the engine): `kv = (k [rows, L_max, N_kv, D], v ...)`; this
layer writes the step's new keys/values into the rows and positions `AttnMetadata` names (an
`out=` buffer the caller owns, contract 2) and reads each sequence's prefix back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moelora.layers.linear import Linear
from moelora.layers.norm import RMSNorm
from moelora.layers.rotary import apply_rotary
from moelora.lora.batch import LoRABatch


@dataclass(frozen=True)
class SeqSpan:
    """One sequence in the step: cache row, tokens already cached, new tokens, offset in T."""

    row: int
    start: int
    length: int
    offset: int


@dataclass(frozen=True)
class AttnMetadata:
    seqs: tuple[SeqSpan, ...]


class Attention(nn.Module):
    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, *, bias: bool,
                 qk_norm: str, eps: float, **kw):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = Linear(hidden, num_heads * head_dim, bias=bias, **kw)
        self.k_proj = Linear(hidden, num_kv_heads * head_dim, bias=bias, **kw)
        self.v_proj = Linear(hidden, num_kv_heads * head_dim, bias=bias, **kw)
        self.o_proj = Linear(num_heads * head_dim, hidden, **kw)
        self.qk_norm = qk_norm
        if qk_norm == "per_head":
            self.q_norm, self.k_norm = RMSNorm(head_dim, eps), RMSNorm(head_dim, eps)
        elif qk_norm == "whole":
            self.q_norm = RMSNorm(num_heads * head_dim, eps)
            self.k_norm = RMSNorm(num_kv_heads * head_dim, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttnMetadata,
                kv: tuple[torch.Tensor, torch.Tensor], lora: LoRABatch | None = None) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.q_proj(x, lora), self.k_proj(x, lora), self.v_proj(x, lora)
        if self.qk_norm == "whole":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "per_head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = torch.empty_like(q)
        for s in meta.seqs:
            out[s.offset:s.offset + s.length] = self._attend_one(q, k, v, s, kv)
        return self.o_proj(out.view(T, -1), lora)

    def _attend_one(self, q, k, v, s: SeqSpan, kv) -> torch.Tensor:
        k_cache, v_cache = kv
        end = s.start + s.length
        k_cache[s.row, s.start:end] = k[s.offset:s.offset + s.length]
        v_cache[s.row, s.start:end] = v[s.offset:s.offset + s.length]
        groups = self.num_heads // self.num_kv_heads
        keys = k_cache[s.row, :end].repeat_interleave(groups, dim=1).transpose(0, 1)  # [N, L, D]
        vals = v_cache[s.row, :end].repeat_interleave(groups, dim=1).transpose(0, 1)
        qs = q[s.offset:s.offset + s.length].transpose(0, 1)  # [N, n, D]
        q_pos = torch.arange(s.start, end, device=q.device)[:, None]
        mask = torch.arange(end, device=q.device)[None, :] <= q_pos  # [n, L]
        o = F.scaled_dot_product_attention(qs, keys, vals, attn_mask=mask)
        return o.transpose(0, 1)
