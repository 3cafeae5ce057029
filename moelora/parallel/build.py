"""One rank's model and memory plan, the same code on rank 0 and on every worker (so their collectives,
including the memory plan's profiling forward on CUDA, run in the same order)."""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from pathlib import Path

import torch

from moelora.config import ModelConfig
from moelora.engine.config import EngineConfig
from moelora.models.registry import model_class
from moelora.models.weights import init_dummy_weights
from moelora.parallel.control import JOIN_TIMEOUT_S
from moelora.parallel.rules import ShardPlan, split_unit
from moelora.parallel.scales import rank_cuts
from moelora.parallel.shard import Shard
from moelora.parallel.weights import load_sharded_checkpoint
from moelora.quant.checkpoint import SCALE, FP8Loading, is_scale
from moelora.quant.storage import check_ignored


def full_shapes(model_cfg: ModelConfig, cfg: EngineConfig) -> dict[str, tuple[int, ...]]:
    """The unsharded shapes of every weight destination (FP8 scales included), allocating nothing."""
    with torch.device("meta"):
        full = model_class(model_cfg)(model_cfg, dtype=cfg.torch_dtype, quant=cfg.fp8_config(model_cfg))
    return {name: tuple(t.shape) for name, t in full.weight_params().items()}


def rank_plan(rank: int, model_cfg: ModelConfig, cfg: EngineConfig) -> ShardPlan:
    """Rank `rank`'s plan under `cfg`'s parallel config, its intermediate splits on the model's FP8 blocks."""
    pcfg = cfg.parallel_config
    return ShardPlan(rank, pcfg.world_size, pcfg.expert_parallel, split_unit(cfg.fp8_config(model_cfg)))


def check_fp8_split(model_cfg: ModelConfig, cfg: EngineConfig, plan: ShardPlan) -> None:
    """ConfigError when FP8 block scales would be split inside a block on any rank (an attention dim: the
    intermediate ones split on blocks; before any process starts; `scales.scale_cut` raises it)."""
    fp8 = cfg.fp8_config(model_cfg)
    if fp8 is None:
        return
    shapes = full_shapes(model_cfg, cfg)
    for rank in range(plan.size):
        rank_cuts(shapes, shapes, dataclasses.replace(plan, rank=rank), model_cfg, fp8)


def build_rank_model(model_dir: str | Path, cfg: EngineConfig, shard: Shard, load_format: str = "auto",
                     seed: int = 0):
    """This rank's shard of the model in `model_dir`: its weights read slice by slice (FP8 with their
    scales' slices), or drawn from `seed` (load_format "dummy", `init_rank_dummy_weights`)."""
    model_cfg = cfg.model_config(Path(model_dir))
    shard.plan.check(model_cfg)
    fp8 = cfg.fp8_config(model_cfg)
    with torch.device(cfg.torch_device):
        model = model_class(model_cfg)(model_cfg, max_loras=cfg.max_loras, max_rank=cfg.max_lora_rank,
                                       options=cfg.layer_options(), dtype=cfg.torch_dtype, shard=shard, quant=fp8)
    if fp8 is not None:
        check_ignored(model, fp8)
    if load_format == "dummy":
        init_rank_dummy_weights(model.weight_params(), shard.plan, model_cfg, seed)
    else:
        load_sharded_checkpoint(model_dir, model.weight_params(), full_shapes(model_cfg, cfg), shard.plan,
                                model_cfg, fp8 and FP8Loading(fp8))
    model.eval()
    if cfg.torch_device.type == "cuda":
        torch.cuda.empty_cache()
    return model


def init_rank_dummy_weights(params: dict[str, torch.Tensor], plan: ShardPlan, model_cfg: ModelConfig,
                            seed: int) -> None:
    """`load_format="dummy"` on several ranks: every rank draws its own shard of each split tensor (streams
    `seed` + rank * len(params) + i), so the sharded model is NOT the one-rank dummy model cut into pieces
    (its values differ; fine for a benchmark, which only needs the shapes and finite outputs). Replicated
    tensors (routers, norms, MLA's latent projections) draw the same stream on every rank (`seed` + i), as
    the ranks must agree on them (one routing decision per token)."""
    for i, (name, dest) in enumerate(params.items()):
        split = plan.cut(name, model_cfg) is not None or (is_scale(name) and plan.cut(name[: -len(SCALE)],
                                                                                     model_cfg) is not None)
        init_dummy_weights({name: dest}, seed + i + (plan.rank * len(params) if split else 0))


def plan_kv_blocks(cfg: EngineConfig, model, shard: Shard) -> EngineConfig:
    """`cfg` with the KV blocks every rank can hold (the smallest rank's count)."""
    from moelora.engine.loader import _kv_blocks

    blocks = torch.tensor([_kv_blocks(cfg, model.config, model)], dtype=torch.long, device=cfg.torch_device)
    if shard.group is not None:
        import torch.distributed as dist

        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        # a start-up collective: ranks load and build at their own pace, so it waits as long as a join does,
        # not the step timeout (a dead rank is seen by the driver's liveness checks, not by this wait)
        opts.timeout = timedelta(seconds=max(JOIN_TIMEOUT_S, cfg.parallel_step_timeout_s))
        shard.group.allreduce([blocks], opts).wait()
    return cfg.with_kv_blocks(int(blocks.item()))

