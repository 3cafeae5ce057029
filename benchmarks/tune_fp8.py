"""The FP8 expert tiles the tuner tries (benchmarks/tune_fused_moe.py --dtype fp8 / fp8a8), and their refinement.

Shape legend: M tokens, E experts, K top-k; a tile (block_m; block_n, block_k, num_warps, num_stages).
Every FP8 K step is one 128-column scale block, so block_k is 128; the rest is searched per routes per expert
(M * K / E), apart from the bf16 table's tiles: an FP8 weight tile is half the bytes of a bf16 one (so deeper
pipelines and wider N tiles pay), and W8A8's gate_up holds two dot results next to its two accumulators (the
K step is dot * scale, not chained), so 64 x 128 tiles spill at 4 warps (sm_90 cubin: 456 bytes of stack),
not at 8. The joint pick (one tile for both GEMMs) is then refined per GEMM: the down tile, then the
gate_up tile, over the same block_m's candidates (their kernels are already compiled; only timings).
"""

from __future__ import annotations

import dataclasses

from moelora.kernels.fp8_quant import GROUP
from moelora.kernels.moe_config import FusedMoEConfig, GemmTile

# (block_m, block_n, num_warps, num_stages) per class of routes per expert. Left out: the tiles that spill in both
# modes on sm_90 (compile_check --resources: 32 x 256 and 64 x 256 at 8 warps, 128 x 128 at 8 warps).
FP8_DECODE = [(16, 32, 4, 4), (16, 32, 4, 6), (16, 64, 4, 3), (16, 64, 4, 4), (16, 64, 4, 6), (16, 128, 4, 3),
              (16, 128, 4, 4), (16, 128, 8, 4), (16, 256, 8, 3)]
FP8_SMALL = [(16, 64, 4, 4), (16, 128, 4, 4), (16, 128, 8, 4), (32, 64, 4, 4), (32, 64, 4, 5), (32, 128, 4, 3),
             (32, 128, 8, 3), (32, 128, 8, 4)]
FP8_MID = [(32, 64, 4, 4), (32, 128, 8, 4), (64, 64, 4, 3), (64, 64, 4, 4), (64, 128, 8, 3), (64, 128, 8, 4),
           (128, 64, 8, 3), (128, 64, 8, 4)]
FP8_LARGE = [(64, 64, 4, 4), (64, 128, 8, 3), (64, 128, 8, 4), (128, 64, 8, 3), (128, 64, 8, 4)]


def fp8_candidates(M: int, shape: dict) -> list[FusedMoEConfig]:
    """The FP8 tiles tried at M (the same tile for gate_up and down; `split_refinements` then pulls them apart)."""
    per_expert = M * shape["K"] / shape["E"]
    space = (FP8_DECODE if per_expert <= 2 else FP8_SMALL if per_expert <= 8 else FP8_MID if per_expert <= 64
             else FP8_LARGE)
    return [FusedMoEConfig(bm, GemmTile(bn, GROUP, w, s), GemmTile(bn, GROUP, w, s)) for bm, bn, w, s in space]


def split_refinements(best: FusedMoEConfig, tried: list[FusedMoEConfig], which: str) -> list[FusedMoEConfig]:
    """best with its `which` ("gate_up" or "down") tile swapped for each other tile of `tried` of the same
    block_m (distinct, best's own left out)."""
    tiles = dict.fromkeys(getattr(c, which) for c in tried if c.block_m == best.block_m)
    return [dataclasses.replace(best, **{which: t}) for t in tiles if t != getattr(best, which)]


def lora_fields_from(entry: dict | None) -> dict:
    """The LoRA fields (lora, lora_wide) of a table entry dict, for an FP8 entry tuned --tiles-only: the
    routed LoRA runs the bf16 paths on either weight dtype ({} without an entry: the config's defaults)."""
    if not entry:
        return {}
    cfg = FusedMoEConfig.from_dict(entry)
    return dict(lora=cfg.lora, lora_wide=cfg.lora_wide)
