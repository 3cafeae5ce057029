"""One rank's model and memory plan, the same code on rank 0 and on every worker (so their collectives,
including the memory plan's profiling forward on CUDA, run in the same order)."""

from __future__ import annotations

from pathlib import Path

import torch

from moelora.config import ModelConfig
from moelora.engine.config import EngineConfig
from moelora.models.lora_targets import restrict_lora_sites
from moelora.models.registry import model_class
from moelora.parallel.shard import Shard
from moelora.parallel.weights import load_sharded_checkpoint


def build_rank_model(model_dir: str | Path, cfg: EngineConfig, shard: Shard):
    """This rank's shard of the model in `model_dir`, its weights read slice by slice."""
    model_cfg = ModelConfig.from_hf(Path(model_dir))
    shard.plan.check(model_cfg)
    cls = model_class(model_cfg)
    with torch.device(cfg.torch_device):
        model = cls(model_cfg, max_loras=cfg.max_loras, max_rank=cfg.max_lora_rank, backend=cfg.kernel_backend,
                    dtype=cfg.torch_dtype, shard=shard)
    with torch.device("meta"):  # the unsharded shapes, allocating nothing
        full = cls(model_cfg, dtype=cfg.torch_dtype)
    full_shapes = {name: tuple(t.shape) for name, t in full.weight_params().items()}
    load_sharded_checkpoint(model_dir, model.weight_params(), full_shapes, shard.plan, model_cfg)
    model.eval()
    restrict_lora_sites(model, cfg.lora_target_modules)
    if cfg.torch_device.type == "cuda":
        torch.cuda.empty_cache()
    return model


def plan_kv_blocks(cfg: EngineConfig, model, shard: Shard) -> EngineConfig:
    """`cfg` with the KV blocks every rank can hold (the smallest rank's count)."""
    from moelora.engine.loader import _kv_blocks

    blocks = torch.tensor([_kv_blocks(cfg, model.config, model)], dtype=torch.long, device=cfg.torch_device)
    if shard.group is not None:
        import torch.distributed as dist

        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        shard.group.allreduce([blocks], opts).wait()
    return cfg.with_kv_blocks(int(blocks.item()))

