"""Torch twins of every kernel launcher: the semantics the Triton kernels must reproduce, and the
`kernel_backend="torch"` implementation. Shape legend: `kernels.args`'s.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from moelora.kernels.args import DenseLoRAArgs, ExpertLoRAArgs, MoERoutingPlan


def _need_rows(lora: DenseLoRAArgs | ExpertLoRAArgs) -> None:
    if lora.active is None:
        raise ValueError("the torch twins need the LoRA batch's per-slot rows (LoRABatch.build(..., rows=True)); "
                         "this batch was built for the Triton kernels only")


def lora_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    lora: DenseLoRAArgs | None, act_quant: Callable | None = None) -> torch.Tensor:
    """y = x @ W^T + bias + (x @ A_s^T @ B_s^T for rows on slot s, per segment). x [T, N_in] -> [T, N_out].
    `act_quant` (the FP8 W8A8 twin, `moelora.quant`): rounds the base GEMM's input; LoRA reads x."""
    y = F.linear(x if act_quant is None else act_quant(x), weight, bias)
    if lora is None:
        return y
    _need_rows(lora)
    sizes = lora.segments or (y.shape[1],)
    r_seg = lora.a.shape[1] // len(sizes)
    for sr in lora.active:
        xs = x.index_select(0, sr.rows)
        deltas, off = [], 0
        for g, n in enumerate(sizes):
            xa = xs @ lora.a[sr.slot, g * r_seg: g * r_seg + sr.rank].to(x.dtype).t()
            deltas.append(xa @ lora.b[sr.slot, off:off + n, : sr.rank].to(x.dtype).t())
            off += n
        y = y.index_add(0, sr.rows, deltas[0] if len(deltas) == 1 else torch.cat(deltas, dim=1))
    return y


def _add_expert_lora(y: torch.Tensor, h: torch.Tensor, slots: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                     ranks: list[int]) -> None:
    """y[rows on slot s] += (h A_s^T) B_s^T, slot by slot (a, b: one expert's [S, R, in] / [S, out, R])."""
    for s in torch.unique(slots).tolist():
        if s >= 0:
            sel = (slots == s).nonzero().squeeze(1)
            y[sel] += (h[sel] @ a[s, :ranks[s]].to(h.dtype).t()) @ b[s, :, :ranks[s]].to(h.dtype).t()


