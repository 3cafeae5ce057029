"""FP8 expert weights in the fused MoE GEMMs: the K loops of `moe_gemm`'s gate_up / down kernels on e4m3
weights with their scales, and the launch arguments that switch them on (contract 10: same plan, tiles,
epilogues and LoRA paths; only the weight tiles and their scaling differ).

Shape legend: T tokens, H hidden, I expert intermediate, E experts, BM x BN x BK a GEMM tile (BK = 128).
  w_gate_up [E, 2I, H] e4m3, scale [E, 2 ceil(I/128), ceil(H/128)] (block: the gate then the up grid rows)
    or [E, 2I, 1] (channel / tensor, one per output row); w_down [E, H, I] e4m3, scale [E, ceil(H/128),
    ceil(I/128)] or [E, H, 1]. Scales are fp32 multipliers (w ~ q * s).
Each K step is one 128-column scale block: acc += dot(A, B_q) * a_scale[m] * b_scale[n] (fp32 accumulate).
- W8A8 (`FP8ExpertScales.quantize_activations`): the activation tile (x rows for gate_up, h rows for down) is
  quantized as it is loaded, per row and 128-column group (`fp8_quant.quant_tile`, DeepSeek's 1 x 128
  recipe; a per-token scheme runs these finer groups), then an e4m3 x e4m3 tl.dot: Hopper's FP8 MMA. The
  quantization runs in the kernel, so no quantized copy of x or h is written and the plan's padding rows
  cost nothing.
- W8A16 (off): each weight tile is upcast to the activations' dtype in registers, then the bf16 MMA.
Both need FP8 conversions in Triton: compute capability >= 8.9 (the engine refuses an older GPU, ConfigError).
Channel scales run the same loops with a broadcast scale (one row per output column, no K index).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from moelora.kernels.fp8_quant import GROUP, quant_tile
from moelora.kernels.moe_config import FusedMoEConfig, _load_table, _package_table, shape_key, tuned_fused_moe_config

FP8_DTYPE = torch.float8_e4m3fn


@dataclass(frozen=True)
class FP8ExpertScales:
    """The scales of FP8 expert weights (shapes in the module docstring) and their GEMMs' activation mode.
    block: 128 x 128 scale blocks (False: one scale per output row). quantize_activations: W8A8 (else W8A16)."""

    gate_up: torch.Tensor
    down: torch.Tensor
    block: bool = True
    quantize_activations: bool = False


def fp8_tiles(config: FusedMoEConfig) -> FusedMoEConfig:
    """A bf16 table entry's tiles for FP8 weights: K steps of one scale block (128), no TMA."""
    return replace(config, gate_up=replace(config.gate_up, block_k=GROUP), down=replace(config.down, block_k=GROUP),
                   use_tma=False)


@functools.lru_cache(maxsize=1024)
def fp8_moe_config(E: int, H: int, inter: int, T: int, K: int, act_dtype: torch.dtype, device_name: str,
                   table: str | None) -> FusedMoEConfig:
    """The table's FP8 entry for this shape (`tune_fused_moe.py --dtype fp8`), else its entry for the
    activations' dtype with `fp8_tiles` (the LoRA path picks stay the table's)."""
    table_file = table or _package_table(device_name)
    has_fp8 = shape_key(E, H, inter, FP8_DTYPE) in _load_table(table_file)
    cfg = tuned_fused_moe_config(E, H, inter, T, K, FP8_DTYPE if has_fp8 else act_dtype, device_name, table_file)
    return cfg if has_fp8 else fp8_tiles(cfg)


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def check_fp8(x: torch.Tensor, E: int, H: int, inter: int, scales: FP8ExpertScales | None,
              config: FusedMoEConfig, w_gate_up: torch.Tensor) -> None:
    """Refuse FP8 weights without scales, scales of the wrong shape, tiles off the 128 grid, TMA, old GPUs."""
    fp8_weights = w_gate_up.dtype == FP8_DTYPE
    _need(fp8_weights == (scales is not None), f"FP8 weights need their scales (fp8=FP8ExpertScales) and scales "
          f"FP8 weights: weights {w_gate_up.dtype}, scales {'given' if scales is not None else 'none'}")
    if scales is None:
        return
    cdiv = triton.cdiv
    if scales.block:
        want = {"gate_up": (E, 2 * cdiv(inter, GROUP), cdiv(H, GROUP)), "down": (E, cdiv(H, GROUP), cdiv(inter, GROUP))}
    else:
        want = {"gate_up": (E, 2 * inter, 1), "down": (E, H, 1)}
    for name, shape in want.items():
        t = getattr(scales, name)
        _need(tuple(t.shape) == shape and t.dtype == torch.float32 and t.is_contiguous() and t.device == x.device,
              f"fp8.{name} scale must be contiguous fp32 {shape} on {x.device}, got {tuple(t.shape)} {t.dtype}")
    for which, tile in (("gate_up", config.gate_up), ("down", config.down)):
        _need(tile.block_k == GROUP, f"FP8 weights need K steps of one scale block: {which} block_k must be "
              f"{GROUP}, got {tile.block_k} (fp8_moe.fp8_tiles)")
    _need(not config.use_tma, "use_tma is not supported on FP8 weights (fp8_moe.fp8_tiles turns it off)")
    if x.is_cuda:
        _need(torch.cuda.get_device_capability(x.device) >= (8, 9), "FP8 expert kernels need compute capability "
              ">= 8.9 (Ada / Hopper): use kernel_backend='torch' on this GPU")


