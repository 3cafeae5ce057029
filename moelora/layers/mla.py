"""Multi-head latent attention (DeepSeek-V2/V3) on a paged latent cache, LoRA on every projection.

Shape legend: T tokens in the step, H hidden, N heads, Dn qk_nope_head_dim, Dr qk_rope_head_dim,
Dv v_head_dim, C kv_lora_rank, Q q_lora_rank, L cached length of one sequence, NB blocks, BS block size.

Projections (transformers 5 names, each an ordinary LoRA `Linear` site): `q_proj` [H -> N(Dn+Dr)], or
`q_a_proj` [H -> Q] + `q_a_layernorm` + `q_b_proj` [Q -> N(Dn+Dr)] when q_lora_rank is set;
`kv_a_proj_with_mqa` [H -> C+Dr] + `kv_a_layernorm` (over C); `kv_b_proj` [C -> N(Dn+Dv)];
`o_proj` [N Dv -> H]. The two inner norms use eps 1e-6 whatever rms_norm_eps says, as transformers.

The cache (`kv = (latent [NB, BS, C + Dr],)`, owned by the engine) stores per token the normalised
latent and the rotated single-head key: C + Dr values (576 for DeepSeek-V3) instead of the
N(Dn + Dr + Dv) of expanded K/V (40960). The step writes its entries at `slot_mapping` (an `out=`
buffer the caller owns, contract 2); then, per sequence, the torch path gathers its latents,
expands them through `kv_b_proj` with that sequence's adapter (`Linear.forward_one_slot`: LoRA on
kv_b_proj changes the K/V derived from the cached latent, so it is applied at read time; the latent
itself already carries LoRA of kv_a_proj_with_mqa and of every earlier layer, which is why the
prefix cache keys blocks by adapter) and attends causally.
The GPU decode form (weight absorption: q_nope @ W_uk and o @ W_uv folded so attention runs on the
latent directly) and its Triton kernel are not written yet; this path has no CUDA-graph form.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moelora.errors import ConfigError
from moelora.layers.attention import AttnMetadata
from moelora.layers.linear import Linear
from moelora.layers.norm import RMSNorm
from moelora.layers.rotary import apply_rotary, apply_rotary_interleaved
from moelora.lora.batch import LoRABatch

_INNER_NORM_EPS = 1e-6  # transformers builds q_a_layernorm / kv_a_layernorm with the default eps


class MLAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int, *, q_lora_rank: int | None, kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, bias: bool, interleave: bool,
                 softmax_scale: float, **kw):
        super().__init__()
        self.num_heads, self.kv_lora_rank = num_heads, kv_lora_rank
        self.nope, self.rope, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.scale = softmax_scale
        self.rotate = apply_rotary_interleaved if interleave else apply_rotary
        q_out = num_heads * (qk_nope_head_dim + qk_rope_head_dim)
        self.q_lora = q_lora_rank is not None
        if not self.q_lora:
            self.q_proj = Linear(hidden, q_out, **kw)
        else:
            self.q_a_proj = Linear(hidden, q_lora_rank, bias=bias, **kw)
            self.q_a_layernorm = RMSNorm(q_lora_rank, _INNER_NORM_EPS)
            self.q_b_proj = Linear(q_lora_rank, q_out, **kw)
        self.kv_a_proj_with_mqa = Linear(hidden, kv_lora_rank + qk_rope_head_dim, bias=bias, **kw)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, _INNER_NORM_EPS)
        self.kv_b_proj = Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), **kw)
        self.o_proj = Linear(num_heads * v_head_dim, hidden, bias=bias, **kw)

    def _query(self, x: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        if not self.q_lora:
            return self.q_proj(x, lora)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x, lora)), lora)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttnMetadata,
                kv: tuple[torch.Tensor], lora: LoRABatch | None = None) -> torch.Tensor:
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            raise ConfigError("MLA attention has no CUDA-graph path yet: run DeepSeek models with enforce_eager=True")
        T, N, C = x.shape[0], self.num_heads, self.kv_lora_rank
        q = self._query(x, lora).view(T, N, self.nope + self.rope)
        q = torch.cat((q[..., :self.nope], self.rotate(q[..., self.nope:], cos, sin)), dim=-1)
        compressed = self.kv_a_proj_with_mqa(x, lora)
        latent = self.kv_a_layernorm(compressed[:, :C])
        k_rot = self.rotate(compressed[:, None, C:], cos, sin)[:, 0]
        (cache,) = kv
        out = mla_attention_ref(q, torch.cat((latent, k_rot), dim=-1), cache, meta, self.kv_b_proj, lora,
                                self.nope, self.v_dim, self.scale)
        return self.o_proj(out.reshape(T, N * self.v_dim), lora)


def write_latent_ref(entries: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store the step's entries [T, C + Dr] at flat positions `slot_mapping` [T] of the caller's cache
    [NB, BS, C + Dr] (an `out=` buffer; `entries` is only read)."""
    cache.view(-1, cache.shape[-1]).index_copy_(0, slot_mapping, entries.to(cache.dtype))


def mla_attention_ref(q: torch.Tensor, entries: torch.Tensor, cache: torch.Tensor, meta: AttnMetadata,
                      kv_b_proj: Linear, lora: LoRABatch | None, nope: int, v_dim: int, scale: float) -> torch.Tensor:
    """Causal MLA of the step's queries q [T, N, Dn + Dr] (rope part rotated) over each sequence's
    cached latents. Writes `entries` [T, C + Dr] first; query i of a sequence sits at position
    seq_len - q_len + i. Returns a new [T, N, Dv] tensor."""
    write_latent_ref(entries, cache, meta.slot_mapping)
    T, N, _ = q.shape
    bs, width = cache.shape[1], cache.shape[2]
    C = kv_b_proj.in_features
    out = q.new_empty(T, N, v_dim)
    for s in meta.seqs:
        blocks = meta.block_tables[s.table_row, : -(-s.seq_len // bs)].long()
        ctx = cache.index_select(0, blocks).reshape(-1, width)[: s.seq_len].to(q.dtype)  # [L, C + Dr]
        slot = None if lora is None else lora.token_slots[s.q_offset]
        kv = kv_b_proj.forward_one_slot(ctx[:, :C], slot).view(s.seq_len, N, nope + v_dim)
        k_rot = ctx[:, None, C:].expand(s.seq_len, N, width - C)
        keys = torch.cat((kv[..., :nope], k_rot), dim=-1).transpose(0, 1)  # [N, L, Dn + Dr]
        vals = kv[..., nope:].transpose(0, 1)  # [N, L, Dv]
        qs = q[s.q_offset:s.q_offset + s.q_len].transpose(0, 1)  # [N, n, Dn + Dr]
        q_pos = torch.arange(s.seq_len - s.q_len, s.seq_len, device=q.device)[:, None]
        mask = torch.arange(s.seq_len, device=q.device)[None, :] <= q_pos
        o = F.scaled_dot_product_attention(qs, keys, vals, attn_mask=mask, scale=scale)
        out[s.q_offset:s.q_offset + s.q_len] = o.transpose(0, 1)
    return out
