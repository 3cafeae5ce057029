"""An adapter as one rank holds it, read slice by slice from its safetensors (LoRA shards with its base, contract 9).

Shape legend: E experts (e0.. e0+Ne this rank's under EP), r rank, I expert intermediate, H hidden.

For a site whose base weight W [.., out, in] has a cut (`rules.ShardPlan.cut`): a cut of the output dim
keeps those rows of B [.., out, r] and all of A (column-parallel: A whole, B split by output); a cut of the
input dim keeps those columns of A [.., r, in] and all of B (row-parallel: each rank adds (x_i A_i) B to
its partial sum before the base all-reduce); a cut of the expert dim keeps those experts of both
(routed-expert LoRA lives with its expert). Site ranks are unchanged, so every rank turns the same sites
on and the step's `LoRABatch` (slots, ranks) is the same everywhere.

The file is first checked whole from its header (the one-process loader's `canonicalize` on meta tensors of
the full shapes: unknown, missing and mis-shaped keys are named as one process names them); then each on-disk
tensor is read as the slices that become the rank's cut, per PEFT layout (`lora.formats`):
- dense sites, (a) per-expert keys and (c) packed 3D tensors: the cut's row / column / expert ranges;
  per-expert keys of another rank's experts are not read at all;
- (b) `target_parameters` (A [E*r, in] expert-major, B [out, E*r] with B_e = B[:, e::E]): under EP A's
  rows [e0 r, (e0+Ne) r) and, for B, r column ranges [k E + e0, k E + e0 + Ne) (one read each: the strided
  columns cost r reads, not a wider one; the page cache still maps the rows they cross); under TP as (c).
NaN / Inf is refused in what the rank reads; every element is read by some rank, and a load failing on
one rank fails on all, so the refusal is the one-process one.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from moelora.config import ModelConfig
from moelora.errors import AdapterError
from moelora.lora.adapter import LoRAAdapter, LoRAWeights
from moelora.lora.formats import (
    LoRAHyperParams,
    _classify,
    _expert_sites,
    _identify_wrapper,
    _Module,
    _pair,
    _put,
    _site_name,
    _stack_experts,
    canonicalize,
)
from moelora.lora.loader import load_adapter, refuse_non_finite, refuse_vocab_keys, weights_file
from moelora.parallel.rules import Cut, ShardPlan
from moelora.parallel.weights import _read


def weight_name(site: str) -> str:
    """The base weight a site's delta is added to."""
    if site.endswith((".mlp.experts.gate_up", ".mlp.experts.down")):
        return site + "_proj"
    return site + ".weight"


def load_adapter_shard(path: str | Path, config: ModelConfig, *, name: str, max_rank: int,
                       plan: ShardPlan) -> LoRAAdapter:
    """`load_adapter` for rank `plan.rank`: its cut of every site, reading only those slices of the file."""
    if plan.size == 1:
        return load_adapter(path, config, name=name, max_rank=max_rank)
    return load_adapter(path, config, name=name, max_rank=max_rank,
                        read=lambda root, hp, cfg: read_rank_sites(root, hp, cfg, plan))


def read_rank_sites(root: Path, hp: LoRAHyperParams, cfg: ModelConfig, plan: ShardPlan) -> dict[str, LoRAWeights]:
    from safetensors import safe_open

    file = weights_file(root)
    try:
        handle = safe_open(str(file), framework="pt")
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise AdapterError(f"cannot read {file}: {e}") from None
    with handle as f:
        full = {k: torch.empty(f.get_slice(k).get_shape(), device="meta") for k in f.keys()}  # noqa: SIM118
        refuse_vocab_keys(full)
        canonicalize(full, hp, cfg)  # every strict check, against the full shapes
        return _RankReader(f, hp, cfg, plan).sites(_pair(full, cfg.family))


def _cut(*parts) -> Cut:
    """A read cut from (dim, ranges or None) pairs."""
    return tuple((dim, ranges) for dim, ranges in parts if ranges)


