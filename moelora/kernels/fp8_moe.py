"""FP8 expert weights in the fused MoE GEMMs: `moe_gemm`'s K loops on e4m3 weights and the launch arguments
that switch them on (contract 10: same plan, tiles, epilogues and LoRA paths).

Shape legend: H hidden, I expert intermediate, E experts, BM x BN x BK a GEMM tile (BK = 128).
  w_gate_up [E, 2I, H] e4m3, scale [E, 2 ceil(I/128), ceil(H/128)] (block: gate then up grid rows) or
  [E, 2I, 1] (one per output row); w_down [E, H, I] e4m3, scale [E, ceil(H/128), ceil(I/128)] or [E, H, 1]
Scales are fp32 multipliers (w ~ q * s); a K step is one scale block. W8A8: x, then h (up to the plan's
`num_padded` rows), quantized per token and 128 columns (`fp8_quant`), e4m3 dots (transposed below BM = 64 from
BN = 64: `w8a8_dot_t`); W8A16: the weight tile upcast in registers as the MMA's operand (`w8a16_dot`). Needs
compute capability >= 8.9 (`check_fp8` raises).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from moelora.kernels.args import FP8Rows
from moelora.kernels.checks import cdiv, need
from moelora.kernels.fp8_quant import GROUP, per_token_group_quant, w8a8_dot_t, w8a16_dot
from moelora.kernels.moe_config import (
    FusedMoEConfig,
    load_table,
    pick_entry,
    shape_key,
    table_file,
    tuned_fused_moe_config,
)

FP8_DTYPE = torch.float8_e4m3fn


@dataclass(frozen=True)
class FP8ExpertScales:
    """FP8 expert weights' scales (module docstring); block: 128 x 128 (else per output row); W8A8 or W8A16."""

    gate_up: torch.Tensor
    down: torch.Tensor
    block: bool = True
    quantize_activations: bool = False


def fp8_tiles(config: FusedMoEConfig) -> FusedMoEConfig:
    """A bf16 table entry's tiles for FP8 weights: K steps of one scale block (128), no TMA."""
    return replace(config, gate_up=replace(config.gate_up, block_k=GROUP), down=replace(config.down, block_k=GROUP),
                   use_tma=False)


def fp8_table_key(E: int, H: int, inter: int, quantize_activations: bool) -> str:
    """The table key of FP8 expert entries: W8A16 "...,dtype=float8_e4m3fn", W8A8 the same + ",act=float8_e4m3fn"
    (the two K loops differ, and so do their best tiles)."""
    return shape_key(E, H, inter, FP8_DTYPE) + (",act=float8_e4m3fn" if quantize_activations else "")


@functools.lru_cache(maxsize=1024)
def fp8_moe_config(E: int, H: int, inter: int, T: int, K: int, act_dtype: torch.dtype, device_name: str,
                   table: str | None, quantize_activations: bool = False) -> FusedMoEConfig:
    """The table's FP8 entry for this activation mode, else its W8A16 one, else the bf16 entry's `fp8_tiles`."""
    path = table_file(device_name, table)
    configs = load_table(path)
    for key in dict.fromkeys((fp8_table_key(E, H, inter, quantize_activations), fp8_table_key(E, H, inter, False))):
        if configs.get(key):
            return pick_entry(configs[key], T)
    return fp8_tiles(tuned_fused_moe_config(E, H, inter, T, K, act_dtype, device_name, path))


def check_fp8(x: torch.Tensor, E: int, H: int, inter: int, scales: FP8ExpertScales | None,
              config: FusedMoEConfig, w_gate_up: torch.Tensor) -> None:
    """Refuse FP8 weights without scales, scales of the wrong shape, tiles off the 128 grid, TMA, old GPUs."""
    fp8_weights = w_gate_up.dtype == FP8_DTYPE
    need(fp8_weights == (scales is not None), lambda: f"FP8 weights need their scales (fp8=FP8ExpertScales) and "
         f"scales FP8 weights: weights {w_gate_up.dtype}, scales {'given' if scales is not None else 'none'}")
    if scales is None:
        return
    if scales.block:
        want = {"gate_up": (E, 2 * cdiv(inter, GROUP), cdiv(H, GROUP)), "down": (E, cdiv(H, GROUP), cdiv(inter, GROUP))}
    else:
        want = {"gate_up": (E, 2 * inter, 1), "down": (E, H, 1)}
    for name, shape in want.items():
        t = getattr(scales, name)
        need(tuple(t.shape) == shape and t.dtype == torch.float32 and t.is_contiguous() and t.device == x.device,
             lambda t=t, name=name, shape=shape: f"fp8.{name} scale must be contiguous fp32 {shape} on {x.device}, "
             f"got {tuple(t.shape)} {t.dtype}")
    for which, tile in (("gate_up", config.gate_up), ("down", config.down)):
        need(tile.block_k == GROUP, lambda which=which, tile=tile: f"FP8 weights need K steps of one scale block: "
             f"{which} block_k must be {GROUP}, got {tile.block_k} (fp8_moe.fp8_tiles)")
    need(not config.use_tma, "use_tma is not supported on FP8 weights (fp8_moe.fp8_tiles turns it off)")
    if x.is_cuda:
        need(torch.cuda.get_device_capability(x.device) >= (8, 9), "FP8 expert kernels need compute capability "
             ">= 8.9 (Ada / Hopper): use kernel_backend='torch' on this GPU")


