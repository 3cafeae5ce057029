"""Multi-head latent attention (DeepSeek-V2/V3) on a paged latent cache, LoRA on every projection.

Shape legend: T tokens in the step, H hidden, N heads, Dn qk_nope_head_dim, Dr qk_rope_head_dim,
Dv v_head_dim, C kv_lora_rank, Q q_lora_rank, L cached length of one sequence, NB blocks, BS block size,
S adapter slots, R max LoRA rank.

Projections (transformers 5 names, each an ordinary LoRA `Linear` site): `q_proj` [H -> N(Dn+Dr)], or
`q_a_proj` [H -> Q] + `q_a_layernorm` + `q_b_proj` [Q -> N(Dn+Dr)] when q_lora_rank is set;
`kv_a_proj_with_mqa` [H -> C+Dr] + `kv_a_layernorm` (over C); `kv_b_proj` [C -> N(Dn+Dv)];
`o_proj` [N Dv -> H]. The two inner norms use eps 1e-6 whatever rms_norm_eps says, as transformers.
The two projections of x (`q_proj` or `q_a_proj`, and `kv_a_proj_with_mqa`) are one `MergedLinear` (`q_kv_a_proj`:
one GEMM and one LoRA shrink + expand, each still a site and checkpoint name as a segment) unless their biases
differ (attention_bias without q_lora: q_proj has none); `LayerOptions.merge_qkv` False runs them apart.

The cache (`kv = (latent [NB, BS, C + Dr],)`, owned by the engine) stores per token the normalised
latent and the rotated single-head key: C + Dr values (576 for DeepSeek-V3) instead of the
N(Dn + Dr + Dv) of expanded K/V (40960). The step writes its entries at `slot_mapping` (an `out=`
buffer the caller owns, contract 2) and attends in one of two forms:

- expanded (prefill and extend, and decode when `LayerOptions.mla_absorbed_decode` is off; eager only): gather
  every sequence's latents, expand them through `kv_b_proj` at once, each row with its sequence's adapter
  (`Linear.forward_rows`: LoRA on kv_b_proj changes the K/V derived from the cached latent, so it
  is applied at read time; the latent itself already carries LoRA of kv_a_proj_with_mqa and of every
  earlier layer, which is why the prefix cache keys blocks by adapter) and attend causally; on the Triton
  backend the rotations, the latent norm and the cache store are `kernels.mla_rope`'s one launch, as in decode.
- absorbed (decode steps, meta.max_query_len == 1; no host loop or sync, CUDA-graph safe): with
  W_kv_b viewed [N, Dn + Dv, C], W_uk = [:, :Dn], W_uv = [:, Dn:], and the token's slot s (A_s [R, C],
  B_s viewed [N, Dn + Dv, R], zero beyond the slot's rank, scaling folded in):
    q_abs = q_nope W_uk + (q_nope B_s,uk) A_s                                        [T, N, C]
    o_lat = softmax(scale (q_abs . latent + q_rope . krot)) . latent                 [T, N, C]
    out   = o_lat W_uv^T + (o_lat A_s^T) B_s,uv^T                                    [T, N, Dv]
  exactly the expanded result (k_nope = (W_uk + B_s,uk A_s) latent, v likewise). The attention core is
  `kernels.mla_attention` (backend "triton") or its torch twin `mla_decode_attention_ref`; under "triton"
  the LoRA terms are `kernels.mla_lora`'s two launches (each token's own slot, rank-masked), in torch
  (the twin) they are computed for every slot in one batched matmul per side and the token's slot is then
  selected by a one-hot mask (rows on no adapter select nothing): per-token gathers of B_s would
  take T N (Dn + Dv) R elements, the all-slot form N T S R; the slot buffers are read as they are
  at each step, so an adapter written into a slot later is seen by a captured graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moelora.errors import ConfigError
from moelora.kernels.args import FP8Rows
from moelora.layers.attention import AttnMetadata
from moelora.layers.derived import Derived
from moelora.layers.linear import Linear, MergedLinear
from moelora.layers.norm import RMSNorm
from moelora.layers.options import DEFAULT_OPTIONS
from moelora.layers.rotary import apply_rotary, apply_rotary_interleaved
from moelora.lora.batch import LoRABatch
from moelora.upload import upload

_INNER_NORM_EPS = 1e-6  # transformers builds q_a_layernorm / kv_a_layernorm with the default eps


class MLAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int, *, q_lora_rank: int | None, kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, bias: bool, interleave: bool,
                 softmax_scale: float, **kw):
        super().__init__()
        self.num_heads, self.kv_lora_rank = num_heads, kv_lora_rank
        self.nope, self.rope, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.scale = softmax_scale
        self.interleave = interleave
        self.rotate = apply_rotary_interleaved if interleave else apply_rotary
        q_out = num_heads * (qk_nope_head_dim + qk_rope_head_dim)
        self.options = kw.get("options", DEFAULT_OPTIONS)  # absorbed decode off: the expanded torch path (eager)
        backend = self.options.kernel_backend
        self.q_lora = q_lora_rank is not None
        # the projections of x (q_proj or q_a_proj, and kv_a_proj_with_mqa) as one MergedLinear when their biases
        # agree (q_proj has none): `q_kv_a_proj`, its segments the two sites; `merge_qkv` picks the forward
        q_first = q_lora_rank if self.q_lora else q_out
        kv_a = kv_lora_rank + qk_rope_head_dim
        self.q_kv_a_proj = MergedLinear(hidden, (q_first, kv_a), bias=bias, **kw) if self.q_lora or not bias else None
        if self.q_kv_a_proj is not None:
            first, self.kv_a_proj_with_mqa = self.q_kv_a_proj.segments
        else:
            first, self.kv_a_proj_with_mqa = Linear(hidden, q_out, **kw), Linear(hidden, kv_a, bias=bias, **kw)
        if not self.q_lora:
            self.q_proj = first
        else:
            self.q_a_proj = first
            self.q_a_layernorm = RMSNorm(q_lora_rank, _INNER_NORM_EPS, backend, self.options.pdl)
            self.q_b_proj = Linear(q_lora_rank, q_out, **kw)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, _INNER_NORM_EPS, backend, self.options.pdl)
        self.kv_b_proj = Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), **kw)
        self.o_proj = Linear(num_heads * v_head_dim, hidden, bias=bias, **kw)
        self.kv_b_dense = DenseKVB()

    def _project_x(self, x: torch.Tensor, lora: LoRABatch | None, x_fp8: FP8Rows | None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """(q [T, N(Dn + Dr)], compressed [T, C + Dr]): one GEMM for both when merged (column views of its
        output), else two."""
        if self.q_kv_a_proj is not None and self.options.merge_qkv:
            first, compressed = self.q_kv_a_proj(x, lora, x_fp8).split(self.q_kv_a_proj.out_sizes, dim=-1)
        else:
            first = (self.q_a_proj if self.q_lora else self.q_proj)(x, lora, x_fp8)
            compressed = self.kv_a_proj_with_mqa(x, lora, x_fp8)
        q = self.q_b_proj(self.q_a_layernorm(first), lora) if self.q_lora else first
        return q, compressed

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttnMetadata,
                kv: tuple[torch.Tensor], lora: LoRABatch | None = None, x_fp8: FP8Rows | None = None
                ) -> torch.Tensor:
        """x_fp8: x quantized for the W8A8 projections of x by the norm that wrote it (`DecoderLayer`)."""
        if self._absorbed(meta):
            assert self.kv_b_proj.bias is None  # DeepSeek's has none; the absorbed forms assume it
        elif x.is_cuda and torch.cuda.is_current_stream_capturing():
            raise ConfigError("MLA attention is graph-safe only for decode steps with mla_absorbed_decode on: "
                              "run this model with enforce_eager=True")
        # the absorbed decode's kv_b weight, asked for on a prefill too (`DenseKVB`: made before the KV pool is sized)
        w_kv_b = self.kv_b_dense(self.kv_b_proj, x.dtype) if self.options.mla_absorbed_decode else None
        if self._absorbed(meta):
            T, N = x.shape[0], self.num_heads
            q, compressed = self._project_x(x, lora, x_fp8)
            q = q.view(T, N, self.nope + self.rope)
            (cache,) = kv
            if self.options.kernel_backend == "triton":
                out = self._decode_triton(q, compressed, cos, sin, cache, meta, lora, w_kv_b)
            else:
                q, entries = self._rotate_torch(q, compressed, cos, sin)
                out = self._decode_absorbed(q[..., :self.nope], q[..., self.nope:], entries, cache, meta, lora,
                                            w_kv_b)
            return self.output(out.reshape(T, N * self.v_dim), None, lora)
        return self.output(*self.attend(self.project(x, cos, sin, meta, kv, lora, x_fp8), meta, kv, lora), lora)

    def _absorbed(self, meta: AttnMetadata) -> bool:
        return self.options.mla_absorbed_decode and meta.max_query_len == 1

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttnMetadata,
                kv: tuple[torch.Tensor], lora: LoRABatch | None = None, x_fp8: FP8Rows | None = None
                ) -> tuple[torch.Tensor, ...]:
        """The expanded form's first half (a step with prompt rows): the projections of x and the rotations ->
        what `attend` reads: under backend "triton" (q [T, N, Dn + Dr],) with the latent normed and stored in the
        cache at meta.slot_mapping (`kernels.mla_rope`: one launch, q's rope columns rotated in place: q is the
        projection's own output, read by nothing else), else (q, entries [T, C + Dr]) for `attend` to store.
        Reads no other field of `meta`: a piecewise graph captures it (`engine.piecewise_graphs`)."""
        T, N = x.shape[0], self.num_heads
        q, compressed = self._project_x(x, lora, x_fp8)
        q = q.view(T, N, self.nope + self.rope)
        if self.options.kernel_backend == "triton":
            from moelora.kernels.mla_rope import mla_rope_store

            norm = self.kv_a_layernorm
            mla_rope_store(q, compressed, cos, sin, norm.weight, norm.eps, kv[0], meta.slot_mapping,
                           interleave=self.interleave, in_place=True, pdl=self.options.pdl)
            return (q,)
        return self._rotate_torch(q, compressed, cos, sin)

    def _rotate_torch(self, q: torch.Tensor, compressed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """(q with its rope part rotated, the cache entries [T, C + Dr]: the normed latent and rotated key), torch."""
        C = self.kv_lora_rank
        q = torch.cat((q[..., :self.nope], self.rotate(q[..., self.nope:], cos, sin)), dim=-1)
        latent = self.kv_a_layernorm(compressed[:, :C])
        k_rot = self.rotate(compressed[:, None, C:], cos, sin)[:, 0]
        return q, torch.cat((latent, k_rot), dim=-1)

    def attend(self, state: tuple[torch.Tensor, ...], meta: AttnMetadata, kv: tuple[torch.Tensor],
               lora: LoRABatch | None = None) -> tuple[torch.Tensor, None]:
        """The expanded attention of `project`'s state over each sequence's latents (kv_b with each row's
        adapter) -> (out [T, N * Dv], None). Host loops over the step's sequences: eager, between a piecewise
        graph's pieces."""
        q, entries = (state[0], None) if len(state) == 1 else state
        out = mla_attention_expanded(q, entries, kv[0], meta, self.kv_b_proj, lora, self.nope, self.v_dim,
                                     self.scale, keys_kernel=entries is None)
        return out.reshape(q.shape[0], self.num_heads * self.v_dim), None

    def output(self, out: torch.Tensor, rows: None, lora: LoRABatch | None = None) -> torch.Tensor:
        """o_proj of the attention's output [T, N * Dv] -> [T, H]."""
        return self.o_proj(out, lora)

    def _decode_triton(self, q: torch.Tensor, compressed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       cache: torch.Tensor, meta: AttnMetadata, lora: LoRABatch | None, w_kv_b: torch.Tensor
                       ) -> torch.Tensor:
        """Decode step on the Triton kernels -> new [T, N, Dv]: q_abs (the absorb GEMM and its LoRA term, one
        launch `kernels.mla_lora`), on a second stream where `options.overlap_mla_absorb`, beside the rope kernel
        (rotations, latent norm and cache store: one launch, `kernels.mla_rope`), both reading only q (and
        compressed); then attention and the output."""
        from moelora.kernels.mla_attention import mla_decode_attention
        from moelora.kernels.mla_lora import mla_absorb_lora_, mla_expand_lora_
        from moelora.kernels.mla_rope import mla_rope_store
        from moelora.kernels.side_stream import forked, join, layer_streams

        kv_b, pdl, norm = self.kv_b_proj, self.options.pdl, self.kv_a_layernorm
        on = lora is not None and kv_b.has_lora and not lora.skips(kv_b)
        site = (kv_b.lora_a, kv_b.lora_b, kv_b.lora_ranks, lora.token_slots, lora.max_rank) if on else None
        q_nope = q[..., :self.nope]
        q_abs = torch.empty(*q.shape[:2], self.kv_lora_rank, dtype=q.dtype, device=q.device)
        # Fork (contract 2). Side stream reads q (its nope part), kv_b's weight and LoRA slots and writes only q_abs;
        # main reads q and compressed and writes only q_rope (new) and the step's cache slots, which the side stream
        # never reads. q_abs was allocated here before the fork and is read after the join.
        side = layer_streams(q.device).mla_absorb if q.is_cuda and self.options.overlap_mla_absorb else None
        with forked(side, q.device):
            absorb_query(q_nope, w_kv_b, None, out=q_abs)
            if site:
                mla_absorb_lora_(q_abs, q_nope, *site, pdl=pdl)
        q_rope = mla_rope_store(q, compressed, cos, sin, norm.weight, norm.eps, cache, meta.slot_mapping,
                                interleave=self.interleave, pdl=pdl)
        join(side, q.device)  # q_abs is complete
        o_lat = mla_decode_attention(q_abs, q_rope, None, cache, meta, self.scale, stored=True, pdl=pdl)
        out = expand_output(o_lat, w_kv_b, self.nope, None)
        if site:
            a, b, ranks, token_slots, width = site
            mla_expand_lora_(out, o_lat, a, b, self.nope, ranks, token_slots, width, pdl=pdl)
        return out

    def _decode_absorbed(self, q_nope: torch.Tensor, q_rope: torch.Tensor, entries: torch.Tensor,
                         cache: torch.Tensor, meta: AttnMetadata, lora: LoRABatch | None, w_kv_b: torch.Tensor
                         ) -> torch.Tensor:
        """Decode step (one query per sequence) in the absorbed form, in torch -> new [T, N, Dv]; w_kv_b:
        kv_b_proj's weight, dense (`DenseKVB`)."""
        from moelora.kernels.reference import mla_decode_attention_ref as mla_decode_attention

        slots = _SlotSelect.of(self.kv_b_proj, lora)
        q_abs = absorb_query(q_nope, w_kv_b, slots)
        o_lat = mla_decode_attention(q_abs, q_rope, entries, cache, meta, self.scale)
        return expand_output(o_lat, w_kv_b, self.nope, slots)


@dataclass(frozen=True)
class _SlotSelect:
    """The step's per-token LoRA slot on kv_b_proj: one-hot [T, S] (rows on no adapter: all zero), each
    token's A_s [T, R, C] (slot clamped to 0 for rows on no adapter; their one-hot zeroes every use) and
    every slot's B [S, N(Dn + Dv), R]."""

    onehot: torch.Tensor
    a_tok: torch.Tensor
    b: torch.Tensor

    @staticmethod
    def of(kv_b_proj: Linear, lora: LoRABatch | None) -> _SlotSelect | None:
        if lora is None or not kv_b_proj.has_lora or lora.skips(kv_b_proj):
            return None
        a, b = kv_b_proj.lora_a, kv_b_proj.lora_b  # [S, R, C], [S, N(Dn + Dv), R]
        dtype = a.dtype  # the model's (an FP8 kv_b_proj's weight is e4m3)
        slots = lora.token_slots.long()
        onehot = (slots[:, None] == torch.arange(a.shape[0], device=slots.device)[None, :]).to(dtype)
        return _SlotSelect(onehot, a.index_select(0, slots.clamp(min=0)).to(dtype), b.to(dtype))


class DenseKVB:
    """kv_b_proj's weight [N(Dn + Dv), C] as the absorbed products read it: the parameter itself, or an FP8 one
    dequantized once (W8A16 in every mode) and kept, not at every decode step (two dequantizations of N(Dn + Dv)
    C elements a layer, ~5 torch launches each), made again when the weight or its scale changes
    (`layers.derived`); `MLAttention.forward` asks for it on every step, prefill included (its bytes count as
    the profile's activations)."""

    def __init__(self):
        self._dense = Derived()

    def __call__(self, kv_b_proj: Linear, dtype: torch.dtype) -> torch.Tensor:
        if getattr(kv_b_proj, "quant", None) is None:
            return kv_b_proj.weight
        return self._dense.get((kv_b_proj.weight, kv_b_proj.weight_scale_inv),
                               lambda: kv_b_proj.dense_weight(dtype), dtype)


def absorb_query(q_nope: torch.Tensor, w_kv_b: torch.Tensor, slots: _SlotSelect | None, *,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """q_nope [T, N, Dn] -> q_abs [T, N, C] = q_nope W_uk (+ (q_nope B_s,uk) A_s). W_uk, W_uv are views of
    kv_b_proj's weight w_kv_b [N(Dn + Dv), C] (`DenseKVB`); kv_b_proj has no bias (DeepSeek's has none; the
    absorbed forms assume it). `out` (slots None only): a [T, N, C] buffer the product is written into."""
    T, N, nope = q_nope.shape
    C = w_kv_b.shape[1]
    w = w_kv_b.view(N, -1, C)
    qn = q_nope.transpose(0, 1)  # [N, T, Dn]
    if out is not None:
        assert slots is None
        return torch.bmm(qn, w[:, :nope], out=out.transpose(0, 1)).transpose(0, 1)
    q_abs = torch.bmm(qn, w[:, :nope]).transpose(0, 1)  # [T, N, C]
    if slots is None:
        return q_abs
    S, _, R = slots.b.shape
    b_uk = slots.b.view(S, N, -1, R)[:, :, :nope].permute(1, 2, 0, 3).reshape(N, nope, S * R)
    u = torch.bmm(qn, b_uk).view(N, T, S, R)  # every slot's q_nope B_s,uk
    u = (u * slots.onehot[None, :, :, None]).sum(2)  # the token's own slot [N, T, R]
    return q_abs + torch.bmm(u.transpose(0, 1), slots.a_tok)


def expand_output(o_lat: torch.Tensor, w_kv_b: torch.Tensor, nope: int, slots: _SlotSelect | None) -> torch.Tensor:
    """o_lat [T, N, C] -> out [T, N, Dv] = o_lat W_uv^T (+ (o_lat A_s^T) B_s,uv^T)."""
    T, N, C = o_lat.shape
    w = w_kv_b.view(N, -1, C)
    v_dim = w.shape[1] - nope
    # the per-head products written straight into [T, N, Dv] rows (cuBLAS's strided output), so o_proj's
    # [T, N Dv] input is a view, not a transposing copy of an [N, T, Dv] product
    out = torch.empty(T, N, v_dim, dtype=o_lat.dtype, device=o_lat.device)
    torch.bmm(o_lat.transpose(0, 1), w[:, nope:].transpose(1, 2), out=out.transpose(0, 1))
    if slots is None:
        return out
    S, _, R = slots.b.shape
    w_rank = torch.bmm(o_lat, slots.a_tok.transpose(1, 2))  # [T, N, R] with the token's A_s
    w_rank = w_rank[:, :, None, :] * slots.onehot[:, None, :, None]  # [T, N, S, R]: only the token's slot
    b_uv = slots.b.view(S, N, -1, R)[:, :, nope:].permute(1, 0, 3, 2).reshape(N, S * R, v_dim)
    return out + torch.bmm(w_rank.transpose(0, 1).reshape(N, T, S * R), b_uv).transpose(0, 1)


def write_latent_ref(entries: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store the step's entries [T, C + Dr] at flat positions `slot_mapping` [T] of the caller's cache
    [NB, BS, C + Dr] (an `out=` buffer; `entries` is only read)."""
    cache.view(-1, cache.shape[-1]).index_copy_(0, slot_mapping, entries.to(cache.dtype))


def mla_attention_expanded(q: torch.Tensor, entries: torch.Tensor | None, cache: torch.Tensor, meta: AttnMetadata,
                           kv_b_proj: Linear, lora: LoRABatch | None, nope: int, v_dim: int, scale: float, *,
                           keys_kernel: bool = False) -> torch.Tensor:
    """Causal MLA of the step's queries q [T, N, Dn + Dr] (rope part rotated) over each sequence's
    cached latents, in the expanded form (prefill's; decode absorbs kv_b instead), on either backend. Writes
    `entries` [T, C + Dr] first (None: in the cache already, `kernels.mla_rope`'s store, the Triton backend's
    prefill); query i of a sequence sits at position seq_len - q_len + i. Every sequence's latents are expanded
    through kv_b_proj at once, then attended sequence by sequence. Where no sequence has a cached prefix (a fresh
    prefill) its latents are the step's own entries, in the step's row order, and the step's LoRA batch is theirs;
    else they are gathered from the cache, each row with its sequence's adapter (`LinearSite.forward_rows`).
    `keys_kernel` (the Triton backend): the attention by `kernels.mla_prefill` (every sequence in one launch, keys
    read where they lie) where `MLA_PREFILL_KERNEL_MAX_Q` / `_HEADS` say it wins, else by SDPA a sequence with the
    keys built by `kernels.mla_keys`; without it, torch.cat and SDPA.
    Returns a new [T, N, Dv] tensor."""
    if entries is not None:
        write_latent_ref(entries, cache, meta.slot_mapping)
    N = q.shape[1]
    width, C = cache.shape[2], kv_b_proj.in_features
    fresh = all(s.seq_len == s.q_len for s in meta.seqs)  # no sequence has a cached prefix
    if cache.dtype == q.dtype and fresh:  # the cache holds entries as is
        ctx = entries if entries is not None else cache.view(-1, width).index_select(0, meta.slot_mapping)
        kv = kv_b_proj(ctx[:, :C], lora)
    else:
        rows, seq_of_row, q_offsets = context_rows(meta, cache.shape[1])
        ctx = cache.view(-1, width).index_select(0, rows).to(q.dtype)  # [sum L, C + Dr]
        slots = None if lora is None else lora.token_slots.index_select(0, q_offsets).index_select(0, seq_of_row)
        kv = kv_b_proj.forward_rows(ctx[:, :C], slots, lora)
    kv = kv.view(-1, N, nope + v_dim)
    if keys_kernel and meta.max_query_len <= MLA_PREFILL_KERNEL_MAX_Q and N <= MLA_PREFILL_KERNEL_MAX_HEADS:
        from moelora.kernels.mla_prefill import mla_prefill_attention

        # sequence b's context rows: the step's own rows (fresh: ctx is the step's entries) or context_rows' order
        kv_start = meta.query_start[:-1] if fresh and cache.dtype == q.dtype else (
            torch.cumsum(meta.seq_lens, 0, dtype=torch.int32) - meta.seq_lens)
        return mla_prefill_attention(q, kv, ctx[:, C:], meta.seq_lens, meta.query_start, kv_start, nope, scale,
                                     meta.max_query_len)
    if keys_kernel:
        from moelora.kernels.mla_keys import mla_prefill_keys

        keys = mla_prefill_keys(kv, ctx[:, C:], nope)
    else:
        keys = torch.cat((kv[..., :nope], ctx[:, None, C:].expand(-1, N, width - C)), dim=-1)  # [sum L, N, Dn + Dr]
    return attend_by_sequence(q, keys, kv[..., nope:], meta, scale)


# Where `kernels.mla_prefill` attends a step: its longest query run (tokens of one sequence) at most
# MLA_PREFILL_KERNEL_MAX_Q and at most MLA_PREFILL_KERNEL_MAX_HEADS heads (this rank's); else SDPA a sequence
# (cuDNN). H200, µs an attention, SDPA loop / the kernel at 128x64, 8 warps, 3 stages (40th session): 16 heads
# (DeepSeek-V2-Lite; V3's at tensor parallel 8) 16 x 512 303.2 / 110.8, 4 x 2048 301.1 / 247.5, 2 x 1024 + 3072
# 302.0 / 180.5, 1 x 8192 661.4 / 780.6; 128 heads 2 x 1024 297.7 / 341.2, 1 x 4096 1412.1 / 1896.2.
MLA_PREFILL_KERNEL_MAX_Q = 3072
MLA_PREFILL_KERNEL_MAX_HEADS = 32


def attend_by_sequence(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, meta: AttnMetadata, scale: float
                       ) -> torch.Tensor:
    """q [T, N, Dn + Dr] over keys [sum L, N, Dn + Dr] and vals [sum L, N, Dv], each sequence's context rows
    after the previous one's (`context_rows`' order; a fresh prefill's are the step's rows), one SDPA a sequence
    (`attend`) -> a new [T, N, Dv]."""
    # positions for the masks of sequences with a prefix (a fresh prefill has none: no launch)
    fresh = all(s.seq_len == s.q_len for s in meta.seqs)
    positions = None if fresh else torch.arange(meta.max_seq_len, device=q.device)
    out = q.new_empty(q.shape[0], q.shape[1], vals.shape[2])
    start = 0
    for s in meta.seqs:
        end = start + s.seq_len
        # the mask: one launch over views of `positions`, or none (is_causal)
        mask = None if s.q_len == s.seq_len else (positions[None, :s.seq_len]
                                                  <= positions[s.seq_len - s.q_len:s.seq_len, None])
        qs = q[s.q_offset:s.q_offset + s.q_len].transpose(0, 1)  # [N, n, Dn + Dr]
        o = attend(qs, keys[start:end].transpose(0, 1), vals[start:end].transpose(0, 1), mask, scale)
        out[s.q_offset:s.q_offset + s.q_len] = o.transpose(0, 1)
        start = end
    return out


def context_rows(meta: AttnMetadata, block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(flat cache rows [sum L] int64 of every sequence's positions 0 .. seq_len - 1, sequence after sequence;
    each row's sequence index [sum L]; each sequence's first query row [B]), built on the device from one
    upload of the sequences' host ints, queued without waiting (`torch.tensor(.., device=)` would wait for the
    stream: a host sync a layer, 4-5 % of an 8192-token prefill step on the H200)."""
    dev = meta.block_tables.device
    info = upload([v for s in meta.seqs for v in (s.table_row, s.seq_len, s.q_offset)], torch.int64, dev).view(-1, 3)
    lens = info[:, 1]
    seq = torch.repeat_interleave(torch.arange(len(meta.seqs), device=dev), lens,
                                  output_size=sum(s.seq_len for s in meta.seqs))
    pos = torch.arange(seq.shape[0], device=dev) - (torch.cumsum(lens, 0) - lens).index_select(0, seq)
    blocks = meta.block_tables[info[:, 0].index_select(0, seq), pos // block_size].long()
    return blocks * block_size + pos % block_size, seq, info[:, 2]


def attend(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, mask: torch.Tensor | None,
           scale: float) -> torch.Tensor:
    """Attention of one sequence's heads, q [N, n, Dn + Dr] over keys [N, L, Dn + Dr] and vals [N, L, Dv] with
    mask [n, L] (True: attend; None: n == L, causal, SDPA's `is_causal`, whose kernels skip the masked half)
    -> [N, n, Dv], given to SDPA as a batch of one: on 3-D inputs torch runs only its math kernel (scores
    materialized in fp32), on 4-D ones its fused kernels (cuDNN / flash / memory-efficient on CUDA): 1.94 -> 0.14
    ms at DeepSeek-V2-Lite's 16 heads and 2048-token prompts on the H200 with the mask (0.094 causal, probed)."""
    assert mask is not None or q.shape[1] == keys.shape[1], "is_causal aligns the queries top-left: n must be L"
    return F.scaled_dot_product_attention(q[None], keys[None], vals[None], attn_mask=mask, is_causal=mask is None,
                                          scale=scale)[0]