def fp8_launch_args(scales: FP8ExpertScales | None, which: str, inter: int) -> dict:
    """The gate_up or down kernel's FP8 arguments ({} without FP8: the kernels' defaults, flags off)."""
    if scales is None:
        return {}
    s = getattr(scales, which)
    gn = GROUP if scales.block else 1
    gate_rows = triton.cdiv(inter, gn) if which == "gate_up" else 0
    return dict(ws_ptr=s, stride_wse=s.stride(0), stride_wsn=s.stride(1), stride_wsk=s.stride(2) if scales.block else 0,
                ws_gate_rows=gate_rows, B_FP8=True, A_FP8=scales.quantize_activations, SCALE_GN=gn)


@triton.jit
def _scaled_dot(a, b, b_scale, A_FP8: tl.constexpr):
    """One K step (one scale block): dot(a, b_q) * a_scale * b_scale, fp32 [BM, BN]."""
    if A_FP8:
        aq, a_scale = quant_tile(a)
        return tl.dot(aq, b) * (a_scale[:, None] * b_scale[None, :])
    return tl.dot(a, b.to(a.dtype)) * b_scale[None, :]


@triton.jit
def fp8_gate_up_steps(x_rows, valid, w_e, ws_e, offs_n, H, inter, stride_wn, stride_wsn, stride_wsk, gate_rows,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GN: tl.constexpr, A_FP8: tl.constexpr):
    """gate_up_kernel's K loop on e4m3 weights of expert e (w_e, ws_e: its weight and scale): (acc_g, acc_u)."""
    offs_k = tl.arange(0, BK)
    n_ok = offs_n < inter
    acc_g = tl.zeros((BM, BN), tl.float32)
    acc_u = tl.zeros((BM, BN), tl.float32)
    wg_ptrs = w_e + offs_n[None, :] * stride_wn + offs_k[:, None]
    sg_ptrs = ws_e + (offs_n // GN) * stride_wsn
    su_ptrs = ws_e + (gate_rows + offs_n // GN) * stride_wsn
    for k0 in range(0, H, BK):
        k_ok = (k0 + offs_k) < H
        xt = tl.load(x_rows + (k0 + offs_k)[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        w_ok = n_ok[None, :] & k_ok[:, None]
        wg = tl.load(wg_ptrs + k0, mask=w_ok, other=0.0)
        wu = tl.load(wg_ptrs + inter * stride_wn + k0, mask=w_ok, other=0.0)
        kb = (k0 // BK) * stride_wsk
        acc_g += _scaled_dot(xt, wg, tl.load(sg_ptrs + kb, mask=n_ok, other=0.0), A_FP8)
        acc_u += _scaled_dot(xt, wu, tl.load(su_ptrs + kb, mask=n_ok, other=0.0), A_FP8)
    return acc_g, acc_u


@triton.jit
def fp8_down_steps(h_rows, valid, w_e, ws_e, offs_n, H, inter, stride_wn, stride_wsn, stride_wsk,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GN: tl.constexpr, A_FP8: tl.constexpr):
    """down_kernel's K loop on e4m3 weights of expert e: acc [BM, BN]."""
    offs_k = tl.arange(0, BK)
    n_ok = offs_n < H
    acc = tl.zeros((BM, BN), tl.float32)
    w_ptrs = w_e + offs_n[None, :] * stride_wn + offs_k[:, None]
    s_ptrs = ws_e + (offs_n // GN) * stride_wsn
    for k0 in range(0, inter, BK):
        k_ok = (k0 + offs_k) < inter
        ht = tl.load(h_rows + (k0 + offs_k)[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        wt = tl.load(w_ptrs + k0, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        acc += _scaled_dot(ht, wt, tl.load(s_ptrs + (k0 // BK) * stride_wsk, mask=n_ok, other=0.0), A_FP8)
    return acc