def fused_moe_ref(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  lora: ExpertLoRAArgs | None = None, act_quant: Callable | None = None,
                  expert_map: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H], w_gate_up [E, 2I, H], w_down [E, H, I], topk_weights [T, K], topk_ids [T, K] -> new out [T, H].
    For route (t, k) on expert e with token slot s:
      gu = x_t W_gu[e]^T + (x_t A_gu[s,e]^T) B_gu[s,e]^T;  h = silu(gu[:I]) * gu[I:]
      y  = h W_d[e]^T + (h A_d[s,e]^T) B_d[s,e]^T;         out_t += w_tk * y   (fp32)
    A host loop over experts (syncs on CUDA). `act_quant`: as `lora_linear_ref`'s. `expert_map`
    (`local_expert_ids`): topk_ids global, the weights and LoRA this rank's; another rank's route adds nothing."""
    base_in = (lambda t: t) if act_quant is None else act_quant
    T, H = x.shape
    inter = w_down.shape[2]
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    slot_of_row = None
    if lora is not None:
        _need_rows(lora)
        slot_of_row = torch.full((T,), -1, dtype=torch.long, device=x.device)
        for sr in lora.active:
            slot_of_row[sr.rows] = sr.slot
        gu_ranks, d_ranks = lora.gate_up_ranks.tolist(), lora.down_ranks.tolist()
    flat_ids = (topk_ids if expert_map is None else local_expert_ids(topk_ids, expert_map)).reshape(-1)
    for e in torch.unique(flat_ids).tolist():
        if e < 0:  # another rank's expert
            continue
        route = (flat_ids == e).nonzero().squeeze(1)
        tok = route // topk_ids.shape[1]
        xe = x.index_select(0, tok)
        gu = base_in(xe) @ w_gate_up[e].t()
        if slot_of_row is not None:
            slots = slot_of_row.index_select(0, tok)
            _add_expert_lora(gu, xe, slots, lora.gate_up_a[:, e], lora.gate_up_b[:, e], gu_ranks)
        h = F.silu(gu[:, :inter]) * gu[:, inter:]
        y = base_in(h) @ w_down[e].t()
        if slot_of_row is not None:
            _add_expert_lora(y, h, slots, lora.down_a[:, e], lora.down_b[:, e], d_ranks)
        w = topk_weights.reshape(-1).index_select(0, route).to(torch.float32)
        out.index_add_(0, tok, y.to(torch.float32) * w[:, None])
    return out.to(x.dtype)


def plan_capacity(num_routes: int, num_experts: int, block_m: int) -> tuple[int, int]:
    """(max_padded, max_blocks): each non-empty expert pads at most block_m - 1 rows."""
    worst = num_routes + min(num_experts, num_routes) * (block_m - 1)
    max_blocks = -(-worst // block_m)
    return max_blocks * block_m, max_blocks


def local_expert_ids(topk_ids: torch.Tensor, expert_map: torch.Tensor) -> torch.Tensor:
    """topk_ids [T, K] through expert_map [E_global] int32 (local id, -1: another rank's) -> [T, K] int32 local ids."""
    if expert_map.dim() != 1 or expert_map.dtype != torch.int32 or expert_map.device != topk_ids.device:
        raise ValueError(f"expert_map must be [E] int32 on {topk_ids.device}, got {tuple(expert_map.shape)} "
                         f"{expert_map.dtype} on {expert_map.device}")
    return expert_map.index_select(0, topk_ids.reshape(-1)).view(topk_ids.shape)


def build_routing_plan_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                           expert_map: torch.Tensor | None = None) -> MoERoutingPlan:
    """Torch twin of `moe_plan.build_routing_plan` (bit-identical, no host sync; num_experts local with a map)."""
    T, K = topk_ids.shape
    local = None if expert_map is None else local_expert_ids(topk_ids, expert_map)
    n, dev = T * K, topk_ids.device
    max_padded, max_blocks = plan_capacity(n, num_experts, block_m)
    flat = (topk_ids if local is None else local).reshape(-1).long()
    # a route with no local expert (-1) sorts after every expert, into a scratch tail past max_padded
    key = torch.where(flat >= 0, flat, torch.full_like(flat, num_experts))
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=dev)
    counts.scatter_add_(0, key, torch.ones_like(key))
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    pend = torch.cumsum(padded, 0)
    poff = torch.cat((pend - padded, torch.full((1,), max_padded, dtype=torch.long, device=dev)))
    order = torch.argsort(key, stable=True)
    sorted_e = key.index_select(0, order)
    first = torch.cumsum(counts, 0) - counts
    dest = poff.index_select(0, sorted_e) + torch.arange(n, device=dev) - first.index_select(0, sorted_e)
    sorted_ids = torch.full((max_padded + n,), n, dtype=torch.int32, device=dev)
    sorted_ids.index_copy_(0, dest, order.to(torch.int32))
    total = pend[-1:] if num_experts > 0 else torch.zeros(1, dtype=torch.long, device=dev)
    starts = torch.arange(max_blocks, device=dev) * block_m
    eob = torch.searchsorted(pend, starts, right=True)
    eob = torch.where(starts < total, eob, torch.full_like(eob, -1))
    return MoERoutingPlan(sorted_route_ids=sorted_ids[:max_padded], expert_of_block=eob.to(torch.int32),
                          num_padded=total.to(torch.int32), block_m=block_m, num_tokens=T, top_k=K,
                          num_experts=num_experts, local_ids=local)


