"""FP8 weights on several ranks: the cut of a weight's scale that matches the rank's cut of the weight.

Shape legend: N output rows in G row segments, K input columns, B the scale block (128).

A rank holds its cut of the e4m3 weight (`rules.ShardPlan.cut`) and the matching part of its scale:
- block scales [.., sum_g ceil(N_g/B), ceil(K/B)]: a row range [lo, hi) of segment g (q/k/v, one gate or up
  half of an expert, an intermediate split) keeps scale rows [lo/B, ceil(hi/B)) of that segment's grid, a
  column range (row-parallel o_proj / down_proj) the scale columns alike. That is exact only when every
  range starts on a block boundary and ends on one or at its segment's end (a partial last block), so the
  rank's blocks are the global blocks. Intermediate dims are split on whole blocks by construction
  (`rules.ShardPlan.unit`, unevenly where the blocks do not divide by the ranks); an attention dim off the
  blocks (heads x a head width not a multiple of 128) is a `ConfigError` naming the tensor, the dimension
  and the block size: re-blocking would change the weights (contract 9). A dimension with fewer blocks than
  ranks cannot be split (`ShardPlan.check`; the tiny models: TP=2 needs 2 blocks, e.g. 256 rows).
- per-channel scales [.., N, 1] split with their rows and stay whole across a column split;
  per-tensor scales ([1] on disk, held per row) stay whole.
Expert parallelism keeps whole experts: their scales move with them (the expert dim cut is the weight's).
"""

from __future__ import annotations

from moelora.errors import ConfigError
from moelora.parallel.rules import Cut, ShardPlan
from moelora.quant.checkpoint import SCALE, is_scale
from moelora.quant.config import FP8Config
from moelora.quant.fp8 import cdiv


def weight_segments(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row segments of full weight `name` [.., N, K]: a fused gate_up is blocked per half."""
    rows = shape[-2]
    return (rows // 2, rows // 2) if name.endswith("experts.gate_up_proj") else (rows,)


def scale_cut(name: str, shape: tuple[int, ...], cut: Cut | None, fp8: FP8Config, plan: ShardPlan) -> Cut | None:
    """The cut of weight `name`'s scale for the weight cut `cut` (`shape`: the full weight's); ConfigError
    when a block scale's split does not fall on its blocks."""
    if cut is None:
        return None
    rows_dim, out = len(shape) - 2, []
    for dim, ranges in cut:
        if dim < rows_dim:  # the experts dim: whole experts with their scales
            out.append((dim, ranges))
        elif fp8.weights != "block":  # channel / tensor: rows with the weight's, one column
            if dim == rows_dim:
                out.append((dim, ranges))
        else:
            segments = weight_segments(name, shape) if dim == rows_dim else (shape[-1],)
            block = fp8.block[0] if dim == rows_dim else fp8.block[1]
            out.append((dim, tuple(_block_range(lo, hi, segments, block, name, dim == rows_dim, plan)
                                   for lo, hi in ranges)))
    return tuple(out) or None


def _block_range(lo: int, hi: int, segments: tuple[int, ...], block: int, name: str, rows: bool,
                 plan: ShardPlan) -> tuple[int, int]:
    start = grid = 0
    for size in segments:
        if start <= lo < start + size:
            break
        start, grid = start + size, grid + cdiv(size, block)
    a, b = lo - start, hi - start
    if a % block or (b % block and hi != start + size):
        what = "rows" if rows else "columns"
        raise ConfigError(
            f"tensor_parallel_size={plan.size}{' with expert parallelism' if plan.expert_parallel else ''} "
            f"splits {name} ({_dimension(name, rows)}) at {what} {a}..{b} of a {size}-{what[:-1]} "
            f"{'segment' if len(segments) > 1 else 'dimension'}, off its FP8 weight_block_size {block}: each "
            f"rank's part must be a multiple of {block} {what} (block-FP8 scales cannot be split inside a block)")
    return grid + a // block, grid + cdiv(b, block)


def _dimension(name: str, rows: bool) -> str:
    """The config dimension a split of `name` divides (for the message)."""
    if ".mlp.experts." in name:
        return "moe_intermediate_size"
    if ".shared_expert" in name:
        return "the shared experts' intermediate size"
    if ".mlp." in name:
        return "intermediate_size"
    if "kv_b_proj" in name:
        return "num_attention_heads x (qk_nope_head_dim + v_head_dim)"
    if "o_proj" in name:
        return "num_attention_heads x v_head_dim / head_dim (o_proj's input)"
    if "k_proj" in name or "v_proj" in name:
        return "num_key_value_heads x head_dim"
    return "num_attention_heads x head dim"


def rank_cuts(names, full_shapes: dict[str, tuple[int, ...]], plan: ShardPlan, cfg, fp8: FP8Config | None
              ) -> dict[str, Cut | None]:
    """Every name's cut on this rank: weights by `rules`, FP8 scales by `scale_cut` of their weight's."""
    cuts = {}
    for name in names:
        if fp8 is not None and is_scale(name):
            weight = name[: -len(SCALE)]
            cuts[name] = scale_cut(weight, full_shapes[weight], plan.cut(weight, cfg), fp8, plan)
        else:
            cuts[name] = plan.cut(name, cfg)
    return cuts
