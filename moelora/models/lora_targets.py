"""Which modules carry LoRA (`EngineConfig.lora_target_modules`, a `LayerOptions` field the model's constructor
applies): every other site drops its slot buffers, so it launches no LoRA kernel and holds no adapter memory.

A target names modules by dotted name components, as PEFT's `target_modules` do: "q_proj" matches
every `...self_attn.q_proj`, "experts" both routed-expert projections of every MoE layer,
"self_attn" every attention projection, "layers.0.mlp" one layer's MLP. A site stays when some
target is a run of consecutive components of its key. The routed experts' gate_up and down share
one module: a target naming either keeps both. Merged q/k/v share one LoRA buffer, kept while any of
them is targeted (an untargeted one stays at rank 0 and is no adapter site).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from torch import nn

from moelora.errors import ConfigError
from moelora.layers.linear import LinearSegment, MergedLinear
from moelora.layers.moe import Experts

_BUFFERS = {Experts: ("lora_gate_up_a", "lora_gate_up_b", "lora_down_a", "lora_down_b", "lora_gate_up_ranks",
                      "lora_down_ranks")}
_DENSE_BUFFERS = ("lora_a", "lora_b", "lora_ranks")


def matches(key: str, target: str) -> bool:
    return f".{target}." in f".{key}."


def site_kinds(keys: Iterable[str]) -> list[str]:
    """Site keys without their layer prefix ('model.layers.3.self_attn.q_proj' -> 'self_attn.q_proj'),
    deduplicated: how a message names sites."""
    return sorted({re.sub(r"^(.*\.)?layers\.\d+\.", "", k) for k in keys})


def lora_site_owners(model: nn.Module) -> dict[str, nn.Module]:
    """Adapter site key -> the module that owns the site's slot buffers and whose LoRA a layer skips
    while it is idle (`LoRABatch.idle`): the merged q/k/v for its segments, else the site's module."""
    return {key: getattr(mod, "lora_owner", mod) for key, (mod, _) in model.lora_sites().items()}


def _drop(module: nn.Module) -> None:
    module.has_lora = False
    if isinstance(module, LinearSegment):  # its buffers are views of the merged module's
        return
    buffers = next((names for kind, names in _BUFFERS.items() if isinstance(module, kind)), _DENSE_BUFFERS)
    for name in buffers:  # by isinstance: expert-parallel experts are Experts too
        if name in module._buffers:
            setattr(module, name, None)


def restrict_lora_sites(model: nn.Module, targets: Sequence[str] | None) -> None:
    """Keep LoRA only at the sites `targets` name (None: every site); see the module docstring.
    Raises ConfigError for a target that names no site (a typo would otherwise drop everything)."""
    if targets is None:
        return
    if "auto" in targets:
        raise ConfigError("lora_target_modules 'auto' is resolved from the adapters given at start (moelora serve "
                          "--lora-modules); name the modules here")
    sites = model.lora_sites()
    unmatched = [t for t in targets if not any(matches(k, t) for k in sites)]
    if unmatched:
        raise ConfigError(f"lora_target_modules {unmatched} name no LoRA site of this model; its sites are "
                          f"{', '.join(site_kinds(sites))}")
    modules: dict[int, tuple[nn.Module, bool]] = {}
    for key, (mod, _) in sites.items():
        keep = any(matches(key, t) for t in targets)
        _, kept = modules.get(id(mod), (mod, False))
        modules[id(mod)] = (mod, kept or keep)
    for mod, keep in modules.values():
        if not keep:
            _drop(mod)
    for mod in model.modules():
        if isinstance(mod, MergedLinear) and mod.has_lora and not any(s.has_lora for s in mod.segments):
            _drop(mod)
