"""FP8 (e4m3) block math: quantize / dequantize weights and activations. Pure torch, no state.

Shape legend: N output rows, K input columns, G row segments (N = sum N_g), bn x bk the weight block
(128 x 128), E experts (any leading dims).

Weights w [.., N, K] are stored as q = w / s in `float8_e4m3fn` with an fp32 multiplier s ("scale_inv"
in DeepSeek's naming, `weight_scale` in compressed-tensors'; both multiply: w ~ q * s):
- block: one s per bn x bk block, s [.., ceil(N/bn), ceil(K/bk)]; a partial block at the end of a row or
  column (N or K not a multiple of the block) has its own s over the elements it has.
- channel: one s per output row, s [.., N, 1] (a per-tensor scale is stored as its rows' copies).
A weight of G row segments (merged q/k/v; an expert's gate and up halves) blocks each segment on its
own: s [.., sum_g ceil(N_g/bn), ceil(K/bk)], segment g's grid rows after the grids of the segments
before it. That equals blocking the whole N rows when every N_g is a multiple of bn (every shipped
checkpoint), and lets a segment that is not, like the tiny test models', keep the scales its
checkpoint wrote.

s = amax / 448 over the block (row), 1 where amax is 0 (q is then 0 anyway). Rounding to e4m3 is to
nearest: |w - q s| <= 2^-4 |w| for |w| >= 2^-6 s, else <= 2^-10 s (the subnormal spacing 2^-9 s, halved).
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
BLOCK = (128, 128)
# e4m3 round-to-nearest: relative error of a normal value, and the absolute error (in units of the
# scale) below the smallest normal 2^-6: half the subnormal spacing 2^-9.
REL_ERROR = 2.0 ** -4
ABS_ERROR = 2.0 ** -10


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_grid(rows: int, cols: int, block: tuple[int, int] = BLOCK) -> tuple[int, int]:
    """The scale grid of a [rows, cols] weight: (ceil(rows / bn), ceil(cols / bk))."""
    return cdiv(rows, block[0]), cdiv(cols, block[1])


def segment_grid_rows(segments: tuple[int, ...], block_rows: int) -> tuple[int, ...]:
    """Scale-grid rows of each row segment (each blocked on its own)."""
    return tuple(cdiv(n, block_rows) for n in segments)


def scale_of(amax: torch.Tensor) -> torch.Tensor:
    """The fp32 multiplier of a group with max-abs `amax`: amax / 448, or 1 for an all-zero group."""
    amax = amax.float()
    # a tensor divisor: CUDA divides by a Python scalar as a multiply by its reciprocal (an ulp off IEEE at
    # times), and the Triton kernels divide with IEEE rounding (div_rn) on every device
    return torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))


def to_fp8(x: torch.Tensor) -> torch.Tensor:
    """Saturating cast of an already-scaled tensor to e4m3."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _expand_blocks(scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    """scale [.., ceil(rows/bn), ceil(cols/bk)] -> [.., rows, cols], each block's s over its elements."""
    return scale.repeat_interleave(block[0], dim=-2)[..., :rows, :].repeat_interleave(block[1], dim=-1)[..., :cols]


def quantize_blocks(w: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """w [.., N, K] -> (q [.., N, K] e4m3, s [.., ceil(N/bn), ceil(K/bk)] fp32), partial blocks included."""
    rows, cols = w.shape[-2:]
    gr, gc = block_grid(rows, cols, block)
    pad = torch.zeros(*w.shape[:-2], gr * block[0], gc * block[1], dtype=torch.float32, device=w.device)
    pad[..., :rows, :cols] = w.float().abs()
    amax = pad.unflatten(-1, (gc, block[1])).unflatten(-3, (gr, block[0])).amax(dim=(-3, -1))
    s = scale_of(amax)
    return to_fp8(w.float() / _expand_blocks(s, rows, cols, block)), s


def dequantize_blocks(q: torch.Tensor, s: torch.Tensor, block: tuple[int, int] = BLOCK,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q [.., N, K] e4m3 and s [.., ceil(N/bn), ceil(K/bk)] -> w [.., N, K] in `dtype` (product in fp32)."""
    rows, cols = q.shape[-2:]
    if rows % block[0] or cols % block[1]:
        return (q.float() * _expand_blocks(s.float(), rows, cols, block)).to(dtype)
    # whole blocks (every shipped shape): broadcast s over a blocked view, no expanded copy of the scales
    blocked = q.float().unflatten(-1, (cols // block[1], block[1])).unflatten(-3, (rows // block[0], block[0]))
    return (blocked * s.float()[..., :, None, :, None]).reshape(q.shape).to(dtype)


def quantize_channels(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [.., N, K] -> (q e4m3, s [.., N, 1] fp32): one scale per output row."""
    s = scale_of(w.float().abs().amax(dim=-1, keepdim=True))
    return to_fp8(w.float() / s), s


def dequantize_channels(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q [.., N, K] and s [.., N, 1] (or a broadcastable per-tensor [1] / []) -> w in `dtype`."""
    return (q.float() * s.float()).to(dtype)


def quantize_segments(w: torch.Tensor, segments: tuple[int, ...], block: tuple[int, int] = BLOCK
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-quantize each row segment of w [.., N, K] on its own; s rows concatenated per segment."""
    parts = [quantize_blocks(p, block) for p in w.split(list(segments), dim=-2)]
    return torch.cat([q for q, _ in parts], dim=-2), torch.cat([s for _, s in parts], dim=-2)


def dequantize_segments(q: torch.Tensor, s: torch.Tensor, segments: tuple[int, ...],
                        block: tuple[int, int] = BLOCK, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `quantize_segments`: each segment's rows with its own grid rows of s."""
    if len(segments) == 1:
        return dequantize_blocks(q, s, block, dtype)
    qs = q.split(list(segments), dim=-2)
    ss = s.split(list(segment_grid_rows(segments, block[0])), dim=-2)
    return torch.cat([dequantize_blocks(a, b, block, dtype) for a, b in zip(qs, ss, strict=True)], dim=-2)


def quantize_groups(x: torch.Tensor, group: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activation quantization: x [.., K] -> (q [.., K] e4m3, s [.., ceil(K/group)] fp32), one scale per
    row and group of `group` columns (None: the whole row, per-token); the last group of a row whose K is not a
    multiple of `group` is partial. The twin of `moelora.kernels.fp8_quant.per_token_group_quant`."""
    cols = x.shape[-1]
    g = cols if group is None else group
    n = cdiv(cols, g)
    pad = torch.zeros(*x.shape[:-1], n * g, dtype=torch.float32, device=x.device)
    pad[..., :cols] = x.float()
    grouped = pad.unflatten(-1, (n, g))
    s = scale_of(grouped.abs().amax(dim=-1))
    return to_fp8(grouped / s[..., None]).flatten(-2)[..., :cols], s


def fake_quantize_groups(x: torch.Tensor, group: int | None) -> torch.Tensor:
    """`quantize_groups` and back, in x's dtype: the activations as a W8A8 GEMM sees them."""
    q, s = quantize_groups(x, group)
    g = x.shape[-1] if group is None else group
    return (q.float() * s.repeat_interleave(g, dim=-1)[..., :x.shape[-1]]).to(x.dtype)
