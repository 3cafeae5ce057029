"""Build a ready `LLMEngine` from a model directory: config, model, weights, tokenizer, KV pool."""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Mapping
from pathlib import Path

import torch

from moelora.config import ModelConfig
from moelora.engine.config import EngineConfig
from moelora.engine.cuda_graphs import graph_reserve
from moelora.engine.engine import LLMEngine
from moelora.engine.kv_cache import PagedKVCache
from moelora.engine.tokenizer import Tokenizer, has_tokenizer, resolve_chat_template
from moelora.errors import ConfigError
from moelora.models.registry import model_class
from moelora.quant.checkpoint import FP8Loading
from moelora.quant.storage import check_ignored

_CPU_DEFAULT_KV_TOKENS = 1 << 16
LOAD_FORMATS = ("auto", "safetensors", "dummy")


def _kv_blocks(cfg: EngineConfig, model_cfg: ModelConfig, model) -> int:
    if cfg.num_kv_blocks is not None:
        return cfg.num_kv_blocks
    per_block = PagedKVCache.bytes_per_block(model.kv_cache_shapes(), cfg.block_size, cfg.torch_dtype)
    if cfg.torch_device.type != "cuda":
        want = max(_CPU_DEFAULT_KV_TOKENS, cfg.max_model_len * 2)
        return -(-want // cfg.block_size)
    torch.cuda.synchronize(cfg.torch_device)
    free, total = torch.cuda.mem_get_info(cfg.torch_device)
    activations = _profile_activations(cfg, model_cfg, model)
    graphs = graph_reserve(cfg, model_cfg.vocab_size, activations, _profile_tokens(cfg))
    budget = total * cfg.gpu_memory_utilization - (total - free) - activations - graphs
    return max(0, int(budget // per_block))


def _profile_tokens(cfg: EngineConfig) -> int:
    return min(cfg.max_num_batched_tokens, cfg.max_model_len)


def _profile_activations(cfg: EngineConfig, model_cfg: ModelConfig, model) -> int:
    """Peak extra memory of a forward at the full token budget (one block table, one sequence), its rows
    on an adapter slot of the pool's full rank (when there are slots): the LoRA kernels' buffers (xa,
    per-route deltas) follow the batch's width (`LoRABatch.max_rank`), so the widest batch is measured.
    The slots hold no weights yet (every site's rank 0): the kernels allocate, launch and skip."""
    from moelora.engine.request import Request, SamplingParams, Status
    from moelora.engine.runner import ModelRunner
    from moelora.engine.scheduler import ScheduledStep

    n = _profile_tokens(cfg)
    cache = PagedKVCache(model.kv_cache_shapes(), -(-n // cfg.block_size), cfg.block_size, cfg.torch_device,
                         cfg.torch_dtype)
    lora = cfg.has_lora_slots
    req = Request("profile", [0] * n, SamplingParams(), adapter="profile" if lora else None, status=Status.RUNNING)
    req.block_ids = list(range(cache.allocator.num_blocks))
    before = torch.cuda.memory_allocated(cfg.torch_device)
    torch.cuda.reset_peak_memory_stats(cfg.torch_device)
    runner = ModelRunner(model, cache, cfg.torch_device)
    runner.run(runner.prepare(ScheduledStep([req], [n], []), {"profile": 0} if lora else {},
                              [cfg.max_lora_rank] * cfg.max_loras))
    peak = torch.cuda.max_memory_allocated(cfg.torch_device) - before
    del cache, runner
    torch.cuda.empty_cache()
    return int(peak * 1.2)


def resolve_auto_targets(model_dir: str | Path, adapters: dict[str, str | Path], cfg: EngineConfig) -> EngineConfig:
    """`cfg` with lora_target_modules "auto" (SGLang's default) replaced by every site (full key) the
    adapters given at start have LoRA on, each adapter validated as the pool would; other configs as
    they are."""
    if cfg.lora_target_modules not in ("auto", ("auto",)):
        return cfg
    if not adapters:
        raise ConfigError("lora_target_modules 'auto' keeps the modules of the adapters given at start, and "
                          "none is given")
    return dataclasses.replace(cfg, lora_target_modules=_adapter_sites(model_dir, adapters, cfg))


def _adapter_sites(model_dir: str | Path, adapters: dict[str, str | Path], cfg: EngineConfig) -> tuple[str, ...]:
    from moelora.lora.loader import load_adapter

    model_cfg = cfg.model_config(Path(model_dir))
    sites: set[str] = set()
    for name, path in adapters.items():
        sites |= set(load_adapter(Path(path), model_cfg, name=name, max_rank=cfg.max_lora_rank).sites)
    return tuple(sorted(sites))


def build_engine(model_dir: str | Path, cfg: EngineConfig | None = None, progress: bool = False,
                 adapters: Mapping[str, str | Path] | None = None, load_format: str = "auto",
                 tokenizer: str | Path | None = None, chat_template: str | None = None,
                 seed: int = 0) -> LLMEngine:
    """The engine of `model_dir`; `adapters` (name -> path) are registered before its decode graphs
    are captured, so the graphs are captured once, with those adapters' LoRA sites on. `load_format`
    (vLLM's): auto / safetensors read the checkpoint, dummy draws random weights from `seed` (only
    config.json is read). `tokenizer`: the directory of tokenizer.json or tiktoken.model (default `model_dir`);
    `chat_template`: a file or the template itself, over the tokenizer's."""
    from moelora.lora.loader import load_adapter
    from moelora.models.weights import init_dummy_weights, load_checkpoint

    if load_format not in LOAD_FORMATS:
        raise ConfigError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}")
    template = resolve_chat_template(chat_template)
    model_dir = Path(model_dir)
    tok_dir = Path(tokenizer) if tokenizer is not None else model_dir
    if tokenizer is not None and not has_tokenizer(tok_dir):
        raise ConfigError(f"--tokenizer {str(tokenizer)!r}: no tokenizer.json (nor tiktoken.model) there")
    cfg = cfg or EngineConfig()
    model_cfg = cfg.model_config(model_dir)
    cfg = cfg.resolve(model_cfg)
    fp8 = cfg.fp8_config(model_cfg)  # FP8 storage of the projections (`moelora.quant`), or None
    tok = Tokenizer(tok_dir, template) if has_tokenizer(tok_dir) else None
    if cfg.parallel_config.distributed:  # one process per rank (moelora.parallel); the tokenizer is rank 0's
        from moelora.parallel.engine import build_parallel_engine

        return build_parallel_engine(model_dir, cfg, adapters, load_format, seed, tok)
    if cfg.torch_device.type == "cuda":
        # engines and models hold no reference cycles (test_engine: freed at once when dropped), but a
        # caller's own cycle may still hold a dropped one: collect before measuring free memory
        gc.collect()
        torch.cuda.empty_cache()
    with torch.device(cfg.torch_device):
        model = model_class(model_cfg)(model_cfg, max_loras=cfg.max_loras, max_rank=cfg.max_lora_rank,
                                       options=cfg.layer_options(), dtype=cfg.torch_dtype, quant=fp8)
    if fp8 is not None:
        check_ignored(model, fp8)
    if load_format == "dummy":
        init_dummy_weights(model.weight_params(), seed)
    else:
        load_checkpoint(model_dir, model.weight_params(), progress=progress, quant=fp8 and FP8Loading(fp8))
    model.eval()
    if cfg.torch_device.type == "cuda":
        torch.cuda.empty_cache()
    cfg = cfg.with_kv_blocks(_kv_blocks(cfg, model_cfg, model))

    def load(name: str, path: Path):
        return load_adapter(path, model_cfg, name=name, max_rank=cfg.max_lora_rank)

    return LLMEngine(model, tok, cfg, load, adapters)
