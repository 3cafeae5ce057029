"""Fused per-head q/k RMSNorm + rotary (rotate-half, full or partial), q and k in one launch.

Shape legend: T tokens, Nq / Nk query / key heads, D head_dim, Dr rotary dims (even, <= D), NB x BS cache slots.
  qk_norm_rope(q [T, Nq, D], k [T, Nk, D], cos [T, Dr] fp32, sin [T, Dr] fp32,
               q_weight [D] | None, k_weight [D] | None, eps) -> (q_out [T, Nq, D], k_out [T, Nk, D])
Each head RMS-normalised over D when its weight is given, then its first Dr dims rotated: `qk_norm_rope_ref`.
`kv_store=KVStore(v [T, Nk, D], k_cache, v_cache [NB, BS, Nk, D], slot_mapping [T])`: the same launch writes the
rotated k and v itself into the paged cache at each token's slot (< 0: not stored), as the attention's store
kernel would (`kernels.attention`, then called with `kv_stored=True`), and returns (q_out, None): one launch a
layer less.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from moelora.kernels.checks import cdiv, check_rows, check_vector, need, next_pow2, output
from moelora.kernels.pdl import pdl_args, pdl_wait
from moelora.kernels.rounding import round_to


class KVStore(NamedTuple):
    """Where `qk_norm_rope` also writes the step's k (rotated) and v: the paged cache at `slot_mapping`."""
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor


