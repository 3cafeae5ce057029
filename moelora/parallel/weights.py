"""Sharded checkpoint loading: each rank reads only its slices (safetensors `get_slice`), never a whole
tensor it does not keep, with the single-device loader's strictness.

The checkpoint is planned against the FULL shapes (`models.weights`' plan: every key lands, every
destination element is written once, shapes match, all from the headers) and then each copy reads the
rank's cut (`rules.ShardPlan.cut`) of its key. Per-expert keys of experts another rank owns (EP) are not
read at all; a bias only rank 0 adds (`ShardPlan.drops`) is zero elsewhere. A vocab-parallel destination
is one padded row block: rows past the vocabulary stay zero.
"""

from __future__ import annotations

from pathlib import Path

import torch

from moelora.config import ModelConfig
from moelora.models.weights import KeyTarget, _destination_view, _plan, _read_headers, _shard_files
from moelora.parallel.rules import Cut, ShardPlan


def load_sharded_checkpoint(model_dir, params: dict[str, torch.Tensor], full_shapes: dict[str, tuple[int, ...]],
                            plan: ShardPlan, cfg: ModelConfig) -> None:
    """Fill `params` (this rank's destinations, by name) from the checkpoint; `full_shapes` are the
    unsharded shapes of the same names. Raises CheckpointError as `load_checkpoint` does."""
    from safetensors import safe_open

    headers = _read_headers(_shard_files(Path(model_dir)))
    meta = {name: torch.empty(full_shapes[name], device="meta") for name in params}
    copies = _plan(headers, meta)
    with torch.no_grad():
        for name, dest in params.items():
            if plan.cut(name, cfg) is not None and dest.is_floating_point():
                dest.zero_()  # vocab padding rows; everything else is overwritten below
        for path, items in copies.items():
            with safe_open(str(path), framework="pt") as f:
                for key, target, _mode in items:  # "copy": FP8 is refused with several ranks
                    if plan.drops(target.name):
                        params[target.name].zero_()
                        continue
                    _copy(f.get_slice(key), params[target.name], target, plan.cut(target.name, cfg), plan, cfg)


def _copy(src, dest: torch.Tensor, target: KeyTarget, cut: Cut | None, plan: ShardPlan, cfg: ModelConfig) -> None:
    if target.expert is None:  # a whole tensor: read its cut
        data = _read(src, cut, len(src.get_shape()))
        view = dest[tuple(slice(0, n) for n in data.shape)]  # vocab: the rows read; padding stays zero
        view.copy_(data)
        return
    e0, ne = plan.experts(cfg)
    if not e0 <= target.expert < e0 + ne:
        return  # another rank's expert: not read
    local = KeyTarget(target.name, target.expert - e0, target.half)
    inner = None
    if cut is not None:  # the per-expert tensor's own dims: the fused cut without its expert dim
        inner = tuple((dim - 1, ranges[:1]) for dim, ranges in cut if dim > 0)
    _destination_view(dest, local).copy_(_read(src, inner, len(src.get_shape())))


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
