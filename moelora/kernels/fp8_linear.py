"""Dense linear on FP8 (e4m3) weights with their scales, plus the multi-LoRA delta (contract 10).

Shape legend: T tokens, N_in / N_out features, G row segments of the weight (merged q/k/v: N_out = sum N_g).
  x [T, N_in] fp16/bf16/fp32, weight [N_out, N_in] e4m3, scale fp32 [sum_g ceil(N_g/128), ceil(N_in/128)]
  (block: each segment blocked on its own, `quant.fp8`) or [N_out, 1] (channel / tensor), bias [N_out] | None,
  lora: DenseLoRAArgs | None                                                            -> y [T, N_out]
K steps of one 128-column scale block, W8A8 (x quantized first, `fp8_quant`) or W8A16 (as `fp8_moe`'s); in decode
the K steps split over programs, summed by the last split of each tile in the same launch. Block-scaled W8A8 from
CUBLAS_MIN_ROWS rows (prefill) runs on cuBLAS's 1 x 128 / 128 x 128 block-scaled GEMM (`torch._scaled_mm`, CUDA >=
12.9 on sm_90) where the shapes allow it (`use_cublas`): 1.4-2.2x faster there on the H200 (docs/performance.md).
The LoRA delta is the dense modes' "split" (its shrink on the side stream during the GEMM) or "planned", on x
unrounded; never "splitk", which fuses the bf16 GEMM. Twin: `lora_linear_ref` on the dequantized weight.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from moelora.kernels.args import FP8_DECODE_BLOCK_N, DenseLoRAArgs, FP8Rows
from moelora.kernels.checks import cdiv, check_rows, need, output
from moelora.kernels.dense_lora import planned, split
from moelora.kernels.fp8_quant import GROUP, per_token_group_quant, w8a8_dot_t, w8a16_dot
from moelora.kernels.lora_linear import check_lora, default_lora_linear_config
from moelora.kernels.pdl import pdl_args, pdl_wait
from moelora.kernels.side_stream import join

FP8_DTYPE = torch.float8_e4m3fn
MAX_SEGMENTS = 3
CUBLAS_MIN_ROWS = 129  # W8A8 block-scaled rows from which cuBLAS runs the GEMM (the Triton kernel's prefill tiles)
CUBLAS_ROW_MULTIPLE = 4  # cuBLAS's block-scaled GEMM takes rows in multiples of 4 (others: NOT_SUPPORTED, CUDA 13.0)


@triton.jit
def _scale_rows(offs_n, B1: tl.constexpr, B2: tl.constexpr, G1: tl.constexpr, G2: tl.constexpr, GN: tl.constexpr):
    """The scale row of each output column: segment g (bounds B1, B2) blocked on its own from grid row G_g."""
    later = tl.where(offs_n < B2, G1 + (offs_n - B1) // GN, G2 + (offs_n - B2) // GN)
    return tl.where(offs_n < B1, offs_n // GN, later)


@triton.jit
def _fp8_linear_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, part_ptr, sem_ptr, T, N, K, K_SPLIT,
                       stride_a, stride_as, stride_w, stride_wsn, stride_wsk, stride_o,
                       B1: tl.constexpr, B2: tl.constexpr, G1: tl.constexpr, G2: tl.constexpr, GN: tl.constexpr,
                       A_FP8: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr):
    """Program (m, n, k): out[m BM.., n BN..] = a @ W^T (+ bias) over columns [k K_SPLIT, (k + 1) K_SPLIT); a e4m3
    with as [T, ceil(K/BK)] (A_FP8) or a float. SPLIT_K > 1: each split writes its fp32 partial to part
    [SPLIT_K, T, N]; the split arriving last at its tile (counted on sem [tiles] int32, zero between calls) sums
    them in split order and writes out: one launch, deterministic."""
    pdl_wait(PDL)
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    m_ok, n_ok = offs_m < T, offs_n < N
    k_lo = tl.program_id(2) * K_SPLIT
    k_hi = tl.minimum(K, k_lo + K_SPLIT)
    a_rows = a_ptr + offs_m[:, None].to(tl.int64) * stride_a + offs_k[None, :]
    s_cols = ws_ptr + _scale_rows(offs_n, B1, B2, G1, G2, GN) * stride_wsn
    # W8A8 at 17-32 rows (BM 32) runs transposed, an e4m3 wgmma with the weight tile as its M side; at BM 16 that
    # form measured 3-5 % slower (H100), so those tiles keep this one (mma.sync on operands upcast to f16); from
    # BM 64 this one is the wgmma
    if A_FP8 and (BM != 32 or BN < 64):
        acc = tl.zeros((BM, BN), tl.float32)
        w_cols = w_ptr + offs_n[None, :].to(tl.int64) * stride_w + offs_k[:, None]  # [BK, BN]
        for k0 in range(k_lo, k_hi, BK):
            k_ok = (k0 + offs_k) < K
            a = tl.load(a_rows + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_cols + k0, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            w_s = tl.load(s_cols + (k0 // BK) * stride_wsk, mask=n_ok, other=0.0)
            a_s = tl.load(as_ptr + offs_m * stride_as + k0 // BK, mask=m_ok, other=0.0)
            acc += tl.dot(a, w) * (a_s[:, None] * w_s[None, :])
    else:  # transposed, the weight tile the MMA's M side (W8A16 always, as in fp8_moe)
        acc_t = tl.zeros((BN, BM), tl.float32)
        w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_w + offs_k[None, :]  # [BN, BK]
        for k0 in range(k_lo, k_hi, BK):
            k_ok = (k0 + offs_k) < K
            a = tl.load(a_rows + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_rows + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            w_s = tl.load(s_cols + (k0 // BK) * stride_wsk, mask=n_ok, other=0.0)
            if A_FP8:
                acc_t = w8a8_dot_t(acc_t, a, tl.load(as_ptr + offs_m * stride_as + k0 // BK, mask=m_ok, other=0.0),
                                   w, w_s)
            else:  # the upcast weight as the MMA's register operand
                acc_t = w8a16_dot(acc_t, tl.trans(a), w, w_s)
        acc = tl.trans(acc_t)
    tile_ok = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        _write(acc, bias_ptr, out_ptr, offs_m, offs_n, n_ok, tile_ok, stride_o, HAS_BIAS)
    else:
        parts = part_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        tl.store(parts + tl.program_id(2).to(tl.int64) * T * N, acc, mask=tile_ok)
        tl.debug_barrier()  # every thread's partial is written before the release below publishes them
        sem = sem_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        if tl.atomic_add(sem, 1, sem="acq_rel") == SPLIT_K - 1:  # the last split of this tile sums them all
            acc = tl.zeros((BM, BN), tl.float32)
            for k in tl.static_range(SPLIT_K):  # in split order: the sum does not depend on who came last
                acc += tl.load(parts + k * T * N, mask=tile_ok, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(sem, 0)  # zero again for the next call (or graph replay) on these semaphores
            _write(acc, bias_ptr, out_ptr, offs_m, offs_n, n_ok, tile_ok, stride_o, HAS_BIAS)


@triton.jit
def _write(acc, bias_ptr, out_ptr, offs_m, offs_n, n_ok, tile_ok, stride_o, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_o + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=tile_ok)


class Tiles(NamedTuple):
    bm: int
    bn: int
    warps: int
    stages: int = 3
    split_k: int = 1  # at most this many K splits (whole 128-column scale blocks each)


def default_tiles(T: int, n_out: int, n_in: int) -> Tiles:
    """Decode: 16 x 64 tiles to 16 rows, 32 x 64 to 32, 64 x 64 to 128, K split in 2-8 until ~256 programs (16
    rows) or ~128 (more) are in flight (the H200 sweeps of issue 28: q/k/v 10.3 -> 8.1 us at T = 8, 16.0 ->
    12.6 at 64; o 16.0 -> 7.6 at 8, 21.4 -> 11.8 at 64); prefill 64 x 128, one pass."""
    if T > 128:
        return Tiles(64, 128, 8)
    bm = 16 if T <= 16 else 32 if T <= 32 else 64
    tiles, want, split = cdiv(T, bm) * cdiv(n_out, FP8_DECODE_BLOCK_N), 256 if T <= 16 else 128, 1
    while split < 8 and tiles * split < want and split * GROUP < n_in:
        split *= 2
    return Tiles(bm, FP8_DECODE_BLOCK_N, 4, 3, split)


def _launch(a, a_s, weight, scale, bias, out, bounds, grid_rows, gn, a_fp8, block, t: Tiles, counters,
            pdl: bool = False):
    T, n_out, n_in = out.shape[0], out.shape[1], weight.shape[1]
    k_split = cdiv(cdiv(n_in, GROUP), t.split_k) * GROUP
    splits = cdiv(n_in, k_split)
    grid = (cdiv(T, t.bm), cdiv(n_out, t.bn), splits)
    part, sem = out, out
    if splits > 1:
        part = torch.empty(splits, T, n_out, dtype=torch.float32, device=out.device)
        tiles = grid[0] * grid[1]
        if counters is None:
            sem = torch.zeros(tiles, dtype=torch.int32, device=out.device)
        else:
            need(counters.dtype == torch.int32 and counters.numel() >= tiles and counters.device == out.device,
                 lambda: f"counters must be int32 [>= {tiles}] on {out.device}, got {tuple(counters.shape)} "
                 f"{counters.dtype} on {counters.device}")
            sem = counters
    _fp8_linear_kernel[grid](
        a, a_s, weight, scale, out if bias is None else bias, out, part, sem, T, n_out, n_in, k_split,
        a.stride(0), a_s.stride(0), weight.stride(0), scale.stride(0), scale.stride(1) if block else 0,
        out.stride(0), B1=bounds[0], B2=bounds[1], G1=grid_rows[0], G2=grid_rows[1], GN=gn, A_FP8=a_fp8,
        HAS_BIAS=bias is not None, SPLIT_K=splits, BM=t.bm, BN=t.bn, BK=GROUP, num_warps=t.warps,
        num_stages=t.stages, **pdl_args(pdl, a))


def _check(x, weight, scale, bias, segments, block):
    need(x.dim() == 2, lambda: f"x must be [T, N_in], got {tuple(x.shape)}")
    check_rows("x", x)
    n_in = x.shape[1]
    if weight.dim() != 2 or weight.shape[1] != n_in or weight.dtype != FP8_DTYPE or not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous [N_out, N_in={n_in}] float8_e4m3fn, got {tuple(weight.shape)} "
                         f"{weight.dtype}")
    n_out = weight.shape[0]
    if not 1 <= len(segments) <= MAX_SEGMENTS or sum(segments) != n_out:
        raise ValueError(f"segments must be 1..{MAX_SEGMENTS} sizes summing to N_out={n_out}, got {segments}")
    rows = sum(cdiv(n, GROUP) for n in segments) if block else n_out
    want = (rows, cdiv(n_in, GROUP) if block else 1)
    if tuple(scale.shape) != want or scale.dtype != torch.float32 or not scale.is_contiguous():
        raise ValueError(f"scale must be contiguous fp32 {want}, got {tuple(scale.shape)} {scale.dtype}")
    if bias is not None and (tuple(bias.shape) != (n_out,) or bias.dtype != x.dtype):
        raise ValueError(f"bias must be [N_out={n_out}] {x.dtype}, got {tuple(bias.shape)} {bias.dtype}")
    if x.is_cuda and torch.cuda.get_device_capability(x.device) < (8, 9):
        raise ValueError("FP8 linears need compute capability >= 8.9 (Ada / Hopper): use kernel_backend='torch'")
    return x.shape[0], n_in, n_out


@functools.cache
def _block_scaled_cublas(index: int) -> bool:
    """cuBLAS has the 1 x 128 (activations) / 128 x 128 (weights) block-scaled FP8 GEMM: CUDA >= 12.9 on sm_90 (on
    other GPUs it is not measured here)."""
    version = tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])
    return version >= (12, 9) and torch.cuda.get_device_capability(index) == (9, 0)


def cublas_shapes(T: int, n_in: int, n_out: int, segments: tuple[int, ...], block: bool, quantize_activations: bool,
                  dtype: torch.dtype) -> bool:
    """The shapes and modes cuBLAS's block-scaled GEMM serves here: W8A8 on 128 x 128 block scales, bf16 x of >=
    CUBLAS_MIN_ROWS rows, N_in a multiple of 4 x 128 (the weight scales' leading dimension a multiple of 4, as the
    activation scales' is (CUBLAS_ROW_MULTIPLE): with N_in 576 or 2816 cuBLAS (CUDA 13.0, H200) returned wrong
    sums and no error), N_out a multiple of 16, every segment but the last whole 128-row blocks (the merged
    weight's block grid is then the segments')."""
    return (block and quantize_activations and dtype == torch.bfloat16 and T >= CUBLAS_MIN_ROWS
            and n_in % (CUBLAS_ROW_MULTIPLE * GROUP) == 0 and n_out % 16 == 0
            and all(n % GROUP == 0 for n in segments[:-1]))


def use_cublas(x: torch.Tensor, n_out: int, segments: tuple[int, ...], block: bool, quantize_activations: bool) -> bool:
    """Whether `fp8_linear` runs x W^T on cuBLAS: `cublas_shapes`, on a GPU that has the GEMM."""
    return (x.is_cuda and cublas_shapes(x.shape[0], x.shape[1], n_out, segments, block, quantize_activations, x.dtype)
            and _block_scaled_cublas(x.device.index if x.device.index is not None else torch.cuda.current_device()))


def _cublas_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                   out: torch.Tensor | None, x_fp8: FP8Rows | None, pdl: bool) -> torch.Tensor:
    """`fp8_linear` on cuBLAS (`use_cublas`): x quantized with column-major scales (its producer's rows, their
    scales transposed, where T is a multiple of CUBLAS_ROW_MULTIPLE; else quantized again, padded to one: the same
    bits, `norm_fp8`), y written to `out` or to a padded buffer whose first T rows are returned."""
    T = x.shape[0]
    if x_fp8 is not None and T % CUBLAS_ROW_MULTIPLE == 0:
        a, a_s = x_fp8.q, x_fp8.s.t().contiguous().t()
    else:
        a, a_s = per_token_group_quant(x, row_multiple=CUBLAS_ROW_MULTIPLE, col_major_scales=True, pdl=pdl)
    y = out if out is not None else torch.empty(a.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    torch._scaled_mm(a, weight.t(), a_s, scale.t(), bias=bias, out_dtype=x.dtype, out=y)
    return y[:T]


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, *,
               segments: tuple[int, ...], block: bool = True, quantize_activations: bool = False,
               out: torch.Tensor | None = None, tiles: Tiles | None = None,
               x_fp8: FP8Rows | None = None, counters: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """y = x W^T (+ bias) on e4m3 W and its scale (module docstring); y new, or the caller's `out=`; `tiles`:
    default `default_tiles`; `x_fp8`: x already quantized (W8A8: its producer wrote it, `norm.norm_fp8`);
    `counters`: the split-K arrival counters the caller owns (`args.split_k_counters`, zero between calls; None:
    a zeroed buffer for this call); `pdl`: programmatic dependent launch where the GPU has it (`kernels.pdl`).
    Without `tiles`, on cuBLAS where `use_cublas` says so (with `out=`, only at a multiple of CUBLAS_ROW_MULTIPLE
    rows into a contiguous `out`)."""
    T, n_in, n_out = _check(x, weight, scale, bias, segments, block)
    if tiles is None and use_cublas(x, n_out, segments, block, quantize_activations) and (
            out is None or (T % CUBLAS_ROW_MULTIPLE == 0 and out.is_contiguous())):
        if out is not None:
            out = output(out, (T, n_out), x.dtype, x.device, (x, weight, scale, bias))
        return _cublas_linear(x, weight, scale, bias, out, x_fp8, pdl)
    out = output(out, (T, n_out), x.dtype, x.device, (x, weight, scale, bias))
    if T == 0:
        return out
    a, a_s = ((x, x) if not quantize_activations else x_fp8 if x_fp8 is not None
              else per_token_group_quant(x, pdl=pdl))
    if quantize_activations and x_fp8 is not None:
        need(a.shape == x.shape and a.dtype == FP8_DTYPE and tuple(a_s.shape) == (T, cdiv(n_in, GROUP)),
             lambda: f"x_fp8 must be (q {tuple(x.shape)} e4m3, s ({T}, {cdiv(n_in, GROUP)}) fp32), got "
             f"{tuple(a.shape)} {a.dtype}, {tuple(a_s.shape)}")
    gn = GROUP if block else 1
    bounds = [sum(segments[:i + 1]) for i in range(len(segments))] + [n_out] * (MAX_SEGMENTS - len(segments))
    grid_rows = [sum(cdiv(n, gn) for n in segments[:i + 1]) for i in range(len(segments))]
    grid_rows += [grid_rows[-1]] * (MAX_SEGMENTS - len(segments))
    _launch(a, a_s, weight, scale, bias, out, bounds, grid_rows, gn, quantize_activations, block,
            tiles or default_tiles(T, n_out, n_in), counters, pdl)
    return out


def fp8_lora_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                    lora: DenseLoRAArgs | None, *, segments: tuple[int, ...], block: bool = True,
                    quantize_activations: bool = False, side_stream: torch.cuda.Stream | None = None,
                    x_fp8: FP8Rows | None = None, counters: torch.Tensor | None = None,
                    pdl: bool = False) -> torch.Tensor:
    """`fp8_linear` + the LoRA delta of `lora` (as `lora_linear` adds it, on x unrounded): y [T, N_out], new;
    `pdl`: programmatic dependent launch where the GPU has it (`kernels.pdl`)."""
    T, n_in = x.shape
    has_lora = lora is not None and lora.a.shape[0] > 0 and T > 0
    if not has_lora:
        return fp8_linear(x, weight, scale, bias, segments=segments, block=block,
                          quantize_activations=quantize_activations, x_fp8=x_fp8, counters=counters, pdl=pdl)
    n_out = weight.shape[0]
    check_lora(lora, T, n_in, n_out)
    cfg = default_lora_linear_config(T, n_in=n_in, n_out=n_out, row_plan=lora.row_plan is not None, pdl=pdl)
    if cfg.mode == "planned":
        out = fp8_linear(x, weight, scale, bias, segments=segments, block=block,
                         quantize_activations=quantize_activations, x_fp8=x_fp8, counters=counters, pdl=pdl)
        planned.add_delta(x, out, lora, cfg)
        return out
    if cfg.mode != "split" or cfg.expand_first:  # the delta added after the FP8 GEMM (no beta = 1 GEMM here)
        cfg = replace(default_lora_linear_config(T, mode="split", pdl=pdl), expand_first=False)
    # Fork (contract 2), as dense_lora.split: the side stream reads x, A, the slots and ranks and writes only xa
    # (allocated before the fork); the base GEMM reads x, W and its scale and writes only `out`.
    shrunk = split.shrink(x, lora, T, n_in, cfg, side_stream)
    out = fp8_linear(x, weight, scale, bias, segments=segments, block=block, quantize_activations=quantize_activations,
                     x_fp8=x_fp8, counters=counters, pdl=pdl)
    join(side_stream, x.device)
    split.expand(out, lora, T, n_out, cfg, shrunk)
    return out