@triton.jit
def _norm_rope_heads(x_ptr, o_ptr, w_ptr, cos_ptr, sin_ptr, t, t_out, hb, N, D, DR, stride_xt, stride_xh,
                     stride_ot, stride_oh, stride_ct, stride_st, eps,
                     HAS_NORM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Heads [hb BLOCK_H, ..) of token t: x -> o at row t_out (t, or a cache slot)."""
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    half = DR // 2
    rot = d < DR
    partner = tl.where(d < half, d + half, d - half)
    mask = (heads < N)[:, None] & (d < D)[None, :]
    rmask = mask & rot[None, :]
    row = x_ptr + t * stride_xt + heads[:, None].to(tl.int64) * stride_xh
    x = tl.load(row + d[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(row + partner[None, :], mask=rmask, other=0.0).to(tl.float32)
    if HAS_NORM:
        scale = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
        w = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)[None, :]
        wp = tl.load(w_ptr + partner, mask=rot, other=0.0).to(tl.float32)[None, :]
        x = round_to(w * round_to(x * scale, o_ptr), o_ptr)
        xp = round_to(wp * round_to(xp * scale, o_ptr), o_ptr)
    c = round_to(tl.load(cos_ptr + t * stride_ct + d, mask=rot, other=0.0), o_ptr)[None, :]
    s = round_to(tl.load(sin_ptr + t * stride_st + d, mask=rot, other=0.0), o_ptr)[None, :]
    xp = tl.where((d < half)[None, :], -xp, xp)
    y = round_to(round_to(x * c, o_ptr) + round_to(xp * s, o_ptr), o_ptr)
    y = tl.where(rot[None, :], y, x)
    out = o_ptr + t_out * stride_ot + heads[:, None].to(tl.int64) * stride_oh + d[None, :]
    tl.store(out, y.to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, v_ptr, vc_ptr, slot_ptr,
                         NQ, NK, D, DR, stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh,
                         stride_kot, stride_koh, stride_ct, stride_st, stride_vt, stride_vh, eps,
                         HAS_NORM: tl.constexpr, STORE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                         PDL: tl.constexpr):
    """Program (t, b): q head block b, else k head block b - q blocks, else (STORE) v head block. STORE: ko is the
    k cache and k / v rows go to row slot_mapping[t] of the caches (stride_kot / stride_koh: the caches'
    slot and head strides), nowhere when the slot is < 0."""
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    q_blocks = tl.cdiv(NQ, BLOCK_H)
    k_blocks = tl.cdiv(NK, BLOCK_H)
    if b < q_blocks:
        _norm_rope_heads(q_ptr, qo_ptr, qw_ptr, cos_ptr, sin_ptr, t, t, b, NQ, D, DR, stride_qt, stride_qh,
                         stride_qot, stride_qoh, stride_ct, stride_st, eps, HAS_NORM, BLOCK_H, BLOCK_D)
    else:
        t_out = t
        if STORE:
            t_out = tl.load(slot_ptr + t).to(tl.int64)
        if t_out >= 0:
            if b < q_blocks + k_blocks:
                _norm_rope_heads(k_ptr, ko_ptr, kw_ptr, cos_ptr, sin_ptr, t, t_out, b - q_blocks, NK, D, DR,
                                 stride_kt, stride_kh, stride_kot, stride_koh, stride_ct, stride_st, eps, HAS_NORM,
                                 BLOCK_H, BLOCK_D)
            else:  # STORE: v as it is, into the v cache
                heads = (b - q_blocks - k_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
                d = tl.arange(0, BLOCK_D)
                mask = (heads < NK)[:, None] & (d < D)[None, :]
                v = tl.load(v_ptr + t * stride_vt + heads[:, None].to(tl.int64) * stride_vh + d[None, :], mask=mask)
                dst = vc_ptr + t_out * stride_kot + heads[:, None].to(tl.int64) * stride_koh + d[None, :]
                tl.store(dst, v.to(vc_ptr.dtype.element_ty), mask=mask)


def _check(q, k, cos, sin, q_weight, k_weight) -> tuple[int, int, int, int, int]:
    need(q.dim() == 3 and k.dim() == 3, lambda: f"q, k must be [T, N, D], got {tuple(q.shape)}, {tuple(k.shape)}")
    T, NQ, D = q.shape
    NK = k.shape[1]
    check_rows("q", q)
    check_rows("k", k, (T, NK, D), q.dtype)
    need(cos.dim() == 2 and cos.shape[0] == T, lambda: f"cos must be [T={T}, Dr], got {tuple(cos.shape)}")
    DR = cos.shape[1]
    need(0 < DR <= D and DR % 2 == 0, f"rotary dims Dr={DR} must be even and in (0, D={D}]")
    for name, t in (("cos", cos), ("sin", sin)):
        check_rows(name, t, (T, DR), torch.float32)
    need((q_weight is None) == (k_weight is None), "q_weight and k_weight must both be given or both None")
    if q_weight is not None:
        check_vector("q_weight", q_weight, D, q.device)
        check_vector("k_weight", k_weight, D, q.device)
    need(all(t.device == q.device for t in (k, cos, sin)), f"all inputs must be on {q.device}")
    return T, NQ, NK, D, DR


def _check_store(store: KVStore, T: int, NK: int, D: int, q: torch.Tensor) -> None:
    v, k_cache, v_cache, slots = store
    check_rows("kv_store.v", v, (T, NK, D), q.dtype)
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        need(c.dim() == 4 and c.shape[2:] == (NK, D) and c.dtype == q.dtype and c.is_contiguous()
             and c.device == q.device, lambda c=c, name=name: f"kv_store.{name} must be contiguous [NB, BS, Nk={NK}, "
             f"D={D}] {q.dtype} on {q.device}, got {tuple(c.shape)} {c.dtype} on {c.device}")
    need(v_cache.shape == k_cache.shape, lambda: f"kv_store.v_cache must be {tuple(k_cache.shape)}, got "
         f"{tuple(v_cache.shape)}")
    need(k_cache.untyped_storage().data_ptr() != v_cache.untyped_storage().data_ptr(),
         "kv_store.k_cache and v_cache must not share storage")
    need(tuple(slots.shape) == (T,) and slots.dtype in (torch.int32, torch.int64) and slots.device == q.device,
         lambda: f"kv_store.slot_mapping must be [T={T}] int32/int64 on {q.device}, got {tuple(slots.shape)} "
         f"{slots.dtype}")


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float, *,
                 out: tuple[torch.Tensor, torch.Tensor] | None = None, kv_store: KVStore | None = None,
                 pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(q_out, k_out): optional per-head RMSNorm, then rotary, of q and k (only read); `out`: the caller's buffers;
    `kv_store`: k (rotated) and v written into the paged cache instead, k_out None (module docstring); `pdl`:
    programmatic dependent launch where the GPU has it (`kernels.pdl`)."""
    T, NQ, NK, D, DR = _check(q, k, cos, sin, q_weight, k_weight)
    qo_buf, ko_buf = out if out is not None else (None, None)
    inputs = (q, k, cos, sin, q_weight, k_weight)
    q_out = output(qo_buf, (T, NQ, D), q.dtype, q.device, inputs, "out[0]")
    if kv_store is not None:
        need(ko_buf is None, "out[1] must be None with kv_store (k goes to the cache)")
        _check_store(kv_store, T, NK, D, q)
        k_out = None
        k_dst, v, v_dst, slots = kv_store.k_cache, kv_store.v, kv_store.v_cache, kv_store.slot_mapping
        dst_strides = (k_dst.stride(1), k_dst.stride(2))
    else:
        k_out = output(ko_buf, (T, NK, D), q.dtype, q.device, inputs + (q_out,), "out[1]")
        k_dst, v, v_dst, slots = k_out, q, q, q  # v / v_dst / slots: placeholders, unread
        dst_strides = (k_out.stride(0), k_out.stride(1))
    if T == 0 or D == 0:
        return q_out, k_out
    block_d = next_pow2(D)
    # ~1K elements per program: one decode token spreads over a few SMs (Qwen3-30B: 5 programs)
    block_h = min(next_pow2(max(NQ, NK)), max(1, 1024 // block_d))
    k_blocks = cdiv(NK, block_h)
    grid = (T, cdiv(NQ, block_h) + k_blocks * (2 if kv_store is not None else 1))
    has_norm = q_weight is not None
    _qk_norm_rope_kernel[grid](
        q, k, q_out, k_dst, q_weight if has_norm else cos, k_weight if has_norm else cos, cos, sin, v, v_dst, slots,
        NQ, NK, D, DR, q.stride(0), q.stride(1), k.stride(0), k.stride(1), q_out.stride(0), q_out.stride(1),
        *dst_strides, cos.stride(0), sin.stride(0), v.stride(0), v.stride(1), float(eps), HAS_NORM=has_norm,
        STORE=kv_store is not None, BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=4 if block_h * block_d >= 1024 else 1, **pdl_args(pdl, q))
    return q_out, k_out
