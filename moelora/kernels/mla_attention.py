"""Paged MLA decode attention on the latent cache (weights absorbed): `mla_decode_attention_ref` on the GPU.

Shape legend: T tokens, N heads, C kv_lora_rank (latent width), Dr rotary key width, NB cache blocks, BS block
size (tokens), HB heads a program.
  q_abs [T, N, C]     query nope part absorbed through kv_b_proj's key half (W_uk and its LoRA)
  q_rope [T, N, Dr]   rotated query rope part                       (fp16/bf16/fp32, unit last stride)
  entries [T, C + Dr] the step's new cache entries: normalised latent, rotated single-head key
  cache [NB, BS, C + Dr]  caller-owned `out=` buffer (contiguous, q's dtype)
  meta as `attention.py`'s; decode only (meta.max_query_len == 1)   -> o_lat [T, N, C] in q's dtype
Split-KV decode as `attention.py`'s, program (sequence, HB heads, split): all heads attend to one latent (MQA
of width C + Dr), so one latent tile serves the scores and the values of HB heads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moelora.kernels.attention import (
    NEG_INF,
    bad,
    check_meta,
    decode_reduce_kernel,
    default_num_splits,
    split_range,
    store_split,
)
from moelora.kernels.checks import FLOAT_DTYPES, cdiv, need_pow2, next_pow2
from moelora.kernels.pdl import pdl_args, pdl_wait

_MAX_LATENT = 1024
_MAX_ROPE = 256


@dataclass(frozen=True)
class MLAConfig:
    block_h: int = 16  # heads per program (rows of the dots)
    block_n: int = 32  # cached positions per inner step
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        need_pow2("MLAConfig", block_h=self.block_h, block_n=self.block_n)


def default_mla_config(num_heads: int, latent: int, dtype: torch.dtype = torch.bfloat16, batch: int = 1
                       ) -> MLAConfig:
    """Starting points from one H200 sweep (docs/performance.md, attention), from shapes only (graph-safe)."""
    if dtype == torch.float32:
        return MLAConfig(16, 16, num_warps=4)
    block_h = min(64, max(16, next_pow2(num_heads))) if batch >= 8 else 16
    if max(16, next_pow2(latent)) > 128:
        return MLAConfig(block_h, 64, num_warps=8)
    return MLAConfig(block_h, 64, num_warps=4)


@triton.jit
def _store_latent_kernel(e_ptr, cache_ptr, slot_ptr, W, stride_et, stride_slot, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    pdl_wait(PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < W
    e = tl.load(e_ptr + t.to(tl.int64) * stride_et + offs, mask=mask)
    tl.store(cache_ptr + slot * stride_slot + offs, e.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _mla_split_kernel(qa_ptr, qr_ptr, cache_ptr, out_ptr, bt_ptr, seq_lens_ptr, qstart_ptr,
                      m_ptr, l_ptr, acc_ptr, qk_scale, N,
                      stride_qat, stride_qah, stride_qrt, stride_qrh, stride_ot, stride_oh,
                      stride_cb, stride_ct, stride_bt,
                      C: tl.constexpr, DR: tl.constexpr, NUM_SPLITS: tl.constexpr, BS: tl.constexpr,
                      BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
                      PRECISION: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    b, hb, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q0 = tl.load(qstart_ptr + b)
    if tl.load(qstart_ptr + b + 1) == q0:  # a sequence with no query row this step
        return
    start, end = split_range(seq_lens_ptr, b, split, NUM_SPLITS, BLOCK_N)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_c, offs_r = tl.arange(0, BLOCK_C), tl.arange(0, BLOCK_R)
    h_mask, c_mask, r_mask = heads < N, offs_c < C, offs_r < DR
    t64 = q0.to(tl.int64)
    qa = tl.load(qa_ptr + t64 * stride_qat + heads[:, None] * stride_qah + offs_c[None, :],
                 mask=h_mask[:, None] & c_mask[None, :], other=0.0)
    qr = tl.load(qr_ptr + t64 * stride_qrt + heads[:, None] * stride_qrh + offs_r[None, :],
                 mask=h_mask[:, None] & r_mask[None, :], other=0.0)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    m_i = tl.full((BLOCK_H,), NEG_INF, tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_C), tl.float32)
    for j0 in range(start, end, BLOCK_N):
        offs_j = j0 + tl.arange(0, BLOCK_N)
        j_mask = offs_j < end
        blk = tl.load(bt_row + offs_j // BS, mask=j_mask, other=0).to(tl.int64)
        rows = blk * stride_cb + (offs_j % BS).to(tl.int64) * stride_ct
        lat = tl.load(cache_ptr + rows[:, None] + offs_c[None, :], mask=j_mask[:, None] & c_mask[None, :],
                      other=0.0)  # [BN, BC]: keys (scores) and values (output) alike
        krot = tl.load(cache_ptr + rows[:, None] + C + offs_r[None, :], mask=j_mask[:, None] & r_mask[None, :],
                       other=0.0)
        s = tl.dot(qa, tl.trans(lat.to(qa.dtype)), input_precision=PRECISION)
        s += tl.dot(qr, tl.trans(krot.to(qr.dtype)), input_precision=PRECISION)
        s = tl.where(j_mask[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        acc = acc * alpha[:, None] + tl.dot(p.to(lat.dtype), lat, input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    store_split(out_ptr, m_ptr, l_ptr, acc_ptr, t64, heads, h_mask, offs_c, c_mask, m_i, l_i, acc, b, split, N,
                stride_ot, stride_oh, NUM_SPLITS, BLOCK_C, out_ptr, out_ptr, False)


def _check(q_abs, q_rope, entries, cache, meta, stored: bool = False):
    if q_abs.dim() != 3 or q_abs.dtype not in FLOAT_DTYPES or q_abs.stride(2) != 1:
        bad("q_abs", q_abs, "[T, N, C] fp16/bf16/fp32 with unit last stride")
    T, N, C = q_abs.shape
    dev, dt = q_abs.device, q_abs.dtype
    if q_rope.dim() != 3 or tuple(q_rope.shape[:2]) != (T, N) or q_rope.dtype != dt or q_rope.stride(2) != 1 \
            or q_rope.device != dev:
        bad("q_rope", q_rope, f"[T={T}, N={N}, Dr] {dt} with unit last stride on {dev}")
    Dr = q_rope.shape[2]
    if not 1 <= C <= _MAX_LATENT or not 1 <= Dr <= _MAX_ROPE:
        raise ValueError(f"latent width C must be in [1, {_MAX_LATENT}] and rope width Dr in [1, {_MAX_ROPE}], "
                         f"got C={C}, Dr={Dr}")
    if N < 1:
        raise ValueError(f"need at least one head, got N={N}")
    if entries is None and not stored:
        raise ValueError(f"entries must be [T={T}, C+Dr={C + Dr}] {dt}, got None (stored=False)")
    if entries is not None and (tuple(entries.shape) != (T, C + Dr) or entries.dtype != dt or entries.stride(1) != 1
                                or entries.device != dev):
        bad("entries", entries, f"[T={T}, C+Dr={C + Dr}] {dt} with unit last stride on {dev}")
    if cache.dim() != 3 or cache.shape[2] != C + Dr or cache.dtype != dt or not cache.is_contiguous() \
            or cache.device != dev:
        bad("cache", cache, f"contiguous [NB, BS, C+Dr={C + Dr}] {dt} on {dev}")
    B = check_meta(meta, T, dev)
    if T > 0 and meta.max_query_len != 1:
        raise ValueError(f"mla_decode_attention is decode only (one query per sequence): meta.max_query_len "
                         f"must be 1, got {meta.max_query_len}")
    return T, N, C, Dr, B


def mla_decode_attention(q_abs: torch.Tensor, q_rope: torch.Tensor, entries: torch.Tensor | None,
                         cache: torch.Tensor, meta, scale: float, *, config: MLAConfig | None = None,
                         num_splits: int | None = None, stored: bool = False, pdl: bool = False) -> torch.Tensor:
    """Store `entries` at meta.slot_mapping, then decode MLA over the latent cache -> new o_lat [T, N, C];
    `stored`: the entries are in the cache already (`mla_rope.mla_rope_store`; entries may be None); `pdl`:
    programmatic dependent launch where the GPU has it (`kernels.pdl`)."""
    T, N, C, Dr, B = _check(q_abs, q_rope, entries, cache, meta, stored)
    cfg = config or default_mla_config(N, C, q_abs.dtype, B)
    head_blocks = cdiv(N, cfg.block_h)
    splits = default_num_splits(B, head_blocks) if num_splits is None else num_splits
    if splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {splits}")
    out = torch.empty(T, N, C, dtype=q_abs.dtype, device=q_abs.device)
    if T == 0 or B == 0:
        return out
    if not stored:
        W = C + Dr
        store_block = min(1024, next_pow2(W))
        _store_latent_kernel[(T, cdiv(W, store_block))](
            entries, cache, meta.slot_mapping, W, entries.stride(0), cache.stride(1), BLOCK=store_block,
            **pdl_args(pdl, entries))
    block_c = max(16, next_pow2(C))
    m_part = l_part = acc_part = out  # placeholders; unused when splits == 1
    if splits > 1:
        m_part = torch.empty(B, N, splits, dtype=torch.float32, device=q_abs.device)
        l_part = torch.empty_like(m_part)
        acc_part = torch.empty(B, N, splits, block_c, dtype=torch.float32, device=q_abs.device)
    _mla_split_kernel[(B, head_blocks, splits)](
        q_abs, q_rope, cache, out, meta.block_tables, meta.seq_lens, meta.query_start, m_part, l_part, acc_part,
        float(scale) * math.log2(math.e), N, q_abs.stride(0), q_abs.stride(1), q_rope.stride(0), q_rope.stride(1),
        out.stride(0), out.stride(1), cache.stride(0), cache.stride(1), meta.block_tables.stride(0),
        C=C, DR=Dr, NUM_SPLITS=splits, BS=cache.shape[1], BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n,
        BLOCK_C=block_c, BLOCK_R=max(16, next_pow2(Dr)),
        PRECISION="ieee" if q_abs.dtype == torch.float32 else "tf32",  # tf32 is ignored for 16-bit inputs
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(pdl, q_abs))
    if splits > 1:
        decode_reduce_kernel[(B, N)](
            m_part, l_part, acc_part, out, meta.query_start, C, N, out.stride(0), out.stride(1),
            NUM_SPLITS=splits, BLOCK_S=max(2, next_pow2(splits)), BLOCK_D=block_c, q8_ptr=out, s8_ptr=out,
            QUANT=False, num_warps=4, **pdl_args(pdl, q_abs))
    return out