class _RankReader:
    """Reads one rank's slices of the modules of an adapter file already checked whole."""

    def __init__(self, f, hp: LoRAHyperParams, cfg: ModelConfig, plan: ShardPlan):
        self.f, self.hp, self.cfg, self.plan = f, hp, cfg, plan
        self.e0, self.ne = plan.experts(cfg)
        self.local = dataclasses.replace(cfg, num_experts=self.ne,  # the expert sites' rank-local sizes
                                         moe_intermediate_size=plan.local_config(cfg).moe_intermediate_size)
        self.ep_rows = ((self.e0, self.e0 + self.ne),) if plan.expert_parallel else None

    def read(self, key: str, cut: Cut) -> torch.Tensor:
        t = _read_slice(self.f, key, cut)
        refuse_non_finite(key, t)
        return t.float()

    def parts(self, site: str, ndim: int):
        """(output ranges, input ranges) of the site's base weight cut (None: whole)."""
        dims = dict(self.plan.cut(weight_name(site), self.cfg) or ())
        return dims.get(ndim - 2), dims.get(ndim - 1)

    def sites(self, modules: list[_Module]) -> dict[str, LoRAWeights]:
        sites: dict[str, LoRAWeights] = {}
        experts: dict[int, dict] = {}
        per_expert: dict[tuple[int, str], dict[int, tuple]] = {}
        ranks: dict[tuple[int, str], int] = {}
        for m in modules:
            kind, match = _classify(m.norm)
            layer, proj = int(match["layer"]), match.groupdict().get("proj")
            if kind == "expert":
                ranks[(layer, proj)] = max(ranks.get((layer, proj), 0), m.a.shape[0])
                e = int(match["expert"]) - self.e0
                if 0 <= e < self.ne:  # another rank's expert: not read
                    per_expert.setdefault((layer, proj), {})[e] = (m, *self.per_expert(m, proj))
            elif kind == "packed":
                _put(experts, layer, proj, m.name, *self.packed(m, proj))
            elif kind == "wrapper":
                proj, a, b = self.wrapper(m)
                _put(experts, layer, proj, m.name, a, b)
            else:
                sites[_site_name(kind, layer, proj)] = self.dense(m, _site_name(kind, layer, proj))
        for (layer, proj), by_expert in per_expert.items():
            first = by_expert[min(by_expert)][0].name
            _put(experts, layer, proj, first, *_stack_experts(by_expert, self.local, ranks[(layer, proj)]))
        for layer, projs in experts.items():
            sites.update(_expert_sites(layer, projs, self.local))
        return sites

    def dense(self, m: _Module, site: str) -> LoRAWeights:
        out, inn = self.parts(site, 2)
        a = self.read(m.key_a, _cut((1, inn)))
        return LoRAWeights(a.contiguous(), self.read(m.key_b, _cut((0, out))) * self.hp.scaling_of(m.name))

    def _expert_site(self, layer_name: str, proj: str) -> str:
        return layer_name.split(".mlp.")[0] + (".mlp.experts.down" if proj == "down" else ".mlp.experts.gate_up")

    def per_expert(self, m: _Module, proj: str):
        """(a) one expert's [r, in] / [out, r]: a gate or up half keeps its rows of the gate_up cut."""
        out, inn = self.parts(self._expert_site(m.norm, proj), 3)
        a = self.read(m.key_a, _cut((1, inn)))
        return a.contiguous(), self.read(m.key_b, _cut((0, out and out[:1]))) * self.hp.scaling_of(m.name)

    def packed(self, m: _Module, proj: str):
        """(c) [E, r, in] / [E, out, r]: the rank's experts, a separate gate or up its rows of the gate_up cut."""
        out, inn = self.parts(self._expert_site(m.norm, proj), 3)
        if proj != "gate_up":
            out = out and out[:1]
        a = self.read(m.key_a, _cut((0, self.ep_rows), (2, inn)))
        return a.contiguous(), self.read(m.key_b, _cut((0, self.ep_rows), (1, out))) * self.hp.scaling_of(m.name)

    def wrapper(self, m: _Module):
        """(b) PEFT ParamWrapper: -> (proj, a [Ne, r, in], b [Ne, out, r]), as `formats._wrapper_factors`."""
        proj, swapped = _identify_wrapper(m, self.hp, self.cfg)  # m holds the full (meta) shapes
        name = m.name.removesuffix(".base_layer") + f".{proj}_proj"
        r, big_e, ne = self.hp.rank_of(name), self.cfg.num_experts, self.ne
        out, inn = self.parts(self._expert_site(m.norm, proj), 3)
        rows = self.ep_rows and ((self.e0 * r, (self.e0 + ne) * r),)  # expert-major A
        cols = self.ep_rows and tuple((k * big_e + self.e0, k * big_e + self.e0 + ne) for k in range(r))
        if swapped:  # PEFT < 0.19: A [E*r, out], B [in, E*r]
            la, lb = self.read(m.key_a, _cut((0, rows), (1, out))), self.read(m.key_b, _cut((0, inn), (1, cols)))
            a, b = lb.reshape(lb.shape[0], r, ne).permute(2, 1, 0), la.reshape(ne, r, -1).transpose(1, 2)
        else:
            la, lb = self.read(m.key_a, _cut((0, rows), (1, inn))), self.read(m.key_b, _cut((0, out), (1, cols)))
            a, b = la.reshape(ne, r, -1), lb.reshape(lb.shape[0], r, ne).permute(2, 0, 1)
        return proj, a.contiguous(), b * self.hp.scaling_of(name)


def _read_slice(f, key: str, cut: Cut) -> torch.Tensor:
    """The `cut` of tensor `key`, reading only those ranges."""
    src = f.get_slice(key)
    return _read(src, cut or None, len(src.get_shape()))
