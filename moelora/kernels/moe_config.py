"""Launch configs of the fused MoE kernels: a frozen dataclass, and tuned tables per GPU.

Shape legend: T tokens, H hidden, I expert intermediate, E experts, K top-k.

Tables live in `configs/fused_moe_<gpu>.json` (written by benchmarks/tune_fused_moe.py):
  {"device": "...", "configs": {"E=128,H=2048,I=768,dtype=bfloat16": {"<M>": {config fields}}}}
A launch picks the smallest tuned M >= T (else the largest); shapes with no table entry fall
back to `default_fused_moe_config`. Nothing is autotuned at serving time.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import torch

from moelora.errors import ConfigError
from moelora.kernels.checks import need_at_least, need_one_of, need_pow2

CONFIG_DIR = Path(__file__).parent / "configs"
LORA_SHRINK_MODES = ("separate", "route", "block", "stacked", "spread")
GATE_UP_DELTA_AT = ("epilogue", "activation")
ROUTE_ORDERS = ("token", "plan")


@dataclass(frozen=True)
class GemmTile:
    """Tile of one expert GEMM: BN output columns x BK reduction depth per step."""

    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class FusedMoEConfig:
    """One table entry. block_m: the routing plan's block (rows per program, shared by both GEMMs);
    gate_up / down: their tiles; use_tma: Hopper tensor descriptors for the weight (and down-GEMM
    activation) tiles, the off switch of that path (contract 6); plan_per_route: no routing-plan
    launch, a plan block per route (`moe_plan.per_route_plan`, one-token batches).

    The routed-LoRA path (`fused_moe` module docstring): lora_shrink for pools of BLOCK_R <= 16,
    lora_shrink_wide ("": lora_shrink's) for wider ones. Each path reads its own knobs:
      separate: lora_split_k (shrink partials), lora_block_k (shrink depth step).
      route:    lora_route_warps, lora_route_order ("plan": the gate_up delta's programs in plan order),
                lora_gate_up_at, lora_block_max_slots (a batch on at most that many distinct slots
                takes the block delta, chosen on the device) and, for that switch, block's knobs.
      block:    lora_block_n / lora_block_k (expand / shrink steps), lora_block_m (0: block_m; the rows
                of each delta program), lora_block_programs (0: a program per item; else that many
                looping), lora_block_b_chunks (B tiles in whole 16-column rank chunks; off: masked
                column by column, fewer registers), lora_gate_up_at ("activation": the gate_up delta
                added after the GEMM by act_delta_kernel, so it can run on the side stream).
      stacked:  lora_stack_n (columns of each stacked-shrink program).
      spread:   lora_block_k (rounding of each GEMM program's shrink share), lora_block_n (columns of
                each act_spread_kernel program).
    Measurements behind each pick: docs/performance.md."""

    block_m: int = 16
    gate_up: GemmTile = field(default_factory=GemmTile)
    down: GemmTile = field(default_factory=GemmTile)
    lora_shrink: str = "separate"
    lora_shrink_wide: str = ""
    lora_block_k: int = 128
    lora_split_k: int = 8
    lora_gate_up_at: str = "epilogue"
    lora_route_order: str = "token"
    lora_route_warps: int = 4
    lora_block_n: int = 64
    lora_block_m: int = 0
    lora_block_programs: int = 0
    lora_block_max_slots: int = 0
    lora_stack_n: int = 128
    lora_block_b_chunks: bool = True
    use_tma: bool = False
    plan_per_route: bool = False

    def __post_init__(self):
        need_pow2("FusedMoEConfig", block_m=self.block_m, gate_up_block_n=self.gate_up.block_n,
                  gate_up_block_k=self.gate_up.block_k, down_block_n=self.down.block_n,
                  down_block_k=self.down.block_k, lora_block_k=self.lora_block_k, lora_block_n=self.lora_block_n,
                  lora_stack_n=self.lora_stack_n)
        need_at_least("FusedMoEConfig", 1, lora_split_k=self.lora_split_k)
        need_at_least("FusedMoEConfig", 0, lora_block_max_slots=self.lora_block_max_slots,
                      lora_block_programs=self.lora_block_programs)
        need_one_of("FusedMoEConfig", "lora_block_m", self.lora_block_m, (0, 16, 32, 64, 128))
        need_one_of("FusedMoEConfig", "lora_route_warps", self.lora_route_warps, (1, 2, 4, 8, 16))
        need_one_of("FusedMoEConfig", "lora_route_order", self.lora_route_order, ROUTE_ORDERS)
        need_one_of("FusedMoEConfig", "lora_gate_up_at", self.lora_gate_up_at, GATE_UP_DELTA_AT)
        need_one_of("FusedMoEConfig", "lora_shrink", self.lora_shrink, LORA_SHRINK_MODES)
        need_one_of("FusedMoEConfig", "lora_shrink_wide", self.lora_shrink_wide, ("", *LORA_SHRINK_MODES))

    def shrink_mode(self, block_r: int) -> str:
        """The LoRA path for a pool of BLOCK_R = block_r rank columns."""
        return self.lora_shrink_wide if block_r > 16 and self.lora_shrink_wide else self.lora_shrink

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> FusedMoEConfig:
        """The config of one table entry; a key that is no field (a removed knob: docs/performance.md,
        "tried and removed") raises ConfigError naming it."""
        unknown = sorted(set(d) - {f.name for f in fields(FusedMoEConfig)})
        if unknown:
            raise ConfigError(f"fused-MoE table entry has unknown keys {unknown} (fields: "
                              f"{[f.name for f in fields(FusedMoEConfig)]})")
        d = dict(d)
        for k in ("gate_up", "down"):
            if k in d:
                d[k] = _tile(d[k])
        return FusedMoEConfig(**d)


def _tile(d: dict) -> GemmTile:
    unknown = sorted(set(d) - {f.name for f in fields(GemmTile)})
    if unknown:
        raise ConfigError(f"fused-MoE table tile has unknown keys {unknown}")
    return GemmTile(**d)


def default_lora_split_k(num_tokens: int, top_k: int) -> int:
    """Split of the separate LoRA shrink's reduction: many splits when there are few plan blocks
    (decode), none when the blocks alone fill the GPU (each split re-reads its partials)."""
    routes = num_tokens * top_k
    return 8 if routes <= 1024 else 2 if routes <= 8192 else 1


def default_fused_moe_config(num_experts: int, hidden: int, inter: int, num_tokens: int,
                             top_k: int) -> FusedMoEConfig:
    """Heuristic for shapes with no tuned entry, by routes per expert."""
    per_expert = num_tokens * top_k / max(1, num_experts)
    split = default_lora_split_k(num_tokens, top_k)
    if per_expert <= 16:
        tile = GemmTile(64, 128, 4, 4)
        return FusedMoEConfig(16, tile, tile, lora_shrink="separate", lora_split_k=split)
    if per_expert <= 64:
        tile = GemmTile(64, 128, 4, 3)
        return FusedMoEConfig(32, tile, tile, lora_shrink="separate", lora_split_k=split)
    tile = GemmTile(128, 64, 8, 3)
    return FusedMoEConfig(64, tile, tile, lora_shrink="separate", lora_split_k=split)


def device_tag(device_name: str) -> str:
    """'NVIDIA H200' -> 'nvidia_h200' (the config file suffix)."""
    return re.sub(r"[^a-z0-9]+", "_", device_name.lower()).strip("_")


def shape_key(num_experts: int, hidden: int, inter: int, dtype: torch.dtype) -> str:
    return f"E={num_experts},H={hidden},I={inter},dtype={str(dtype).removeprefix('torch.')}"


@functools.lru_cache(maxsize=16)
def _load_table(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        return {}
    return json.loads(p.read_text())["configs"]


def check_table_file(path: str | Path) -> str:
    """The absolute path of a fused-MoE table file (one as benchmarks/tune_fused_moe.py writes), or
    FileNotFoundError."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no fused-MoE table file at {p}")
    return str(p.resolve())


def tuned_fused_moe_config(num_experts: int, hidden: int, inter: int, num_tokens: int, top_k: int,
                           dtype: torch.dtype, device_name: str, table: str | None = None) -> FusedMoEConfig:
    """The tuned config for this shape from `table` (a table file, `check_table_file`), else from the
    package's table for `device_name`; the heuristic default for a shape the table lacks."""
    return _tuned_config(num_experts, hidden, inter, num_tokens, top_k, dtype, table or _package_table(device_name))


@functools.lru_cache(maxsize=16)
def _package_table(device_name: str) -> str:
    return str(CONFIG_DIR / f"fused_moe_{device_tag(device_name)}.json")


@functools.lru_cache(maxsize=1024)
def _tuned_config(num_experts: int, hidden: int, inter: int, num_tokens: int, top_k: int, dtype: torch.dtype,
                  table_file: str) -> FusedMoEConfig:
    per_m = _load_table(table_file).get(shape_key(num_experts, hidden, inter, dtype))
    if not per_m:
        return default_fused_moe_config(num_experts, hidden, inter, num_tokens, top_k)
    ms = sorted(int(m) for m in per_m)
    pick = next((m for m in ms if m >= num_tokens), ms[-1])
    return FusedMoEConfig.from_dict(per_m[str(pick)])


def with_tma(config: FusedMoEConfig, use_tma: bool = True) -> FusedMoEConfig:
    return replace(config, use_tma=use_tma)
