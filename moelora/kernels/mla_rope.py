"""MLA decode's small steps in one launch: the query's rotary part, and the step's cache entries (the latent
through kv_a_layernorm, the rotated single-head key) written at their slots.

Shape legend: T tokens, N heads, Dn / Dr nope / rope widths, C kv_lora_rank, NB x BS cache slots.
  mla_rope_store(q [T, N, Dn + Dr], compressed [T, C + Dr], cos [T, Dr] fp32, sin [T, Dr] fp32, norm_weight [C],
                 eps, cache [NB, BS, C + Dr], slot_mapping [T], interleave, in_place=False)
      -> q_rope [T, N, Dr] (new; in_place: q[..., Dn:] itself, rotated where it is, prefill's path)
What it replaces on the absorbed decode path (`layers.mla`): two rotary calls in torch (`layers.rotary`'s
`apply_rotary_interleaved` or `apply_rotary`: ~9 launches each in bf16), two concatenations, the latent's RMSNorm
launch and the attention's store of the entries (`mla_attention`, then called with `stored=True`). Numerics: those
ops' (each product and sum of the rotation rounded to the dtype as torch rounds them, the norm as
`kernels.norm`'s); a slot < 0 stores nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moelora.kernels.checks import FLOAT_DTYPES, cdiv, check_vector, need, next_pow2
from moelora.kernels.pdl import pdl_args, pdl_wait
from moelora.kernels.rounding import round_to


@triton.jit
def _rotate(x_rows, cs_ptr, sn_ptr, d, ok, out_ptr, DR, INTERLEAVE: tl.constexpr):
    """Rotary of the Dr values at x_rows (pointers [..., 1]) -> fp32 [..., BLOCK_R], each step rounded to out's
    dtype. INTERLEAVE: pairs (2i, 2i + 1) turn by angle i, out = (even', odd') (`apply_rotary_interleaved`);
    else halves (`apply_rotary`, every dim turning)."""
    half = DR // 2
    if INTERLEAVE:
        i = tl.where(d < half, d, d - half)
        a = tl.load(x_rows + 2 * i, mask=ok, other=0.0).to(tl.float32)
        b = tl.load(x_rows + 2 * i + 1, mask=ok, other=0.0).to(tl.float32)
        c = round_to(tl.load(cs_ptr + i, mask=d < DR, other=0.0), out_ptr)
        s = round_to(tl.load(sn_ptr + i, mask=d < DR, other=0.0), out_ptr)
        first = round_to(round_to(a * c, out_ptr) - round_to(b * s, out_ptr), out_ptr)
        second = round_to(round_to(b * c, out_ptr) + round_to(a * s, out_ptr), out_ptr)
        return tl.where(d < half, first, second)
    partner = tl.where(d < half, d + half, d - half)
    a = tl.load(x_rows + d, mask=ok, other=0.0).to(tl.float32)
    p = tl.load(x_rows + partner, mask=ok, other=0.0).to(tl.float32)
    c = round_to(tl.load(cs_ptr + d, mask=d < DR, other=0.0), out_ptr)
    s = round_to(tl.load(sn_ptr + d, mask=d < DR, other=0.0), out_ptr)
    rot = tl.where(d < half, -p, p)
    return round_to(round_to(a * c, out_ptr) + round_to(rot * s, out_ptr), out_ptr)


@triton.jit
def _mla_rope_store_kernel(q_ptr, ckv_ptr, cos_ptr, sin_ptr, w_ptr, cache_ptr, slot_ptr, qr_ptr, N, C, DR, NOPE,
                           stride_qt, stride_qh, stride_ct, stride_cos, stride_sin, stride_slot, stride_qrt,
                           stride_qrh, eps, INTERLEAVE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr,
                           BLOCK_R: tl.constexpr, IN_PLACE: tl.constexpr, PDL: tl.constexpr):
    """Program (t, 0): token t's cache entry (normed latent, rotated key) at its slot; (t, b > 0): the rope part
    of heads [(b - 1) BLOCK_H, b BLOCK_H) of its query into qr. IN_PLACE (qr is q's rope columns): a barrier
    between the loads and the store, as a thread's pair partner sits in another thread."""
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    d = tl.arange(0, BLOCK_R)
    cs, sn = cos_ptr + t * stride_cos, sin_ptr + t * stride_sin
    if b == 0:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            dst = cache_ptr + slot * stride_slot
            offs = tl.arange(0, BLOCK_C)
            x = tl.load(ckv_ptr + t * stride_ct + offs, mask=offs < C, other=0.0).to(tl.float32)
            scale = tl.rsqrt(tl.sum(x * x, axis=0) / C + eps)
            w = tl.load(w_ptr + offs, mask=offs < C, other=0.0).to(tl.float32)
            tl.store(dst + offs, (w * round_to(x * scale, cache_ptr)).to(cache_ptr.dtype.element_ty), mask=offs < C)
            k = _rotate(ckv_ptr + t * stride_ct + C, cs, sn, d, d < DR, cache_ptr, DR, INTERLEAVE)
            tl.store(dst + C + d, k.to(cache_ptr.dtype.element_ty), mask=d < DR)
    else:
        heads = (b - 1) * BLOCK_H + tl.arange(0, BLOCK_H)
        ok = (heads < N)[:, None] & (d < DR)[None, :]
        rows = q_ptr + t * stride_qt + heads[:, None].to(tl.int64) * stride_qh + NOPE
        y = _rotate(rows, cs, sn, d[None, :], ok, qr_ptr, DR, INTERLEAVE)
        if IN_PLACE:
            tl.debug_barrier()
        out = qr_ptr + t * stride_qrt + heads[:, None].to(tl.int64) * stride_qrh + d[None, :]
        tl.store(out, y.to(qr_ptr.dtype.element_ty), mask=ok)


def mla_rope_store(q: torch.Tensor, compressed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   norm_weight: torch.Tensor, eps: float, cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                   interleave: bool, in_place: bool = False, pdl: bool = False) -> torch.Tensor:
    """q_rope [T, N, Dr] and the step's cache entries written (module docstring); compressed only read, q too
    unless `in_place`: then q_rope is q's own rope columns q[..., Dn:], rotated where they are (prefill's q then
    needs no concatenation); else a new tensor. `pdl`: programmatic dependent launch where the GPU has it
    (`kernels.pdl`)."""
    need(q.dim() == 3 and q.dtype in FLOAT_DTYPES and q.stride(2) == 1,
         lambda: f"q must be [T, N, Dn + Dr] fp16/bf16/fp32 with unit last stride, got {tuple(q.shape)} {q.dtype}")
    T, N, width = q.shape
    need(cos.dim() == 2 and cos.shape[0] == T and sin.shape == cos.shape and cos.dtype == sin.dtype == torch.float32
         and cos.stride(1) == 1 and sin.stride(1) == 1,
         lambda: f"cos, sin must be fp32 [T={T}, Dr] with unit last stride, got {tuple(cos.shape)} {cos.dtype}, "
         f"{tuple(sin.shape)} {sin.dtype}")
    DR = cos.shape[1]
    need(0 < DR < width and DR % 2 == 0, f"rope width Dr={DR} must be even and below q's head width {width}")
    need(compressed.dim() == 2 and compressed.shape[0] == T and compressed.shape[1] > DR
         and compressed.dtype == q.dtype and compressed.stride(1) == 1,
         lambda: f"compressed must be [T={T}, C + Dr] {q.dtype} with unit last stride, got "
         f"{tuple(compressed.shape)} {compressed.dtype}")
    C = compressed.shape[1] - DR
    check_vector("norm_weight", norm_weight, C, q.device)
    need(cache.dim() == 3 and cache.shape[2] == C + DR and cache.dtype == q.dtype and cache.is_contiguous(),
         lambda: f"cache must be contiguous [NB, BS, C + Dr={C + DR}] {q.dtype}, got {tuple(cache.shape)} "
         f"{cache.dtype}")
    need(tuple(slot_mapping.shape) == (T,) and slot_mapping.dtype in (torch.int32, torch.int64),
         lambda: f"slot_mapping must be [T={T}] int32/int64, got {tuple(slot_mapping.shape)} {slot_mapping.dtype}")
    need(all(t.device == q.device for t in (compressed, cos, sin, cache, slot_mapping)),
         f"all inputs must be on {q.device}")
    q_rope = q[..., width - DR:] if in_place else torch.empty(T, N, DR, dtype=q.dtype, device=q.device)
    if T == 0:
        return q_rope
    block_r = max(2, next_pow2(DR))
    block_h = max(1, min(next_pow2(N), 2048 // block_r))
    _mla_rope_store_kernel[(T, 1 + cdiv(N, block_h))](
        q, compressed, cos, sin, norm_weight, cache, slot_mapping, q_rope, N, C, DR, width - DR, q.stride(0),
        q.stride(1), compressed.stride(0), cos.stride(0), sin.stride(0), cache.stride(1), q_rope.stride(0),
        q_rope.stride(1), float(eps), INTERLEAVE=bool(interleave), BLOCK_H=block_h, BLOCK_C=next_pow2(C),
        BLOCK_R=block_r, IN_PLACE=bool(in_place), num_warps=4, **pdl_args(pdl, q))
    return q_rope
