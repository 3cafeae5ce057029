"""The canonical, validated form of one LoRA adapter (what every on-disk layout becomes).

Site keys name the base module the delta is added to, in moelora's module tree (the
transformers-5 in-memory names, e.g. ``model.layers.3.self_attn.q_proj``):

- dense linear sites (attention q/k/v/o, dense MLP and shared-expert gate/up/down, the router
  ``mlp.gate``, ``mlp.shared_expert_gate``): ``a [r, in]``, ``b [out, r]``;
- routed experts, two sites per layer: ``model.layers.{i}.mlp.experts.gate_up`` with
  ``a [E, r, H]``, ``b [E, 2I, r]`` (rows ``[:I]`` gate, ``[I:]`` up, as the base
  ``gate_up_proj [E, 2I, H]``) and ``model.layers.{i}.mlp.experts.down`` with ``a [E, r, I]``,
  ``b [E, H, r]``.

The delta of a site is ``x @ a^T @ b^T`` (per expert for expert sites). The scaling
(``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA, per-site overrides from
``rank_pattern`` / ``alpha_pattern``) is folded into ``b`` once, at load time. Where gate and up
have their own A (per-expert layouts), ``gate_up`` stacks them: ``a = [a_gate; a_up]`` (rank
r_gate + r_up) and ``b`` is block-diagonal, so one shrink/expand serves both halves.
Tensors are float32 on the CPU until a pool copies them to a device slot.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class LoRAWeights:
    """One site's delta: ``a [.., r, in]`` and ``b [.., out, r]`` with the scaling folded in."""

    a: torch.Tensor
    b: torch.Tensor

    @property
    def rank(self) -> int:
        return self.a.shape[-2]


@dataclass(frozen=True)
class LoRAAdapter:
    """A validated adapter: name, source, and one `LoRAWeights` per site."""

    name: str
    path: str
    sites: dict[str, LoRAWeights] = field(default_factory=dict)

    @property
    def max_rank(self) -> int:
        return max((w.rank for w in self.sites.values()), default=0)

    def staged(self, dtypes: Mapping[str, torch.dtype], pin: bool) -> LoRAAdapter:
        """A copy with each site in its slot buffers' dtype (`dtypes`: site key -> dtype; sites
        differ: the DeepSeek/GLM router's slots are fp32 in a bf16 model), in page-locked memory when
        `pin`, so a host-to-device copy into a slot can run asynchronously on a side stream."""
        def conv(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
            t = t.to(dtype)
            return t.pin_memory() if pin else t
        # a site the model lacks keeps its dtype: writing the adapter into a slot reports it
        return LoRAAdapter(self.name, self.path, {
            k: LoRAWeights(conv(w.a, dtypes.get(k, w.a.dtype)), conv(w.b, dtypes.get(k, w.b.dtype)))
            for k, w in self.sites.items()})
