"""Launch configs of the fused MoE kernels: a frozen dataclass, and tuned tables per GPU.

Shape legend: T tokens, H hidden, I expert intermediate, E experts, K top-k.
  configs/fused_moe_<gpu>.json: {"device", "configs": {"E=128,H=2048,I=768,dtype=bfloat16": {"<M>": entry}}}
  entry = {"tiles": {"block_m", "gate_up", "down", "use_tma", "plan_per_route"},
           "lora": {"path": name, <that path's fields>, "wide": {"path": ..., ...} (optional)}}
Nothing is autotuned while serving (`pick_entry`); an unknown key (a removed knob, a typo) is a ValueError
naming it (`check_table_file`, which `EngineConfig.resolve` reports as a ConfigError).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import MISSING, asdict, dataclass, field, fields, is_dataclass, replace
from pathlib import Path

import torch

from moelora.kernels.checks import need_pow2

CONFIG_DIR = Path(__file__).parent / "configs"
_TILE_KEYS = ("block_m", "gate_up", "down", "use_tma", "plan_per_route")


def lora_paths() -> dict:
    """`moelora.kernels.moe_lora.PATHS`, imported late: the engine reads this module without Triton."""
    from moelora.kernels.moe_lora import PATHS

    return PATHS


def _separate(**kw):
    return lora_paths()["separate"].config(**kw)


@dataclass(frozen=True)
class GemmTile:
    """Tile of one expert GEMM: BN output columns x BK reduction depth per step."""

    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class FusedMoEConfig:
    """One table entry: block_m (the plan's block), gate_up / down tiles, use_tma (contract-6 off switch),
    plan_per_route (a block per route, no launch), lora (path config for BLOCK_R <= 16), lora_wide (None: lora)."""

    block_m: int = 16
    gate_up: GemmTile = field(default_factory=GemmTile)
    down: GemmTile = field(default_factory=GemmTile)
    use_tma: bool = False
    plan_per_route: bool = False
    lora: object = field(default_factory=_separate)
    lora_wide: object | None = None

    def __post_init__(self):
        need_pow2("FusedMoEConfig", block_m=self.block_m, gate_up_block_n=self.gate_up.block_n,
                  gate_up_block_k=self.gate_up.block_k, down_block_n=self.down.block_n,
                  down_block_k=self.down.block_k)
        paths = lora_paths()
        for name, cfg in (("lora", self.lora), ("lora_wide", self.lora_wide)):
            path = paths.get(getattr(cfg, "path", None))
            if cfg is not None and (path is None or type(cfg) is not path.config):
                raise ValueError(f"FusedMoEConfig.{name} must be the config of a path in {sorted(paths)}, "
                                 f"got {cfg!r}")

    def lora_for(self, block_r: int):
        """The LoRA path config for a pool of BLOCK_R = block_r rank columns."""
        return self.lora_wide if block_r > 16 and self.lora_wide is not None else self.lora

    def with_lora(self, cfg) -> FusedMoEConfig:
        """This config with the LoRA path `cfg` at every pool width."""
        return replace(self, lora=cfg, lora_wide=None)

    def on_path(self, name: str, **knobs) -> FusedMoEConfig:
        """This config with path `name` at every width (this entry's config of it, else defaults), `knobs` applied."""
        own = [c for c in (self.lora, self.lora_wide) if c is not None and c.path == name]
        cfg = own[0] if own else lora_paths()[name].config()
        return self.with_lora(replace(cfg, **knobs))

    def to_dict(self) -> dict:
        lora = {"path": self.lora.path, **asdict(self.lora)}
        if self.lora_wide is not None:
            lora["wide"] = {"path": self.lora_wide.path, **asdict(self.lora_wide)}
        return {"tiles": {k: asdict(v) if is_dataclass(v) else v for k in _TILE_KEYS for v in [getattr(self, k)]},
                "lora": lora}

    @staticmethod
    def from_dict(d: dict) -> FusedMoEConfig:
        """The config of one table entry (`to_dict`'s form); an unknown or missing key raises ValueError."""
        _need_keys(d, {"tiles", "lora"}, {"tiles", "lora"}, "fused-MoE table entry")
        _need_keys(d["tiles"], set(_TILE_KEYS), {"block_m", "gate_up", "down"}, "fused-MoE table entry's tiles")
        tiles = {k: _strict(GemmTile, v, f"tiles.{k}") if k in ("gate_up", "down") else v
                 for k, v in d["tiles"].items()}
        lora = dict(d["lora"])
        wide = lora.pop("wide", None)
        return FusedMoEConfig(**tiles, lora=_lora_from(lora, "lora"),
                              lora_wide=None if wide is None else _lora_from(wide, "lora.wide"))


def _lora_from(d: dict, where: str):
    paths = lora_paths()
    if not isinstance(d, dict) or d.get("path") not in paths:
        raise ValueError(f"fused-MoE table entry's {where} must name a path of {sorted(paths)}, got {d!r}")
    return _strict(paths[d["path"]].config, {k: v for k, v in d.items() if k != "path"}, where)


def _need_keys(d, known: set, required: set, where: str) -> None:
    if not isinstance(d, dict):
        raise ValueError(f"{where} must be an object, got {d!r}")
    unknown, missing = sorted(set(d) - known), sorted(required - set(d))
    if unknown or missing:
        raise ValueError(f"{where}: unknown keys {unknown}, missing keys {missing} (known: {sorted(known)})")


def _strict(cls, d, where: str):
    """cls(**d), its nested dataclass fields built the same way; a key cls lacks raises ValueError."""
    names = {f.name: f for f in fields(cls)}
    _need_keys(d, set(names), set(), f"fused-MoE table entry's {where}")
    kw = {}
    for k, v in d.items():
        f = names[k]
        default = f.default_factory() if f.default_factory is not MISSING else f.default
        kw[k] = _strict(type(default), v, f"{where}.{k}") if is_dataclass(default) else v
    return cls(**kw)


# Shared memory a default config's pipeline may take (bytes): under the H100 / H200's 227 KiB a block, with room for
# the epilogue's and the LoRA paths' own buffers.
DEFAULT_SMEM_BUDGET = 200 * 1024


def default_fused_moe_config(num_experts: int, hidden: int, inter: int, num_tokens: int, top_k: int,
                             elem_bytes: int = 2) -> FusedMoEConfig:
    """Heuristic for shapes with no tuned entry, by routes per expert (few plan blocks: a shrink split many ways);
    `elem_bytes` of the activations and weights: the pipeline's stages cut to fit DEFAULT_SMEM_BUDGET (fp32's
    tiles take twice bf16's: 3 stages of the largest tile needed 240 KiB, over the GPU's limit)."""
    routes = num_tokens * top_k
    per_expert = routes / max(1, num_experts)
    lora = _separate(split_k=8 if routes <= 1024 else 2 if routes <= 8192 else 1)
    if per_expert <= 16:
        block_m, tile = 16, GemmTile(64, 128, 4, 4)
    elif per_expert <= 64:
        block_m, tile = 32, GemmTile(64, 128, 4, 3)
    else:
        block_m, tile = 64, GemmTile(128, 64, 8, 3)
    # a gate_up stage holds an x tile and the gate and up weight tiles
    stage = elem_bytes * (block_m * tile.block_k + 2 * tile.block_k * tile.block_n)
    tile = replace(tile, num_stages=max(1, min(tile.num_stages, DEFAULT_SMEM_BUDGET // stage)))
    return FusedMoEConfig(block_m, tile, tile, lora=lora)


def device_tag(device_name: str) -> str:
    """'NVIDIA H200' -> 'nvidia_h200' (the config file suffix)."""
    return re.sub(r"[^a-z0-9]+", "_", device_name.lower()).strip("_")


def shape_key(num_experts: int, hidden: int, inter: int, dtype: torch.dtype) -> str:
    return f"E={num_experts},H={hidden},I={inter},dtype={str(dtype).removeprefix('torch.')}"


@functools.lru_cache(maxsize=16)
def load_table(path: str) -> dict:
    """A table file's {shape_key: {M: entry}} ({} for no file: the GPU has no tuned table)."""
    p = Path(path)
    if not p.is_file():
        return {}
    table = json.loads(p.read_text())
    if not isinstance(table, dict) or not isinstance(table.get("configs"), dict):
        raise ValueError(f'fused-MoE table {p} must be an object with a "configs" object')
    return table["configs"]


@functools.lru_cache(maxsize=16)
def table_file(device_name: str, table: str | None = None) -> str:
    """`table`, else the package's table for `device_name` (which may not exist)."""
    return table or str(CONFIG_DIR / f"fused_moe_{device_tag(device_name)}.json")


def check_table_file(path: str | Path) -> str:
    """The table file's absolute path; FileNotFoundError, or ValueError naming the first entry that does not parse."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no fused-MoE table file at {p}")
    for shape, per_m in load_table.__wrapped__(str(p)).items():  # the file as it is now, not as cached
        for m, entry in per_m.items():
            try:
                FusedMoEConfig.from_dict(entry)
            except (TypeError, ValueError) as e:
                raise ValueError(f"{p}: entry {shape} M={m}: {e}") from None
    return str(p.resolve())


def tuned_fused_moe_config(num_experts: int, hidden: int, inter: int, num_tokens: int, top_k: int,
                           dtype: torch.dtype, device_name: str, table: str | None = None) -> FusedMoEConfig:
    """This shape's config from `table` (else the package's table for `device_name`; else the heuristic)."""
    return _tuned_config(num_experts, hidden, inter, num_tokens, top_k, dtype, table_file(device_name, table))


def pick_entry(per_m: dict, num_tokens: int) -> FusedMoEConfig:
    """One shape's entry ({M: entry}) for num_tokens: the smallest tuned M >= num_tokens, else the largest."""
    ms = sorted(int(m) for m in per_m)
    return FusedMoEConfig.from_dict(per_m[str(next((m for m in ms if m >= num_tokens), ms[-1]))])


@functools.lru_cache(maxsize=1024)
def _tuned_config(num_experts: int, hidden: int, inter: int, num_tokens: int, top_k: int, dtype: torch.dtype,
                  table: str) -> FusedMoEConfig:
    per_m = load_table(table).get(shape_key(num_experts, hidden, inter, dtype))
    if not per_m:
        return default_fused_moe_config(num_experts, hidden, inter, num_tokens, top_k, dtype.itemsize)
    return pick_entry(per_m, num_tokens)