def fp8_launch_args(scales: FP8ExpertScales | None, which: str, inter: int, a: torch.Tensor,
                    rows: torch.Tensor | None = None, a_fp8: FP8Rows | None = None, pdl: bool = False) -> dict:
    """The gate_up or down kernel's FP8 arguments ({} without FP8); `a` (rows below `rows`) quantized for W8A8,
    unless its producer did (`a_fp8`); `pdl`: the quantization's (`kernels.pdl`)."""
    if scales is None:
        return {}
    s = getattr(scales, which)
    gn = GROUP if scales.block else 1
    gate_rows = cdiv(inter, gn) if which == "gate_up" else 0
    aq, aqs = (a, s) if not scales.quantize_activations else (  # W8A16: unused dummies
        a_fp8 if a_fp8 is not None else per_token_group_quant(a, rows, pdl=pdl))
    return dict(ws_ptr=s, stride_wse=s.stride(0), stride_wsn=s.stride(1), stride_wsk=s.stride(2) if scales.block else 0,
                ws_gate_rows=gate_rows, aq_ptr=aq, aqs_ptr=aqs, stride_aq=aq.stride(0), stride_aqs=aqs.stride(0),
                B_FP8=True, A_FP8=scales.quantize_activations, SCALE_GN=gn)


@triton.jit
def _w8a8_rows(q_rows, s_rows, k0, valid, k_ok, BK: tl.constexpr):
    """One K step's e4m3 activation rows [BM, BK] and their scales [BM] (one scale block)."""
    offs_k = k0 + tl.arange(0, BK)
    aq = tl.load(q_rows[:, None] + offs_k[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
    return aq, tl.load(s_rows + k0 // BK, mask=valid, other=0.0)


@triton.jit
def _w8a8_dot(q_rows, s_rows, k0, valid, k_ok, w, w_scale, BK: tl.constexpr):
    """One K step (one scale block) on e4m3 activations (q_rows, scales s_rows) and weights w [BK, BN]:
    dot(A_q, W_q) * a_s * w_s, fp32 [BM, BN] (the e4m3 MMA; wgmma from BM = 64)."""
    aq, a_scale = _w8a8_rows(q_rows, s_rows, k0, valid, k_ok, BK)
    return tl.dot(aq, w) * (a_scale[:, None] * w_scale[None, :])


@triton.jit
def fp8_gate_up_steps(x_rows, q_rows, s_rows, valid, w_e, ws_e, offs_n, H, inter, stride_wn, stride_wsn, stride_wsk,
                      gate_rows, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GN: tl.constexpr,
                      A_FP8: tl.constexpr):
    """gate_up_kernel's K loop on e4m3 weights of expert e (w_e, ws_e: its weight and scale) over the rows' x
    (x_rows, W8A16) or their e4m3 copy and its scales (q_rows, s_rows, W8A8): (acc_g, acc_u) [BM, BN]."""
    offs_k = tl.arange(0, BK)
    n_ok = offs_n < inter
    sg_ptrs = ws_e + (offs_n // GN) * stride_wsn
    su_ptrs = ws_e + (gate_rows + offs_n // GN) * stride_wsn
    if A_FP8 and (BM >= 64 or BN < 64):  # untransposed: the wgmma from BM = 64, mma.sync below at BN < 64
        acc_g = tl.zeros((BM, BN), tl.float32)
        acc_u = tl.zeros((BM, BN), tl.float32)
        w_ptrs = w_e + offs_n[None, :] * stride_wn + offs_k[:, None]  # [BK, BN]
        for k0 in range(0, H, BK):
            k_ok = (k0 + offs_k) < H
            w_ok = n_ok[None, :] & k_ok[:, None]
            kb = (k0 // BK) * stride_wsk
            acc_g += _w8a8_dot(q_rows, s_rows, k0, valid, k_ok, tl.load(w_ptrs + k0, mask=w_ok, other=0.0),
                               tl.load(sg_ptrs + kb, mask=n_ok, other=0.0), BK)
            acc_u += _w8a8_dot(q_rows, s_rows, k0, valid, k_ok,
                               tl.load(w_ptrs + inter * stride_wn + k0, mask=w_ok, other=0.0),
                               tl.load(su_ptrs + kb, mask=n_ok, other=0.0), BK)
    else:  # transposed: the weight tile is the MMA's M side (`w8a8_dot_t`, `w8a16_dot`)
        acc_gt = tl.zeros((BN, BM), tl.float32)
        acc_ut = tl.zeros((BN, BM), tl.float32)
        w_ptrs = w_e + offs_n[:, None] * stride_wn + offs_k[None, :]  # [BN, BK]
        for k0 in range(0, H, BK):
            k_ok = (k0 + offs_k) < H
            w_ok = n_ok[:, None] & k_ok[None, :]
            kb = (k0 // BK) * stride_wsk
            if A_FP8:
                aq, a_scale = _w8a8_rows(q_rows, s_rows, k0, valid, k_ok, BK)
                acc_gt = w8a8_dot_t(acc_gt, aq, a_scale, tl.load(w_ptrs + k0, mask=w_ok, other=0.0),
                                    tl.load(sg_ptrs + kb, mask=n_ok, other=0.0))
                acc_ut = w8a8_dot_t(acc_ut, aq, a_scale, tl.load(w_ptrs + inter * stride_wn + k0, mask=w_ok,
                                                                   other=0.0),
                                    tl.load(su_ptrs + kb, mask=n_ok, other=0.0))
            else:
                a_t = tl.trans(tl.load(x_rows[:, None] + (k0 + offs_k)[None, :],
                                       mask=valid[:, None] & k_ok[None, :], other=0.0))
                acc_gt = w8a16_dot(acc_gt, a_t, tl.load(w_ptrs + k0, mask=w_ok, other=0.0),
                                   tl.load(sg_ptrs + kb, mask=n_ok, other=0.0))
                acc_ut = w8a16_dot(acc_ut, a_t, tl.load(w_ptrs + inter * stride_wn + k0, mask=w_ok, other=0.0),
                                   tl.load(su_ptrs + kb, mask=n_ok, other=0.0))
        acc_g = tl.trans(acc_gt)
        acc_u = tl.trans(acc_ut)
    return acc_g, acc_u


@triton.jit
def fp8_down_steps(h_rows, q_rows, s_rows, valid, w_e, ws_e, offs_n, H, inter, stride_wn, stride_wsn, stride_wsk,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GN: tl.constexpr, A_FP8: tl.constexpr):
    """down_kernel's K loop on e4m3 weights of expert e, as fp8_gate_up_steps: acc [BM, BN]."""
    offs_k = tl.arange(0, BK)
    n_ok = offs_n < H
    s_ptrs = ws_e + (offs_n // GN) * stride_wsn
    if A_FP8 and (BM >= 64 or BN < 64):  # untransposed (as fp8_gate_up_steps)
        acc = tl.zeros((BM, BN), tl.float32)
        w_ptrs = w_e + offs_n[None, :] * stride_wn + offs_k[:, None]
        for k0 in range(0, inter, BK):
            k_ok = (k0 + offs_k) < inter
            wt = tl.load(w_ptrs + k0, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            acc += _w8a8_dot(q_rows, s_rows, k0, valid, k_ok, wt,
                             tl.load(s_ptrs + (k0 // BK) * stride_wsk, mask=n_ok, other=0.0), BK)
    else:  # transposed: the weight tile is the MMA's M side
        acc_t = tl.zeros((BN, BM), tl.float32)
        w_ptrs = w_e + offs_n[:, None] * stride_wn + offs_k[None, :]
        for k0 in range(0, inter, BK):
            k_ok = (k0 + offs_k) < inter
            if A_FP8:
                aq, a_scale = _w8a8_rows(q_rows, s_rows, k0, valid, k_ok, BK)
                acc_t = w8a8_dot_t(acc_t, aq, a_scale, tl.load(w_ptrs + k0, mask=n_ok[:, None] & k_ok[None, :],
                                                                 other=0.0),
                                   tl.load(s_ptrs + (k0 // BK) * stride_wsk, mask=n_ok, other=0.0))
            else:
                a_t = tl.trans(tl.load(h_rows[:, None] + (k0 + offs_k)[None, :],
                                       mask=valid[:, None] & k_ok[None, :], other=0.0))
                acc_t = w8a16_dot(acc_t, a_t, tl.load(w_ptrs + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0),
                                  tl.load(s_ptrs + (k0 // BK) * stride_wsk, mask=n_ok, other=0.0))
        acc = tl.trans(acc_t)
    return acc
