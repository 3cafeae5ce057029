"""GQA self-attention with its own LoRA on q/k/v/o, optional q/k norm, rotary, and a KV cache.

q/k/v are one `MergedLinear` (`qkv_proj`: weight [N*D + 2*N_kv*D, H], one GEMM and one LoRA shrink +
expand); `q_proj`, `k_proj`, `v_proj` are its segments, each still a LoRA site and checkpoint name of
its own (`self_attn.q_proj.weight`, adapter site `...self_attn.q_proj`). `LayerOptions.merge_qkv` False (the
engine's `EngineConfig.merge_qkv`) is the off switch: three projections, each with its own LoRA.

Shape legend: T tokens in the step (all sequences concatenated), H hidden, N query heads,
N_kv key/value heads, D head_dim, L cached length of one sequence.
The paged KV cache belongs to the caller (the engine): `kv = (k [NB, BS, N_kv, D], v ...)`; the
attention op writes the step's new keys/values at `AttnMetadata.slot_mapping` (an `out=` buffer
the caller owns, contract 2) and reads each sequence's blocks back through `block_tables`.
Under backend "triton" the per-head q/k norm and the rotary of q and k are one fused launch
(`moelora.kernels.rotary.qk_norm_rope`); the torch path is RMSNorm then `apply_rotary`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from moelora.kernels.args import FP8Rows
from moelora.layers.linear import Linear, MergedLinear
from moelora.layers.norm import RMSNorm
from moelora.layers.options import DEFAULT_OPTIONS
from moelora.layers.rotary import apply_rotary
from moelora.lora.batch import LoRABatch
from moelora.quant.storage import activation_quantizer


class SeqSlice(NamedTuple):
    """Host view of one sequence in the step: its query rows and its context length (a named
    tuple: the runner makes one per sequence per step, ~2.5x cheaper than a frozen dataclass)."""

    q_offset: int
    q_len: int
    seq_len: int  # cached + new tokens
    table_row: int  # row of `block_tables`


@dataclass(frozen=True)
class AttnMetadata:
    """Per-step paged-attention plan (built once by the runner, read by every layer).

    slot_mapping [T] int64: flat cache position (block * BS + offset) of each new token;
    block_tables [B, MB] int32; seq_lens [B] int32; query_start [B + 1] int32.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start: torch.Tensor
    seqs: tuple[SeqSlice, ...]
    max_seq_len: int
    max_query_len: int


class Attention(nn.Module):
    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, *, bias: bool,
                 qk_norm: str, eps: float, make_norm=None, **kw):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        kv = num_kv_heads * head_dim
        self.qkv_proj = MergedLinear(hidden, (num_heads * head_dim, kv, kv), bias=bias, **kw)
        self.q_proj, self.k_proj, self.v_proj = self.qkv_proj.segments
        self.o_proj = Linear(num_heads * head_dim, hidden, **kw)
        self.qk_norm, self.eps = qk_norm, eps
        self.options = kw.get("options", DEFAULT_OPTIONS)
        backend = self.options.kernel_backend
        # W8A8 on the Triton kernels, heads of one 128-column group: decode attention writes o's input quantized
        self.fp8_out = backend == "triton" and activation_quantizer(kw.get("quant")) is not None and head_dim == 128
        if qk_norm == "per_head":
            pdl = self.options.pdl
            self.q_norm, self.k_norm = RMSNorm(head_dim, eps, backend, pdl), RMSNorm(head_dim, eps, backend, pdl)
        elif qk_norm == "whole":  # `make_norm(width)`: a norm over columns split across ranks (parallel_norm)
            make_norm = make_norm or (lambda width: RMSNorm(width, eps, backend, self.options.pdl))
            self.q_norm, self.k_norm = make_norm(num_heads * head_dim), make_norm(num_kv_heads * head_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttnMetadata,
                kv: tuple[torch.Tensor, torch.Tensor], lora: LoRABatch | None = None,
                x_fp8: FP8Rows | None = None) -> torch.Tensor:
        """x_fp8: x quantized for the W8A8 q/k/v by the norm that wrote it (`DecoderLayer`)."""
        return self.output(*self.attend(self.project(x, cos, sin, meta, kv, lora, x_fp8), meta, kv), lora)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttnMetadata,
                kv: tuple[torch.Tensor, torch.Tensor], lora: LoRABatch | None = None,
                x_fp8: FP8Rows | None = None) -> tuple[torch.Tensor, ...]:
        """q/k/v projections, q/k norm and rotary -> what `attend` reads: (q [T, N, D],) under backend
        "triton" (k / v stored in the cache here, at meta.slot_mapping, the one field of `meta` read), else
        (q, k, v). Never reads the step's sequences: a piecewise graph captures it (`engine.piecewise_graphs`)."""
        T = x.shape[0]
        if self.options.merge_qkv:  # q, k, v: column views of one [T, N*D + 2*N_kv*D] output
            q, k, v = self.qkv_proj(x, lora, x_fp8).split(self.qkv_proj.out_sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x, lora, x_fp8), self.k_proj(x, lora, x_fp8), self.v_proj(x, lora, x_fp8)
        if self.qk_norm == "whole":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.options.kernel_backend == "triton":
            from moelora.kernels.rotary import KVStore, qk_norm_rope

            # per-head norm (if any) and rotary of q and k, and k / v into the cache: one launch
            per_head = self.qk_norm == "per_head"
            q, _ = qk_norm_rope(q, k, cos, sin, self.q_norm.weight if per_head else None,
                                self.k_norm.weight if per_head else None, self.eps,
                                kv_store=KVStore(v, kv[0], kv[1], meta.slot_mapping), pdl=self.options.pdl)
            return (q,)
        if self.qk_norm == "per_head":
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def attend(self, state: tuple[torch.Tensor, ...], meta: AttnMetadata, kv: tuple[torch.Tensor, torch.Tensor],
               lora: LoRABatch | None = None) -> tuple[torch.Tensor, FP8Rows | None]:
        """Causal paged attention of `project`'s state over each sequence's cache (the torch backend stores k / v
        first) -> (out [T, N*D], its rows quantized for the W8A8 o_proj where the kernel writes them, else None).
        Its launches depend on the step's sequences: eager between a piecewise graph's pieces."""
        k_cache, v_cache = kv
        if self.options.kernel_backend == "triton":
            from moelora.kernels.attention import paged_attention

            (q,), k, v = state, None, None
            kernel_kw = {"pdl": self.options.pdl, "kv_stored": True}
        else:
            from moelora.kernels.reference import paged_attention_ref as paged_attention

            (q, k, v), kernel_kw = state, {}  # the torch twins take no launch options
        rows = None
        if self.fp8_out:
            from moelora.kernels.attention import paged_attention_fp8

            out, rows = paged_attention_fp8(q, k, v, k_cache, v_cache, meta, self.head_dim ** -0.5, **kernel_kw)
        else:
            out = paged_attention(q, k, v, k_cache, v_cache, meta, self.head_dim ** -0.5, **kernel_kw)
        return out.reshape(q.shape[0], -1), rows

    def output(self, out: torch.Tensor, rows: FP8Rows | None, lora: LoRABatch | None = None) -> torch.Tensor:
        """o_proj of `attend`'s output [T, N*D] -> [T, H]."""
        return self.o_proj(out, lora, rows)
