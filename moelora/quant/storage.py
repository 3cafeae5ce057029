"""The FP8 weight container of a layer: e4m3 weight + fp32 scale parameters, and the weight a GEMM reads.

Shape legend: E experts (leading dims, any), N output rows in G row segments (N = sum N_g), K input
columns. A layer built with an `FP8Config` holds `weight` [.., N, K] float8_e4m3fn and its scale
[.., sum_g ceil(N_g/128), ceil(K/128)] (block) or [.., N, 1] (channel / tensor), both fp32 and frozen
(`requires_grad=False`), under the checkpoint's names (`weight_scale_inv`, experts'
`gate_up_proj_scale_inv` / `down_proj_scale_inv`); the loader fills them (`quant.checkpoint`).

`dense_weight` is the high-precision weight the torch twin reads: it dequantizes into a transient tensor of
the activations' dtype, per call and per layer, so the twin is "dequantize, then the existing reference"
(never a high-precision copy of the model kept in memory; the engine's profile forward measures the
transient's peak). The Triton backend reads the e4m3 weight and its scale directly (`kernels/fp8_moe.py`,
`kernels/fp8_linear.py`), except MLA's absorbed decode, which reads `kv_b_proj` through `dense_weight`.
`activation_quantizer` is the W8A8 twin's input rounding, applied to the base GEMMs' inputs only (LoRA reads
the activations as they are).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from moelora.errors import ConfigError
from moelora.quant.config import FP8Config
from moelora.quant.fp8 import FP8_DTYPE, cdiv, dequantize_channels, dequantize_segments, fake_quantize_groups


def scale_shape(cfg: FP8Config, segments: tuple[int, ...], cols: int) -> tuple[int, int]:
    """The stored scale of a [sum(segments), cols] weight (without leading dims)."""
    if cfg.weights == "block":
        return sum(cdiv(n, cfg.block[0]) for n in segments), cdiv(cols, cfg.block[1])
    return sum(segments), 1


def fp8_parameters(cfg: FP8Config, segments: tuple[int, ...], cols: int, leading: tuple[int, ...] = ()
                   ) -> tuple[nn.Parameter, nn.Parameter]:
    """(weight [*leading, N, K] e4m3, scale [*leading, *scale_shape] fp32), uninitialised, frozen."""
    weight = torch.empty(*leading, sum(segments), cols, dtype=FP8_DTYPE)
    scale = torch.ones(*leading, *scale_shape(cfg, segments, cols), dtype=torch.float32)
    return nn.Parameter(weight, requires_grad=False), nn.Parameter(scale, requires_grad=False)


def scale_rows(cfg: FP8Config, segments: tuple[int, ...], index: int) -> slice:
    """The scale rows of row segment `index` of a weight of `segments`."""
    sizes = [cdiv(n, cfg.block[0]) for n in segments] if cfg.weights == "block" else list(segments)
    start = sum(sizes[:index])
    return slice(start, start + sizes[index])


def dense_weight(weight: torch.Tensor, scale: torch.Tensor, cfg: FP8Config, segments: tuple[int, ...],
                 dtype: torch.dtype) -> torch.Tensor:
    """The high-precision weight [.., N, K] in `dtype` the torch twin reads, from e4m3 `weight` and its `scale`
    (a new, transient tensor)."""
    if cfg.weights == "block":
        return dequantize_segments(weight, scale, segments, cfg.block, dtype)
    return dequantize_channels(weight, scale, dtype)


def activation_quantizer(cfg: FP8Config | None) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The W8A8 twin's rounding of a base GEMM's input [.., K] (None: W8A16, the input as it is)."""
    if cfg is None or not cfg.quantize_activations or cfg.activations == "none":
        return None
    return partial(fake_quantize_groups, group=cfg.activation_group)


def check_ignored(model: nn.Module, cfg: FP8Config) -> None:
    """Refuse a checkpoint that leaves one of moelora's FP8 projections unquantized (its ignore list
    names it): every projection of an FP8 model is held in FP8."""
    names = [n for n, m in model.named_modules() if getattr(m, "quant", None) is not None and cfg.ignores(n)]
    if names:
        raise ConfigError(f"quantization_config leaves {len(names)} projection(s) unquantized, e.g. {names[:4]}: "
                          f"moelora holds every attention, MLP and expert projection of an FP8 checkpoint in FP8 "
                          f"(only routers, norms, embeddings and the LM head may stay high precision)")


def fp8_weight_sites(model: nn.Module) -> list[tuple[nn.Module, str, str, tuple[int, ...]]]:
    """(module, weight name, scale name, row segments) of every FP8 parameter `model` owns (a merged
    projection's, not again its segments' views)."""
    return [(mod, w, s, segs) for mod in model.modules() if getattr(mod, "quant", None) is not None
            for w, s, segs in mod.fp8_weights() if w in mod._parameters]


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of the model's parameters by dtype name (the weights; LoRA slots are buffers)."""
    out: dict[str, int] = {}
    for p in model.parameters():
        key = str(p.dtype).removeprefix("torch.")
        out[key] = out.get(key, 0) + p.numel() * p.element_size()
    return out
