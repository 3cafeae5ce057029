"""The routed-expert LoRA paths of `fused_moe`, one per file, each behind `base.MoELoRAPath`.

A path is named by its config's `path` (`FusedMoEConfig.lora`, the table's "lora": {"path": ...}). The
tuner (benchmarks/tune_fused_moe.py), scripts/compile_check.py and the tests iterate `PATHS`; each path's
`trials` are the configs the tuner times, `refinements` the changes it then tries on its pick.
Which paths stay and why: docs/performance.md.
"""

from __future__ import annotations

from moelora.kernels.moe_lora.base import MoECall, MoELoRAPath
from moelora.kernels.moe_lora.block import Block, BlockConfig
from moelora.kernels.moe_lora.route import Route, RouteConfig
from moelora.kernels.moe_lora.separate import Separate, SeparateConfig
from moelora.kernels.moe_lora.spread import Spread, SpreadConfig
from moelora.kernels.moe_lora.stacked import Stacked, StackedConfig

PATHS: dict[str, type[MoELoRAPath]] = {p.name: p for p in (Separate, Route, Block, Stacked, Spread)}

__all__ = ["PATHS", "Block", "BlockConfig", "MoECall", "MoELoRAPath", "Route", "RouteConfig", "Separate",
           "SeparateConfig", "Spread", "SpreadConfig", "Stacked", "StackedConfig", "path_for"]


def path_for(cfg, call: MoECall) -> MoELoRAPath:
    """The path object of one call: cfg's path, or the one it resolves to for this pool (`resolve`)."""
    cls, cfg = PATHS[cfg.path].resolve(cfg, call.n_slots, call.block_r)
    return cls(call, cfg)