def write_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Store the step's k/v [T, N_kv, D] at flat positions `slot_mapping` [T] of the caches [NB, BS, N_kv, D]."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, meta, scale: float) -> torch.Tensor:
    """Causal GQA attention of q [T, N, D] over each sequence's cache after `write_kv_ref` of k/v [T, N_kv, D];
    query i of a sequence sits at position seq_len - q_len + i. -> new [T, N, D]."""
    write_kv_ref(k, v, k_cache, v_cache, meta.slot_mapping)
    T, N, D = q.shape
    bs, n_kv = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    for s in meta.seqs:
        blocks = meta.block_tables[s.table_row, : -(-s.seq_len // bs)].long()
        keys = k_cache.index_select(0, blocks).reshape(-1, n_kv, D)[: s.seq_len]
        vals = v_cache.index_select(0, blocks).reshape(-1, n_kv, D)[: s.seq_len]
        keys = keys.repeat_interleave(N // n_kv, dim=1).transpose(0, 1).to(q.dtype)  # [N, L, D]
        vals = vals.repeat_interleave(N // n_kv, dim=1).transpose(0, 1).to(q.dtype)
        qs = q[s.q_offset:s.q_offset + s.q_len].transpose(0, 1)  # [N, n, D]
        q_pos = torch.arange(s.seq_len - s.q_len, s.seq_len, device=q.device)[:, None]
        mask = torch.arange(s.seq_len, device=q.device)[None, :] <= q_pos
        o = F.scaled_dot_product_attention(qs, keys, vals, attn_mask=mask, scale=scale)
        out[s.q_offset:s.q_offset + s.q_len] = o.transpose(0, 1)
    return out


# ---------------------------------------------------------------------------------------------
# Small fused ops (norm.py, rotary.py, softmax_topk.py, silu_mul.py). D a normalised width, N heads,
# Dr rotary dims. RMSNorm's torch path is `rms_norm_ref` itself.


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] -> x's dtype: fp32 statistics, the normalised row rounded, times the weight, rounded again."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf.to(x.dtype)).to(x.dtype)


def add_rms_norm_ref(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h = x + delta in the dtype, rms_norm_ref(h)): the residual add and the next norm."""
    h = x + delta
    return h, rms_norm_ref(h, weight, eps)


def rotate_half_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary of x [T, N, D] over its first Dr dims (cos/sin [T, Dr] fp32, rounded to x's dtype): `apply_rotary`'s."""
    rd = cos.shape[-1]
    head, tail = x[..., :rd], x[..., rd:]
    half = rd // 2
    rotated = torch.cat((-head[..., half:], head[..., :half]), dim=-1)
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    return torch.cat((head * cos + rotated * sin, tail), dim=-1)


def qk_norm_rope_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Optional per-head RMSNorm (over D) of q [T, Nq, D] and k [T, Nk, D], then rotate-half rotary."""
    if q_weight is not None:
        q, k = rms_norm_ref(q, q_weight, eps), rms_norm_ref(k, k_weight, eps)
    return rotate_half_ref(q, cos, sin), rotate_half_ref(k, cos, sin)


def softmax_topk_ref(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, K] fp32, ids [T, K] int32): softmax in fp32, top k, renormalised."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in the dtype."""
    return F.silu(gate) * up


def mla_decode_attention_ref(q_abs: torch.Tensor, q_rope: torch.Tensor, entries: torch.Tensor,
                             cache: torch.Tensor, meta, scale: float) -> torch.Tensor:
    """Twin of `mla_attention.mla_decode_attention` (shapes there): entries stored at meta.slot_mapping, then
    o_lat = softmax_j(scale * (q_abs . latent_j + q_rope . krot_j)) . latent_j -> new [T, N, C]. No host loop
    or sync: every block-table row is gathered whole and masked past seq_len; fp32 scores (fp64 stays fp64)."""
    T, N, C = q_abs.shape
    width = cache.shape[-1]
    cache.view(-1, width).index_copy_(0, meta.slot_mapping, entries.to(cache.dtype))
    B, MB = meta.block_tables.shape
    acc = torch.promote_types(q_abs.dtype, torch.float32)
    ctx = cache.index_select(0, meta.block_tables.reshape(-1).long()).view(B, -1, width).to(acc)  # [B, L, C + Dr]
    starts = meta.query_start.long()
    rows = starts[:-1].clamp(max=max(T - 1, 0))
    has_query = (starts[1:] > starts[:-1]).to(acc)
    qa, qr = q_abs.index_select(0, rows).to(acc), q_rope.index_select(0, rows).to(acc)  # [B, N, .]
    s = (qa @ ctx[..., :C].transpose(1, 2) + qr @ ctx[..., C:].transpose(1, 2)) * scale  # [B, N, L]
    beyond = torch.arange(ctx.shape[1], device=ctx.device)[None, :] >= meta.seq_lens.long()[:, None]
    p = torch.softmax(s.masked_fill(beyond[:, None, :], float("-inf")), dim=-1)
    o = (p @ ctx[..., :C]) * has_query[:, None, None]  # [B, N, C]
    out = torch.zeros(T, N, C, dtype=acc, device=q_abs.device)
    return out.index_add_(0, rows, o).to(q_abs.dtype)
