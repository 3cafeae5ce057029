"""MLA prefill attention in one launch: every sequence's queries over its expanded context, causal, each head's
key its expanded nope part beside the one rotated key the heads share, read where they lie (never concatenated).

Shape legend: T query rows of the step (sequences concatenated), L context rows (sequences concatenated), N heads,
Dn / Dr / Dv nope / rope / value widths, B sequences.
  q [T, N, Dn + Dr]       the step's queries, rope part rotated
  kv [L, N, Dn + Dv]      kv_b_proj's output on the context latents, viewed per head: (k_nope, v)
  k_rope [L, Dr]          the rotated key of each context row (a column slice of the latents' rows)
  seq_lens [B] int32 (cached + new), query_start [B + 1] int32, kv_start [B] int32 (sequence b's first row of kv)
  -> out [T, N, Dv] (new)
Query row i of sequence b sits at position seq_lens[b] - q_len_b + i and sees context rows 0 .. that position of
its sequence: score = scale (q_nope . k_nope + q_rope . k_rope), two tensor-core dots into one accumulator.

Why: the expanded MLA prefill built each head's keys by a copy (`kernels.mla_keys`, 22.7 us a DeepSeek-V2-Lite
layer at 8192 rows) and attended by a host loop over the sequences, torch's SDPA each time: ~15 ATen ops a sequence
a layer (`benchmarks/launch_count.py --model dsv2`, 4 prompts: 109 ops a layer, 49 with this kernel; Qwen3's layer,
whose paged attention is one launch, 32). This kernel is one launch a layer whatever the number of sequences, and
reads the shared rotated key once a row instead of writing it N times and reading it back.

Program (query tile, sequence, head), the first axis walked from its last tile: under the causal mask the last
tiles of a sequence see the most keys, so they start first. Flash attention (online softmax in the log2 domain);
key blocks every row of the tile sees in full take no mask.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from moelora.kernels.attention import NEG_INF, AttentionConfig
from moelora.kernels.checks import FLOAT_DTYPES, cdiv, need, next_pow2


def default_mla_prefill_config(max_query_len: int, dtype: torch.dtype) -> AttentionConfig:
    """Untuned starting points (Dn 128, Dr 64, Dv 128: each compiles for sm_90 without local memory); fp32 is a
    test / reference path on FMA units: small tiles."""
    if dtype == torch.float32:
        return AttentionConfig(16, 16, num_warps=4)
    if max_query_len >= 256:
        return AttentionConfig(128, 64, num_warps=8, num_stages=3)
    return AttentionConfig(max(16, min(64, next_pow2(max_query_len))), 64, num_warps=4)


@triton.jit
def _key_block(q_nope, q_rope, kv_head, kr_ptr, k0, j0, end, pos, m_i, l_i, acc, qk_scale, stride_kvl, stride_krl,
               dn, dr, dv, dn_mask, dr_mask, dv_mask, DN: tl.constexpr, BLOCK_N: tl.constexpr,
               MASKED: tl.constexpr, PRECISION: tl.constexpr):
    """Fold the keys [j0, j0 + BLOCK_N) of one sequence (rows k0 + j of kv / k_rope) into (m, l, acc); MASKED: the
    block holds keys past `end` or past some row's position."""
    offs_j = j0 + tl.arange(0, BLOCK_N)
    rows = k0 + offs_j  # int64: k0 is
    j_mask = offs_j < end
    if not MASKED:  # every key of the block is in the sequence: the loads mask the widths' padding only
        j_mask = tl.full((BLOCK_N,), True, tl.int1)
    kn = tl.load(kv_head + rows[None, :] * stride_kvl + dn[:, None], mask=j_mask[None, :] & dn_mask[:, None],
                 other=0.0)
    kr = tl.load(kr_ptr + rows[None, :] * stride_krl + dr[:, None], mask=j_mask[None, :] & dr_mask[:, None],
                 other=0.0)
    s = tl.dot(q_nope, kn, input_precision=PRECISION)
    s = tl.dot(q_rope, kr, s, input_precision=PRECISION) * qk_scale
    if MASKED:
        s = tl.where((offs_j[None, :] <= pos[:, None]) & j_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    v = tl.load(kv_head + rows[:, None] * stride_kvl + DN + dv[None, :], mask=j_mask[:, None] & dv_mask[None, :],
                other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit
def _mla_prefill_kernel(q_ptr, kv_ptr, kr_ptr, out_ptr, seq_lens_ptr, qstart_ptr, kvstart_ptr, qk_scale,
                        stride_qt, stride_qh, stride_kvl, stride_kvh, stride_krl, stride_ot, stride_oh,
                        DN: tl.constexpr, DR: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_DN: tl.constexpr, BLOCK_DR: tl.constexpr,
                        BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr):
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    b, h = tl.program_id(1), tl.program_id(2)
    q0 = tl.load(qstart_ptr + b)
    q_len = tl.load(qstart_ptr + b + 1) - q0
    if tile * BLOCK_M >= q_len:
        return
    ctx = tl.load(seq_lens_ptr + b) - q_len  # cached prefix: query row i sits at position ctx + i
    k0 = tl.load(kvstart_ptr + b).to(tl.int64)
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < q_len
    dn, dr, dv = tl.arange(0, BLOCK_DN), tl.arange(0, BLOCK_DR), tl.arange(0, BLOCK_DV)
    dn_mask, dr_mask, dv_mask = dn < DN, dr < DR, dv < DV
    tok = (q0 + offs_m).to(tl.int64)
    q_rows = q_ptr + tok[:, None] * stride_qt + h * stride_qh
    q_nope = tl.load(q_rows + dn[None, :], mask=m_mask[:, None] & dn_mask[None, :], other=0.0)
    q_rope = tl.load(q_rows + DN + dr[None, :], mask=m_mask[:, None] & dr_mask[None, :], other=0.0)
    kv_head = kv_ptr + h.to(tl.int64) * stride_kvh
    pos = ctx + offs_m
    m_i = tl.full((BLOCK_M,), NEG_INF, tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    # Keys < ctx + tile * BLOCK_M + 1 are visible to every row of the tile: no mask there.
    full_end = (ctx + tile * BLOCK_M + 1) // BLOCK_N * BLOCK_N
    end = ctx + tl.minimum((tile + 1) * BLOCK_M, q_len)
    for j0 in range(0, full_end, BLOCK_N):
        m_i, l_i, acc = _key_block(q_nope, q_rope, kv_head, kr_ptr, k0, j0, end, pos, m_i, l_i, acc, qk_scale,
                                   stride_kvl, stride_krl, dn, dr, dv, dn_mask, dr_mask, dv_mask, DN, BLOCK_N,
                                   False, PRECISION)
    for j0 in range(full_end, end, BLOCK_N):
        m_i, l_i, acc = _key_block(q_nope, q_rope, kv_head, kr_ptr, k0, j0, end, pos, m_i, l_i, acc, qk_scale,
                                   stride_kvl, stride_krl, dn, dr, dv, dn_mask, dr_mask, dv_mask, DN, BLOCK_N,
                                   True, PRECISION)
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + tok[:, None] * stride_ot + h * stride_oh + dv[None, :], o.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & dv_mask[None, :])


def _check(q, kv, k_rope, seq_lens, query_start, kv_start, nope):
    need(q.dim() == 3 and q.dtype in FLOAT_DTYPES and q.stride(2) == 1,
         lambda: f"q must be [T, N, Dn + Dr] fp16/bf16/fp32 with unit last stride, got {tuple(q.shape)} {q.dtype}")
    T, N, width = q.shape
    need(0 < nope < width, lambda: f"nope={nope} must be in 1..{width - 1} (q's width {width} is nope + Dr)")
    need(kv.dim() == 3 and kv.shape[1] == N and kv.shape[2] > nope and kv.dtype == q.dtype and kv.stride(2) == 1
         and kv.device == q.device,
         lambda: f"kv must be [L, N={N}, nope={nope} + Dv] {q.dtype} on {q.device} with unit last stride, got "
                 f"{tuple(kv.shape)} {kv.dtype} on {kv.device}")
    need(k_rope.dim() == 2 and k_rope.shape == (kv.shape[0], width - nope) and k_rope.dtype == q.dtype
         and k_rope.stride(1) == 1 and k_rope.device == q.device,
         lambda: f"k_rope must be [L={kv.shape[0]}, Dr={width - nope}] {q.dtype} on {q.device} with unit last "
                 f"stride, got {tuple(k_rope.shape)} {k_rope.dtype} on {k_rope.device}")
    B = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    for name, t, n in (("seq_lens", seq_lens, B), ("query_start", query_start, B + 1), ("kv_start", kv_start, B)):
        need(t.dim() == 1 and t.shape[0] == n and t.dtype == torch.int32 and t.device == q.device,
             lambda name=name, t=t, n=n: f"{name} must be [{n}] int32 on {q.device}, got {tuple(t.shape)} {t.dtype} "
                                         f"on {t.device}")
    return T, N, kv.shape[2] - nope, width - nope, B


def mla_prefill_attention(q: torch.Tensor, kv: torch.Tensor, k_rope: torch.Tensor, seq_lens: torch.Tensor,
                          query_start: torch.Tensor, kv_start: torch.Tensor, nope: int, scale: float,
                          max_query_len: int, config: AttentionConfig | None = None) -> torch.Tensor:
    """Causal MLA of the step's queries over their sequences' expanded context (module docstring); every input
    only read. `max_query_len`: the longest q_len (a host int: the grid); sequence b's context rows are
    kv_start[b] .. kv_start[b] + seq_lens[b] - 1, its query rows query_start[b] .. query_start[b + 1] - 1."""
    T, N, Dv, Dr, B = _check(q, kv, k_rope, seq_lens, query_start, kv_start, nope)
    out = torch.empty(T, N, Dv, dtype=q.dtype, device=q.device)
    if T == 0 or B == 0 or N == 0 or max_query_len <= 0:
        return out
    cfg = config or default_mla_prefill_config(max_query_len, q.dtype)
    _mla_prefill_kernel[(cdiv(max_query_len, cfg.block_m), B, N)](
        q, kv, k_rope, out, seq_lens, query_start, kv_start, float(scale) * math.log2(math.e),
        q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), k_rope.stride(0), out.stride(0), out.stride(1),
        DN=nope, DR=Dr, DV=Dv, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_DN=max(16, next_pow2(nope)),
        BLOCK_DR=max(16, next_pow2(Dr)), BLOCK_DV=max(16, next_pow2(Dv)),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return out
