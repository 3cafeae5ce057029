"""Paged causal GQA attention over a block KV cache: `paged_attention_ref` on the GPU.

Shape legend: T tokens in the step (sequences concatenated), N query heads, N_kv kv heads (G = N / N_kv), D
head_dim, B sequences, NB cache blocks, BS block size (tokens), MB max blocks per sequence.
  q [T, N, D], k / v [T, N_kv, D]                   the step's new tokens (fp16/bf16/fp32)
  k_cache / v_cache [NB, BS, N_kv, D]               caller-owned `out=` buffers (contiguous, q's dtype)
  meta.slot_mapping [T] int64 (block * BS + offset; < 0: not stored), meta.block_tables [B, MB]
  int32, meta.seq_lens [B] int32 (cached + new), meta.query_start [B + 1] int32   -> out [T, N, D]
Prefill/extend: flash attention, program (query tile, sequence, head). Decode: split-KV, program (sequence, kv
head, split), the G query heads sharing one K/V read; its grid depends on B and N_kv only (CUDA-graph safe).
D is a constexpr: a runtime D's mask blocked vector loads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moelora.kernels.args import FP8Rows
from moelora.kernels.checks import FLOAT_DTYPES, cdiv, need_pow2, next_pow2
from moelora.kernels.fp8_quant import GROUP as FP8_GROUP
from moelora.kernels.fp8_quant import quant_tile
from moelora.kernels.pdl import pdl_args, pdl_wait

NEG_INF = tl.constexpr(-1.0e30)  # finite "minus infinity" for running maxima: keeps exp2(m_old - m_new) NaN-free
_MAX_HEAD_DIM = 256
_DECODE_TARGET_PROGRAMS = 256  # ~2 waves on a 132-SM H200
_MAX_SPLITS = 16


@dataclass(frozen=True)
class AttentionConfig:
    block_m: int = 64  # prefill query rows per program
    block_n: int = 64  # keys per inner step (prefill and decode)
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        need_pow2("AttentionConfig", block_m=self.block_m, block_n=self.block_n)


def default_attention_config(head_dim: int, max_query_len: int, dtype: torch.dtype = torch.bfloat16
                             ) -> AttentionConfig:
    """Starting points (the prefill pick from 256 rows at D <= 128 measured, below); each compiles for sm_90 without
    register spills (ptxas -v, D 16..256)."""
    block_d = max(16, next_pow2(head_dim))
    if dtype == torch.float32:  # a test/reference path: exact fp32 dots run on FMA units, keep tiles small
        return AttentionConfig(16, 32 if block_d <= 32 else 16, num_warps=4)
    block_n = 64 if block_d <= 128 else 32
    if max_query_len <= 32:  # decode and short extends: few query rows per sequence
        return AttentionConfig(max(16, next_pow2(max_query_len)), block_n, num_warps=4)
    if max_query_len >= 256 and block_d <= 128:
        # H200, Qwen3 heads (32 / 4 x 128), benchmarks/attention_prefill.py, µs: 64 x 64, 4 warps, 3 stages against
        # 128 x 64, 8 warps, 2 stages: 1 x 2048 150.9 / 172.5, 4 x 512 61.1 / 66.8, 2048 after 6144 744 / 853, 1 x 8192
        # 1646 / 1827 (128 x 128 x 8 x 3 level at the long ones, 5 % slower at 2048)
        return AttentionConfig(64, block_n, num_warps=4, num_stages=3)
    return AttentionConfig(64, block_n, num_warps=8 if block_d >= 128 else 4)


def default_num_splits(batch: int, num_kv_heads: int) -> int:
    """Decode KV splits: enough programs for ~2 waves, from host ints only (graph-static per B)."""
    want = cdiv(_DECODE_TARGET_PROGRAMS, max(1, batch * num_kv_heads))
    return max(1, min(_MAX_SPLITS, next_pow2(want)))


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, HD: tl.constexpr, D: tl.constexpr,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_slot, stride_ch, BLOCK: tl.constexpr,
                     PDL: tl.constexpr):
    pdl_wait(PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < HD
    head, d = offs // D, offs % D
    t64 = t.to(tl.int64)
    dst = slot * stride_slot + head * stride_ch + d
    k = tl.load(k_ptr + t64 * stride_kt + head * stride_kh + d, mask=mask)
    tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + t64 * stride_vt + head * stride_vh + d, mask=mask)
    tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _kv_rows(bt_row, offs_j, j_mask, kvh, stride_cb, stride_ct, stride_ch, BS: tl.constexpr,
             MASKED: tl.constexpr = True):
    """[BN] int64 cache offsets of keys offs_j of one sequence (through its block-table row); MASKED False: every
    key of offs_j is in the sequence (no predicate on the loads; j_mask None)."""
    if MASKED:
        blk = tl.load(bt_row + offs_j // BS, mask=j_mask, other=0).to(tl.int64)
    else:
        blk = tl.load(bt_row + offs_j // BS).to(tl.int64)
    return blk * stride_cb + (offs_j % BS).to(tl.int64) * stride_ct + kvh * stride_ch


@triton.jit
def _scores(q, kc_ptr, rows, j_mask, offs_d, d_mask, qk_scale, PRECISION: tl.constexpr, MASKED: tl.constexpr = True,
            EVEN_D: tl.constexpr = False):
    """[BM, BN] fp32 log2-domain scores of q [BM, BD] against the gathered keys (MASKED as `_kv_rows`, j_mask None
    without it; EVEN_D: BD is the head dim, no column mask)."""
    ptrs = kc_ptr + rows[None, :] + offs_d[:, None]
    if MASKED:
        kt = tl.load(ptrs, mask=j_mask[None, :] & d_mask[:, None], other=0.0)
    elif EVEN_D:
        kt = tl.load(ptrs)
    else:
        kt = tl.load(ptrs, mask=d_mask[:, None], other=0.0)
    return tl.dot(q, kt.to(q.dtype), input_precision=PRECISION) * qk_scale


@triton.jit
def _softmax_update(s, vc_ptr, rows, j_mask, offs_d, d_mask, m_i, l_i, acc, PRECISION: tl.constexpr,
                    MASKED: tl.constexpr = True, EVEN_D: tl.constexpr = False):
    """One online-softmax step: fold scores s [BM, BN] and the gathered values into (m, l, acc) (masks as
    `_scores`)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    ptrs = vc_ptr + rows[:, None] + offs_d[None, :]
    if MASKED:
        v = tl.load(ptrs, mask=j_mask[:, None] & d_mask[None, :], other=0.0)
    elif EVEN_D:
        v = tl.load(ptrs)
    else:
        v = tl.load(ptrs, mask=d_mask[None, :], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit
def _prefill_kernel(q_ptr, kc_ptr, vc_ptr, out_ptr, bt_ptr, seq_lens_ptr, qstart_ptr, qk_scale, D: tl.constexpr,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_ct, stride_ch, stride_bt,
                    GROUP: tl.constexpr, BS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    # the last query tiles (the most keys under the causal mask) first: the short ones fill the tail
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    b, h = tl.program_id(1), tl.program_id(2)
    q0 = tl.load(qstart_ptr + b)
    q_len = tl.load(qstart_ptr + b + 1) - q0
    if tile * BLOCK_M >= q_len:
        return
    ctx = tl.load(seq_lens_ptr + b) - q_len  # cached prefix; query row i sits at position ctx + i
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask, d_mask = offs_m < q_len, offs_d < D
    tok = (q0 + offs_m).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    kvh = (h // GROUP).to(tl.int64)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    pos = ctx + offs_m
    m_i = tl.full((BLOCK_M,), NEG_INF, tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    # Keys < ctx + tile * BLOCK_M + 1 are visible to every row of the tile and all in the sequence: no causal mask
    # and no predicate on their loads there.
    full_end = (ctx + tile * BLOCK_M + 1) // BLOCK_N * BLOCK_N
    end = ctx + tl.minimum((tile + 1) * BLOCK_M, q_len)
    EVEN_D: tl.constexpr = BLOCK_D == D
    for j0 in range(0, full_end, BLOCK_N):
        offs_j = j0 + tl.arange(0, BLOCK_N)
        rows = _kv_rows(bt_row, offs_j, None, kvh, stride_cb, stride_ct, stride_ch, BS, MASKED=False)
        s = _scores(q, kc_ptr, rows, None, offs_d, d_mask, qk_scale, PRECISION, MASKED=False, EVEN_D=EVEN_D)
        m_i, l_i, acc = _softmax_update(s, vc_ptr, rows, None, offs_d, d_mask, m_i, l_i, acc, PRECISION,
                                        MASKED=False, EVEN_D=EVEN_D)
    for j0 in range(full_end, end, BLOCK_N):
        offs_j = j0 + tl.arange(0, BLOCK_N)
        j_mask = offs_j < end
        rows = _kv_rows(bt_row, offs_j, j_mask, kvh, stride_cb, stride_ct, stride_ch, BS)
        s = _scores(q, kc_ptr, rows, j_mask, offs_d, d_mask, qk_scale, PRECISION)
        s = tl.where((offs_j[None, :] <= pos[:, None]) & j_mask[None, :], s, float("-inf"))
        m_i, l_i, acc = _softmax_update(s, vc_ptr, rows, j_mask, offs_d, d_mask, m_i, l_i, acc, PRECISION)
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + tok[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


@triton.jit
def split_range(seq_lens_ptr, b, split, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """[start, end) of decode split `split` of sequence b (BLOCK_N-aligned; empty past the context)."""
    seq_len = tl.load(seq_lens_ptr + b)
    chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    return start, tl.minimum(start + chunk, seq_len)


@triton.jit
def store_rows_fp8(q8_ptr, s8_ptr, t64, heads, h_mask, offs, o, N, BLOCK: tl.constexpr):
    """The output rows o [heads, BLOCK = D = 128] (as stored) quantized for the W8A8 o projection: one 1 x 128
    group a head, per_token_group_quant's bits, at q8 [T, N * D] e4m3 and s8 [T, N] fp32."""
    q, s = quant_tile(tl.where(h_mask[:, None], o.to(tl.float32), 0.0))
    tl.store(q8_ptr + t64 * N * BLOCK + heads[:, None] * BLOCK + offs[None, :], q, mask=h_mask[:, None])
    tl.store(s8_ptr + t64 * N + heads, s, mask=h_mask)


@triton.jit
def store_split(out_ptr, m_ptr, l_ptr, acc_ptr, t64, heads, h_mask, offs, o_mask, m_i, l_i, acc, b, split, N,
                stride_ot, stride_oh, NUM_SPLITS: tl.constexpr, BLOCK: tl.constexpr, q8_ptr, s8_ptr,
                QUANT: tl.constexpr):
    """A decode program's result: the normalized output with one split (QUANT: also quantized, `store_rows_fp8`),
    else (m, l, acc) partials for the reduce."""
    if NUM_SPLITS == 1:
        o = (acc / tl.where(l_i > 0, l_i, 1.0)[:, None]).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + t64 * stride_ot + heads[:, None] * stride_oh + offs[None, :], o,
                 mask=h_mask[:, None] & o_mask[None, :])
        if QUANT:
            store_rows_fp8(q8_ptr, s8_ptr, t64, heads, h_mask, offs, o, N, BLOCK)
    else:
        part = (b * N + heads).to(tl.int64) * NUM_SPLITS + split
        tl.store(m_ptr + part, m_i, mask=h_mask)
        tl.store(l_ptr + part, l_i, mask=h_mask)
        tl.store(acc_ptr + part[:, None] * BLOCK + offs[None, :], acc, mask=h_mask[:, None])


@triton.jit
def _decode_split_kernel(q_ptr, kc_ptr, vc_ptr, out_ptr, bt_ptr, seq_lens_ptr, qstart_ptr,
                         m_ptr, l_ptr, acc_ptr, qk_scale, D: tl.constexpr, N,
                         stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_ct, stride_ch, stride_bt,
                         NUM_SPLITS: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr, BS: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, q8_ptr, s8_ptr,
                         QUANT: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    b, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q0 = tl.load(qstart_ptr + b)
    if tl.load(qstart_ptr + b + 1) == q0:  # a sequence with no query row this step
        return
    start, end = split_range(seq_lens_ptr, b, split, NUM_SPLITS, BLOCK_N)
    offs_g, offs_d = tl.arange(0, G_PAD), tl.arange(0, BLOCK_D)
    g_mask, d_mask = offs_g < GROUP, offs_d < D
    heads = kvh * GROUP + offs_g
    q = tl.load(q_ptr + q0.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    kvh64 = kvh.to(tl.int64)
    m_i = tl.full((G_PAD,), NEG_INF, tl.float32)
    l_i = tl.zeros((G_PAD,), tl.float32)
    acc = tl.zeros((G_PAD, BLOCK_D), tl.float32)
    for j0 in range(start, end, BLOCK_N):
        offs_j = j0 + tl.arange(0, BLOCK_N)
        j_mask = offs_j < end
        rows = _kv_rows(bt_row, offs_j, j_mask, kvh64, stride_cb, stride_ct, stride_ch, BS)
        s = _scores(q, kc_ptr, rows, j_mask, offs_d, d_mask, qk_scale, PRECISION)
        s = tl.where(j_mask[None, :], s, float("-inf"))
        m_i, l_i, acc = _softmax_update(s, vc_ptr, rows, j_mask, offs_d, d_mask, m_i, l_i, acc, PRECISION)
    store_split(out_ptr, m_ptr, l_ptr, acc_ptr, q0.to(tl.int64), heads, g_mask, offs_d, d_mask, m_i, l_i, acc, b,
                split, N, stride_ot, stride_oh, NUM_SPLITS, BLOCK_D, q8_ptr, s8_ptr, QUANT)


@triton.jit
def decode_reduce_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, qstart_ptr, D: tl.constexpr, N, stride_ot, stride_oh,
                          NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, q8_ptr, s8_ptr,
                          QUANT: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    b, h = tl.program_id(0), tl.program_id(1)
    q0 = tl.load(qstart_ptr + b)
    if tl.load(qstart_ptr + b + 1) == q0:
        return
    offs_s, offs_d = tl.arange(0, BLOCK_S), tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    part = (b * N + h).to(tl.int64) * NUM_SPLITS + offs_s
    m = tl.load(m_ptr + part, mask=s_mask, other=NEG_INF)
    l_s = tl.load(l_ptr + part, mask=s_mask, other=0.0)
    acc = tl.load(acc_ptr + part[:, None] * BLOCK_D + offs_d[None, :], mask=s_mask[:, None], other=0.0)
    w = tl.exp2(m - tl.max(m, 0))  # empty splits have l = 0 and acc = 0: they add nothing
    total = tl.sum(w * l_s, 0)
    o = (tl.sum(w[:, None] * acc, 0) / tl.where(total > 0, total, 1.0)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + q0.to(tl.int64) * stride_ot + h * stride_oh + offs_d, o, mask=offs_d < D)
    if QUANT:
        head = h + tl.arange(0, 1)
        store_rows_fp8(q8_ptr, s8_ptr, q0.to(tl.int64), head, head < N, offs_d, tl.reshape(o, (1, BLOCK_D)), N,
                       BLOCK_D)


def bad(name, t, want):
    raise ValueError(f"{name} must be {want}, got {tuple(t.shape)} {t.dtype} on {t.device}")


def check_meta(meta, T: int, device: torch.device) -> int:
    """The attention metadata of T tokens on `device` (shapes, int dtypes, contiguity) -> B sequences."""
    if meta.block_tables.dim() != 2:
        bad("meta.block_tables", meta.block_tables, "[B, MB] int32")
    B = meta.block_tables.shape[0]
    for name, t, shape, dtype in (("slot_mapping", meta.slot_mapping, (T,), torch.int64),
                                  ("block_tables", meta.block_tables, (B, meta.block_tables.shape[-1]), torch.int32),
                                  ("seq_lens", meta.seq_lens, (B,), torch.int32),
                                  ("query_start", meta.query_start, (B + 1,), torch.int32)):
        if tuple(t.shape) != shape or t.dtype != dtype or t.device != device:
            bad(f"meta.{name}", t, f"{list(shape)} {dtype} on {device}")
    if meta.block_tables.stride(1) != 1 or not meta.seq_lens.is_contiguous() \
            or not meta.query_start.is_contiguous() or not meta.slot_mapping.is_contiguous():
        raise ValueError("meta tensors must be contiguous (block_tables: unit last stride)")
    return B


def _check(q, k, v, k_cache, v_cache, meta, stored: bool = False):
    if q.dim() != 3 or q.dtype not in FLOAT_DTYPES or q.stride(2) != 1:
        bad("q", q, "[T, N, D] fp16/bf16/fp32 with unit last stride")
    T, N, D = q.shape
    if not 1 <= D <= _MAX_HEAD_DIM:
        raise ValueError(f"head_dim D must be in [1, {_MAX_HEAD_DIM}], got {D}")
    if k_cache.dim() != 4 or k_cache.shape[3] != D or k_cache.dtype != q.dtype:
        bad("k_cache", k_cache, f"[NB, BS, N_kv, D={D}] {q.dtype}")
    NB, BS, n_kv, _ = k_cache.shape
    if n_kv < 1 or N % n_kv:
        raise ValueError(f"query heads N={N} must be a multiple of kv heads N_kv={n_kv}")
    if not k_cache.is_contiguous() or k_cache.device != q.device:
        bad("k_cache", k_cache, f"contiguous on {q.device}")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype or not v_cache.is_contiguous() \
            or v_cache.device != q.device:
        bad("v_cache", v_cache, f"contiguous {tuple(k_cache.shape)} {k_cache.dtype} on {q.device}")
    for name, t in (("k", k), ("v", v)):
        if t is None:
            if stored:
                continue
            raise ValueError(f"{name} must be [T={T}, N_kv={n_kv}, D={D}] {q.dtype}, got None (kv_stored=False)")
        if tuple(t.shape) != (T, n_kv, D) or t.dtype != q.dtype or t.stride(2) != 1 or t.device != q.device:
            bad(name, t, f"[T={T}, N_kv={n_kv}, D={D}] {q.dtype} with unit last stride on {q.device}")
    if k_cache.untyped_storage().data_ptr() == v_cache.untyped_storage().data_ptr():
        raise ValueError("k_cache and v_cache must not share storage")
    B = check_meta(meta, T, q.device)
    if T > 0 and meta.max_query_len < 1:
        raise ValueError(f"meta.max_query_len must be >= 1 for T={T} tokens, got {meta.max_query_len}")
    return T, N, D, B, BS, n_kv


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta, scale: float, *, config: AttentionConfig | None = None,
                    num_splits: int | None = None, kv_stored: bool = False, pdl: bool = False) -> torch.Tensor:
    """Store k/v at meta.slot_mapping, then causal paged attention -> new [T, N, D] (graphs: fixed `num_splits`);
    `kv_stored`: the step's k / v are in the cache already (`rotary.qk_norm_rope`'s kv_store; k, v may be None);
    `pdl`: programmatic dependent launch where the GPU has it (`kernels.pdl`)."""
    return _attention(q, k, v, k_cache, v_cache, meta, scale, config, num_splits, False, kv_stored, pdl)[0]


def paged_attention_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, meta, scale: float, *, config: AttentionConfig | None = None,
                        num_splits: int | None = None, kv_stored: bool = False, pdl: bool = False
                        ) -> tuple[torch.Tensor, FP8Rows | None]:
    """`paged_attention` (`kv_stored`, `pdl` as there) and, on a decode step with D = 128, its output rows
    [T, N * D] quantized for the W8A8 o projection by the kernel that writes them (one group a head); None
    otherwise (the projection quantizes)."""
    return _attention(q, k, v, k_cache, v_cache, meta, scale, config, num_splits, True, kv_stored, pdl)


def _attention(q, k, v, k_cache, v_cache, meta, scale, config, num_splits, want_rows: bool, stored: bool,
               pdl: bool):
    T, N, D, B, BS, n_kv = _check(q, k, v, k_cache, v_cache, meta, stored)
    splits = default_num_splits(B, n_kv) if num_splits is None else num_splits
    if splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {splits}")
    out = torch.empty(T, N, D, dtype=q.dtype, device=q.device)
    rows = None
    if want_rows and D == FP8_GROUP and meta.max_query_len == 1:
        rows = FP8Rows(torch.empty(T, N * D, dtype=torch.float8_e4m3fn, device=q.device),
                       torch.empty(T, N, dtype=torch.float32, device=q.device))
    if T == 0 or B == 0:
        return out, rows
    if not stored:
        hd = n_kv * D
        store_block = min(1024, next_pow2(hd))
        _store_kv_kernel[(T, cdiv(hd, store_block))](
            k, v, k_cache, v_cache, meta.slot_mapping, hd, D, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            k_cache.stride(1), k_cache.stride(2), BLOCK=store_block, **pdl_args(pdl, q))
    cfg = config or default_attention_config(D, meta.max_query_len, q.dtype)
    block_d = max(16, next_pow2(D))
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit inputs
    qk_scale = float(scale) * math.log2(math.e)
    group = N // n_kv
    cache_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), meta.block_tables.stride(0))
    launch = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(pdl, q))
    if meta.max_query_len > 1:
        grid = (cdiv(meta.max_query_len, cfg.block_m), B, N)
        _prefill_kernel[grid](
            q, k_cache, v_cache, out, meta.block_tables, meta.seq_lens, meta.query_start, qk_scale, D,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), *cache_strides, GROUP=group, BS=BS,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d, PRECISION=precision, **launch)
        return out, rows
    m_part = l_part = acc_part = out  # placeholders; unused when splits == 1
    if splits > 1:
        m_part = torch.empty(B, N, splits, dtype=torch.float32, device=q.device)
        l_part = torch.empty_like(m_part)
        acc_part = torch.empty(B, N, splits, block_d, dtype=torch.float32, device=q.device)
    q8, s8 = rows if rows is not None else (out, out)
    _decode_split_kernel[(B, n_kv, splits)](
        q, k_cache, v_cache, out, meta.block_tables, meta.seq_lens, meta.query_start, m_part, l_part, acc_part,
        qk_scale, D, N, q.stride(0), q.stride(1), out.stride(0), out.stride(1), *cache_strides,
        NUM_SPLITS=splits, GROUP=group, G_PAD=max(16, next_pow2(group)), BS=BS,
        BLOCK_N=cfg.block_n, BLOCK_D=block_d, PRECISION=precision, q8_ptr=q8, s8_ptr=s8,
        QUANT=rows is not None and splits == 1, **launch)
    if splits > 1:
        decode_reduce_kernel[(B, N)](
            m_part, l_part, acc_part, out, meta.query_start, D, N, out.stride(0), out.stride(1),
            NUM_SPLITS=splits, BLOCK_S=max(2, next_pow2(splits)), BLOCK_D=block_d, q8_ptr=q8, s8_ptr=s8,
            QUANT=rows is not None, num_warps=4, **pdl_args(pdl, q))
    return out, rows
