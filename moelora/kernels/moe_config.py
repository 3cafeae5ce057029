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
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from moelora.kernels.checks import need_at_least, need_one_of, need_pow2

CONFIG_DIR = Path(__file__).parent / "configs"
LORA_SHRINK_MODES = ("inline", "separate", "route", "block", "stacked", "spread")
# "inline" is rank-proportional only up to rank 16
WIDE_SHRINK_MODES = ("separate", "route", "block", "stacked", "spread")
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
    """block_m is the plan's block (rows per program, shared by both GEMMs).

    lora_shrink "inline": each GEMM program computes rows @ A^T itself, fused into its K-loop (no
    extra launch; best at decode, where blocks hold few rows and few slots). "separate": one
    shrink kernel per GEMM (grid blocks x lora_split_k) writes xa [split, P, R] once per block,
    and the GEMM epilogue only expands (best for large M, where the inline shrink would repeat
    once per output tile; also the only path for pools of max rank > 16, where it loops over the
    slot's own rank in 16-column chunks). "route": one kernel per GEMM computes each route's whole
    delta (shrink and expand GEMVs, x's dtype) before it, and the epilogue adds delta[route] (no
    loop over a block's slots; decode, where blocks hold few rows on many slots). "block": the
    same delta computed per (plan block, slot), the slots of a block in parallel programs, so a
    (slot, expert) pair's A/B is read once per block, not once per route; lora_n_split cuts each
    (block, slot) program's output columns into that many programs (0: only when the blocks leave
    SMs idle; each split repeats the block's shrink); lora_block_n: the columns of each of its
    expand steps (and lora_block_k the depth of each shrink step); lora_block_m (0: block_m): the
    rows of each of its programs, a plan block taken as block_m / lora_block_m sub-blocks (16 of a
    32-row block: half the masked rows staged per shrink step and twice the programs, A/B read once
    per sub-block); lora_block_programs (0: one program per (sub-block, lane, split)): that many
    programs, each looping over those items. Alone that delta is slower (H200, Qwen3 M=256, 8
    adapters r16, gate_up: 63.1 -> 96.1 us at 528), but beside the base GEMM on the side stream the
    layer is faster (M=128, 264 programs: 380.8 -> 368.1 us; M=256, 528: 424.1 -> 414.2; M=512 and 64
    slower); why is not measured (a guess: fewer delta programs queued ahead of the GEMM's).
    lora_shrink_wide: the
    mode for pools of max rank > 16 ("": lora_shrink's, "inline" going "separate"; H200, Qwen3
    M=512, 8 adapters r64: separate 3.98x no-LoRA, route 3.05x, block 2.33x). lora_gate_up_at (route
    and block): "epilogue" adds the gate_up delta in the gate_up GEMM's epilogue, so its kernel runs
    before that GEMM; "activation" has the GEMM write gate and up unactivated ([P, 2I]) and a small
    kernel add the delta and apply SiLU * up, so the delta kernel can run on a second stream
    concurrently with the GEMM (one launch more on the main stream, one less in its way).
    lora_route_order ("route"): the gate_up delta's programs in route order ("token": a token's K
    routes side by side) or in plan order ("plan": an expert's routes side by side, so routes of one
    (adapter, expert) pair read its A/B from L2; the down delta always runs in plan order).
    lora_route_programs / lora_route_warps / lora_route_tile ("route"): the programs a delta launch
    aims for (each route's output columns are split until routes x splits reach it; a split repeats
    its route's shrink, from L2), the warps of each, and the elements of each [16, tile / 16] A or B
    load of a narrow pool's pass (264 / 4 / 4096: two programs per SM of an H200, 8 shrink steps
    over H = 2048; more programs or wider loads put more of a latency-bound GEMV chain in flight);
    lora_route_stages (1: off): the delta's shrink and expand loops software-pipelined that many stages
    deep (their loads through cp.async, several steps in flight; not measured yet).
    lora_block_max_slots ("route", up to 1024 tokens; 0: off): a batch whose tokens name at most
    this many distinct slots takes the "block" delta instead (the route delta reads a pair's A/B
    once per route, block once per plan block, so with few adapters and many routes per pair block
    reads far less). Both kernels are launched and each counts the slots on the device, so one
    graph serves either batch. lora_expand_lanes ("separate"; 0: a loop over the block's slots): the
    epilogue expands up to this many distinct slots of a block in one dot, their xa side by side in
    lanes of BLOCK_R columns and their B tiles stacked (at most 128 // BLOCK_R lanes; any further slot
    takes the loop), instead of one dependent dot chain per slot. lora_shrink_lanes ("separate"; 1: one
    program per block and split loops over the block's slots): that many programs per block and split,
    each on one distinct slot of the block (the last: every slot left). (H200: neither is picked by the
    tuner; with 8 lanes the epilogue spills registers.) use_tma: Hopper
    tensor descriptors for the weight (and down-GEMM activation) tiles; the off switch of that
    path (contract 6). plan_per_route: no routing-plan launch; each plan block holds one route
    (`moe_plan.per_route_plan`): a block per route reads its expert's weights, so only for batches
    whose routes rarely share an expert (one token). "stacked" (prefill): a shrink kernel writes each plan
    row's xa into its slot's lane of S * BLOCK_R columns and zeros in the others (xa_stacked [P, S *
    BLOCK_R]), and each GEMM adds xa_stacked @ B_stacked[e] (every slot's B of the block's expert; B of a
    slot absent from the block, or past a slot's rank, loads nothing) as more steps of its K loop, one
    lane a step, with no reduction or branch between steps (the separate path's slot loop has both);
    lora_stack_n: the stacked columns of each shrink program (a program per plan block and
    lora_stack_n columns; one with no row on its columns' slots only writes zeros). A pool of more than
    fused_moe.STACK_MAX_COLS slot columns (S * BLOCK_R) takes "separate" instead (`fused_moe.lora_mode`).
    "spread" (one token): the shrinks ride in the programs of the kernel before the expand: the gate_up
    GEMM's program of output tile n shrinks x columns [n k, (n + 1) k) (k = ceil(H / tiles) rounded up to
    lora_block_k), an activation kernel of lora_block_n columns a program expands the gate_up delta,
    applies SiLU * up and shrinks its h columns for the down GEMM's epilogue to expand (`moe_gemm`). No
    LoRA launch, no side stream, every (slot, expert) pair's A and B read once. H200, chain of 8 layers,
    µs a layer (table "separate" / "inline" -> spread, lora_block_n 128, lora_block_k 256): Qwen3 M=1
    8 adapters r16 40.7 -> 38.8, r64 51.8 -> 43.4; DSV2 M=1 50.4 -> 43.7, r64 60.9 -> 50.6. From M=8 on it
    loses (Qwen3 8 adapters M=8 144.0 -> 149.9, M=32 288.0 -> 390.2): a block's slots loop one after the
    other in the tail of every GEMM program (the down GEMM's 32 column tiles each repeat the expand's chain).
    lora_block_b_chunks ("block"): the delta's B tiles loaded in whole 16-column chunks of the slot's rank
    (vector loads, then a select zeroes the columns past the rank) or, False, masked column by column
    (2-byte element loads, no select): for sm_90 (Triton 3.9's ptxas) the chunked kernel takes up to ~1.8x
    the registers (95 -> 174 at lora_block_n / lora_block_k 256), 5 -> 2 programs an SM; on the H200 the
    chunks won at every M=64..256 pick anyway (docs/benchmarks.md)."""

    block_m: int = 16
    gate_up: GemmTile = field(default_factory=GemmTile)
    down: GemmTile = field(default_factory=GemmTile)
    group_m: int = 8
    lora_shrink: str = "separate"
    lora_shrink_wide: str = ""
    lora_block_k: int = 128
    lora_split_k: int = 8
    lora_n_split: int = 0
    lora_gate_up_at: str = "epilogue"
    lora_route_order: str = "token"
    lora_route_programs: int = 264
    lora_route_warps: int = 4
    lora_route_tile: int = 4096
    lora_route_stages: int = 1
    lora_block_n: int = 64
    lora_block_m: int = 0
    lora_block_programs: int = 0
    lora_block_max_slots: int = 0
    lora_expand_lanes: int = 0
    lora_shrink_lanes: int = 1
    lora_stack_n: int = 128
    lora_block_b_chunks: bool = True
    use_tma: bool = False
    plan_per_route: bool = False

    def __post_init__(self):
        need_pow2("FusedMoEConfig", block_m=self.block_m, gate_up_block_n=self.gate_up.block_n,
                  gate_up_block_k=self.gate_up.block_k, down_block_n=self.down.block_n,
                  down_block_k=self.down.block_k, lora_block_k=self.lora_block_k, lora_block_n=self.lora_block_n,
                  lora_route_tile=self.lora_route_tile, lora_stack_n=self.lora_stack_n)
        need_at_least("FusedMoEConfig", 256, lora_route_tile=self.lora_route_tile)  # 16 rank columns x 16
        need_at_least("FusedMoEConfig", 1, lora_split_k=self.lora_split_k, lora_route_programs=self.lora_route_programs)
        need_at_least("FusedMoEConfig", 0, lora_n_split=self.lora_n_split,
                      lora_block_max_slots=self.lora_block_max_slots, lora_block_programs=self.lora_block_programs)
        need_one_of("FusedMoEConfig", "lora_block_m", self.lora_block_m, (0, 16, 32, 64, 128))
        need_one_of("FusedMoEConfig", "lora_expand_lanes", self.lora_expand_lanes, (0, 1, 2, 4, 8))
        need_at_least("FusedMoEConfig", 1, lora_shrink_lanes=self.lora_shrink_lanes)
        need_one_of("FusedMoEConfig", "lora_route_warps", self.lora_route_warps, (1, 2, 4, 8, 16))
        need_one_of("FusedMoEConfig", "lora_route_stages", self.lora_route_stages, (1, 2, 3, 4))
        need_one_of("FusedMoEConfig", "lora_route_order", self.lora_route_order, ROUTE_ORDERS)
        need_one_of("FusedMoEConfig", "lora_gate_up_at", self.lora_gate_up_at, GATE_UP_DELTA_AT)
        need_one_of("FusedMoEConfig", "lora_shrink", self.lora_shrink, LORA_SHRINK_MODES)
        need_one_of("FusedMoEConfig", "lora_shrink_wide", self.lora_shrink_wide, ("", *WIDE_SHRINK_MODES))

    def shrink_mode(self, block_r: int) -> str:
        """The LoRA path for a pool of BLOCK_R = block_r rank columns. "inline" computes all BLOCK_R
        columns whatever the slot's rank (rank-proportional only for a rank-16 pool), so wider
        pools take lora_shrink_wide, or "separate" when that is unset."""
        if block_r <= 16:
            return self.lora_shrink
        if self.lora_shrink_wide:
            return self.lora_shrink_wide
        return "separate" if self.lora_shrink == "inline" else self.lora_shrink

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> FusedMoEConfig:
        d = dict(d)
        for k in ("gate_up", "down"):
            if k in d:
                d[k] = GemmTile(**d[k])
        return FusedMoEConfig(**d)


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
