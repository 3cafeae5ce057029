"""The routed-expert LoRA paths of `fused_moe`, one per file behind `base.MoELoRAPath`, registered in `PATHS`
(the tuner, scripts/compile_check.py and the tests iterate it; which stay and why: docs/performance.md)."""

from __future__ import annotations

from moelora.kernels.moe_lora.base import MoECall, MoELoRAPath
from moelora.kernels.moe_lora.block import Block, BlockConfig
from moelora.kernels.moe_lora.route import Route, RouteConfig
from moelora.kernels.moe_lora.separate import Separate, SeparateConfig
from moelora.kernels.moe_lora.spread import Spread, SpreadConfig
from moelora.kernels.moe_lora.stacked import Stacked, StackedConfig

PATHS: dict[str, type[MoELoRAPath]] = {p.name: p for p in (Separate, Route, Block, Stacked, Spread)}

__all__ = ["PATHS", "Block", "BlockConfig", "MoECall", "MoELoRAPath", "Route", "RouteConfig", "Separate",
           "SeparateConfig", "Spread", "SpreadConfig", "Stacked", "StackedConfig"]

