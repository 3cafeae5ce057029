"""Sharded checkpoint loading: each rank reads only its slices (safetensors `get_slice`), never a whole
tensor it does not keep, with the single-device loader's strictness.

The checkpoint is planned against the FULL shapes (`models.weights`' plan: every key lands, every
destination element is written once, shapes and FP8 dtypes match, all from the headers) and then each copy
reads the rank's cut (`rules.ShardPlan.cut`; an FP8 scale's by `scales.scale_cut`) of its key. Per-expert
keys of experts another rank owns (EP) are not read at all; a bias only rank 0 adds (`ShardPlan.drops`) is
zero elsewhere. A vocab-parallel destination is one padded row block: rows past the vocabulary stay zero.
Quantize-on-load (`--quantization fp8` on a high-precision checkpoint) quantizes the rank's slice after
reading it: its blocks are the global blocks (`scales`), so it equals the cut of the globally quantized
weight. A per-tensor scale ([1] or a scalar on disk) is read whole.
"""

from __future__ import annotations

from pathlib import Path

import torch

from moelora.config import ModelConfig
from moelora.models.weights import (
    KeyTarget,
    _destination_view,
    _plan,
    _read_headers,
    _row_segments,
    _shard_files,
    declared_mtp_layers,
)
from moelora.parallel.rules import Cut, ShardPlan
from moelora.parallel.scales import rank_cuts
from moelora.quant.checkpoint import FP8Loading, is_scale, scale_name


def load_sharded_checkpoint(model_dir, params: dict[str, torch.Tensor], full_shapes: dict[str, tuple[int, ...]],
                            plan: ShardPlan, cfg: ModelConfig, quant: FP8Loading | None = None) -> None:
    """Fill `params` (this rank's destinations, by name) from the checkpoint; `full_shapes` are the
    unsharded shapes of the same names; `quant` the model's FP8 rules. Raises CheckpointError as
    `load_checkpoint` does, ConfigError for an FP8 block split off its blocks."""
    from safetensors import safe_open

    dtypes: dict[str, str] = {}
    headers = _read_headers(_shard_files(Path(model_dir)), dtypes)
    meta = {name: torch.empty(full_shapes[name], dtype=dest.dtype, device="meta") for name, dest in params.items()}
    copies = _plan(headers, meta, quant, dtypes, declared_mtp_layers(Path(model_dir)))
    cuts = rank_cuts(params, full_shapes, plan, cfg, quant and quant.cfg)
    with torch.no_grad():
        for name, dest in params.items():
            if cuts[name] is not None and dest.is_floating_point():
                dest.zero_()  # vocab padding rows; everything else is overwritten below
        for path, items in copies.items():
            with safe_open(str(path), framework="pt") as f:
                for key, target, mode in items:
                    if plan.drops(target.name):
                        params[target.name].zero_()
                        continue
                    place = _place(params[target.name], target, cuts[target.name], plan, cfg)
                    if place is None:
                        continue  # another rank's expert: not read
                    local, view, cut = place
                    src = f.get_slice(key)
                    shape = src.get_shape()
                    if quant is not None and is_scale(target.name) and len(shape) <= 1:
                        data = f.get_tensor(key)  # a per-tensor scale: whole on every rank
                    else:
                        data = _read(src, cut, len(shape))
                    if mode == "quantize":
                        scale = _destination_view(params[scale_name(target.name)], local)
                        quant.quantize(data, view, scale, _row_segments(target, view))
                    elif quant is not None:
                        quant.copy(data, view[tuple(slice(0, n) for n in data.shape)] if data.dim() > 1 else view)
                    else:
                        view[tuple(slice(0, n) for n in data.shape)].copy_(data)  # vocab: padding stays zero


def _place(dest: torch.Tensor, target: KeyTarget, cut: Cut | None, plan: ShardPlan, cfg: ModelConfig):
    """(local target, destination view, cut of the checkpoint tensor), or None for another rank's expert."""
    if target.expert is None:  # a whole tensor: its cut
        return target, dest, cut
    e0, ne = plan.experts(cfg)
    if not e0 <= target.expert < e0 + ne:
        return None
    local = KeyTarget(target.name, target.expert - e0, target.half)
    inner = None
    if cut is not None:  # the per-expert tensor's own dims: the fused cut without its expert dim
        inner = tuple((dim - 1, ranges[:1]) for dim, ranges in cut if dim > 0)
    return local, _destination_view(dest, local), inner


def _read(src, cut: Cut | None, ndim: int) -> torch.Tensor:
    """The cut of a safetensors slice, reading only those ranges (one read per range of a split dim)."""
    if not cut:
        return src[tuple(slice(None) for _ in range(ndim))]
    index = [slice(None)] * ndim
    split_dim, split_ranges = None, ()
    for dim, ranges in cut:
        if len(ranges) == 1:
            index[dim] = slice(*ranges[0])
        else:
            split_dim, split_ranges = dim, ranges
    if split_dim is None:
        return src[tuple(index)]
    parts = []
    for lo, hi in split_ranges:
        index[split_dim] = slice(lo, hi)
        parts.append(src[tuple(index)])
    return torch.cat(parts, dim=split_dim)
