"""MLA prefill's attention keys in one pass: each head's key is its expanded nope part beside the one rotated key
the heads share.

Shape legend: L context rows, N heads, Dn / Dv nope / value widths, Dr rope width.
  mla_prefill_keys(kv [L, N, Dn + Dv], k_rope [L, Dr]) -> keys [L, N, Dn + Dr] (new, contiguous)
keys[l, h] = (kv[l, h, :Dn], k_rope[l]): a copy, bit for bit what `torch.cat((kv[..., :Dn], k_rope[:, None]
.expand(-1, N, -1)), -1)` gives (its torch twin in `layers.mla`). Why: torch's concatenation of a strided slice
and a broadcast one runs its generic batched copy, ~87 us a DeepSeek-V2-Lite layer at 8192 rows (84 MB moved,
~1 TB/s) on the H200; this kernel moves the same bytes in wide rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moelora.kernels.checks import FLOAT_DTYPES, cdiv, need, next_pow2


@triton.jit
def _mla_keys_kernel(kv_ptr, kr_ptr, out_ptr, N, DN, DR, stride_kvl, stride_kvh, stride_krl,
                     BLOCK_H: tl.constexpr, BLOCK_DN: tl.constexpr, BLOCK_DR: tl.constexpr):
    """Program (l, b): row l's keys of heads [b BLOCK_H, (b + 1) BLOCK_H)."""
    row = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dn = tl.arange(0, BLOCK_DN)
    dr = tl.arange(0, BLOCK_DR)
    hm = (heads < N)[:, None]
    nope = tl.load(kv_ptr + row * stride_kvl + heads[:, None].to(tl.int64) * stride_kvh + dn[None, :],
                   mask=hm & (dn < DN)[None, :])
    rope = tl.load(kr_ptr + row * stride_krl + dr, mask=dr < DR)
    dst = out_ptr + (row * N + heads[:, None].to(tl.int64)) * (DN + DR)
    tl.store(dst + dn[None, :], nope, mask=hm & (dn < DN)[None, :])
    tl.store(dst + DN + dr[None, :], tl.broadcast_to(rope[None, :], (BLOCK_H, BLOCK_DR)), mask=hm & (dr < DR)[None, :])


def mla_prefill_keys(kv: torch.Tensor, k_rope: torch.Tensor, nope: int) -> torch.Tensor:
    """keys [L, N, nope + Dr] from kv [L, N, >= nope] (its first `nope` columns a head) and k_rope [L, Dr]
    (module docstring); both only read, each with a unit last stride."""
    need(kv.dim() == 3 and kv.dtype in FLOAT_DTYPES and kv.stride(2) == 1 and 0 < nope <= kv.shape[2],
         lambda: f"kv must be [L, N, >= nope={nope}] fp16/bf16/fp32 with unit last stride, got {tuple(kv.shape)} "
                 f"{kv.dtype}")
    L, N, _ = kv.shape
    need(k_rope.dim() == 2 and k_rope.shape[0] == L and k_rope.shape[1] > 0 and k_rope.dtype == kv.dtype
         and k_rope.stride(1) == 1 and k_rope.device == kv.device,
         lambda: f"k_rope must be [L={L}, Dr] {kv.dtype} on {kv.device} with unit last stride, got "
                 f"{tuple(k_rope.shape)} {k_rope.dtype}")
    DR = k_rope.shape[1]
    out = torch.empty(L, N, nope + DR, dtype=kv.dtype, device=kv.device)
    if L == 0 or N == 0:
        return out
    block_dn = next_pow2(nope)
    block_h = max(1, min(next_pow2(N), 4096 // block_dn))
    _mla_keys_kernel[(L, cdiv(N, block_h))](
        kv, k_rope, out, N, nope, DR, kv.stride(0), kv.stride(1), k_rope.stride(0), BLOCK_H=block_h,
        BLOCK_DN=block_dn, BLOCK_DR=next_pow2(DR), num_warps=4)
    return out
