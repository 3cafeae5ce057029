"""The rank-0 engine of a tensor- / expert-parallel group: the ordinary `LLMEngine` (scheduler, tokenizer,
prefix cache, adapter registry, sampling all on rank 0) whose runner sends each step's packed host inputs to
the workers before running its own shard of the forward, and whose adapter loads and slot writes reach every
rank. Workers decide nothing (contract 9)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from moelora.engine.config import EngineConfig
from moelora.engine.cuda_graphs import CudaGraphRunner
from moelora.engine.engine import LLMEngine
from moelora.engine.runner import ModelRunner
from moelora.engine.tokenizer import Tokenizer
from moelora.lora.pool import AdapterPool
from moelora.models.lora_targets import lora_site_owners
from moelora.parallel.driver import Driver


class ParallelRunner(ModelRunner):
    def __init__(self, *args, driver: Driver, **kw):
        super().__init__(*args, **kw)
        self.driver = driver

    def run(self, inputs, all_logits: bool = False, rows_fn=None):
        self.driver.send_step(inputs.host, all_logits, False, None if inputs.lora is None else inputs.lora.idle)
        try:
            self.driver.share_ids(inputs)
            return super().run(inputs, all_logits, rows_fn)
        except RuntimeError as exc:  # a collective a worker did not join (dead, hung past the timeout, failed)
            raise self.driver.fault(exc) from exc


class ParallelGraphRunner(CudaGraphRunner):
    """Rank 0's decode graphs: every capture and replay is also the workers' (their graphs hold the same
    collectives). A replay's message goes first; a re-capture it triggers (`ensure_captured`, decided from the
    step's inputs) happens on every rank alike. A capture from outside a replay (start-up,
    `LLMEngine.capture_graphs`) is sent as such."""

    def __init__(self, *args, driver: Driver):
        super().__init__(*args)
        self.driver, self._replaying = driver, False

    def capture(self, lora_idle: frozenset = frozenset(), lora_width: int | None = None) -> None:
        if not self._replaying:
            self.driver.send(("capture", self.driver.idle_keys(lora_idle), lora_width))
            self.driver.sent_idle = lora_idle  # the workers set their idle sites to these
        try:
            super().capture(lora_idle, lora_width)
        except RuntimeError as exc:
            raise self.driver.fault(exc) from exc

    def run(self, inputs):
        self.driver.send_step(inputs.host, False, True, None if inputs.lora is None else inputs.lora.idle)
        self._replaying = True
        try:
            self.driver.share_ids(inputs)
            return super().run(inputs)
        except RuntimeError as exc:
            raise self.driver.fault(exc) from exc
        finally:
            self._replaying = False


class ParallelAdapterPool(AdapterPool):
    """Every slot write is also the workers' (a message in step order: each worker writes its cut of that
    adapter before it runs a later step; rank 0's own write may run on the side stream, its requests held until
    it completes, as on one device); removing an adapter makes the workers forget their cut of it."""

    def __init__(self, max_loras: int, max_cpu_loras: int, load, write_slot, *, driver: Driver, **kw):
        def write_everywhere(slot: int, adapter) -> None:
            driver.send(("slot", slot, None if adapter is None else adapter.name))
            write_slot(slot, adapter)
        super().__init__(max_loras, max_cpu_loras, load, write_everywhere, **kw)
        self.driver = driver

    def remove(self, name: str) -> None:
        super().remove(name)
        self.driver.send(("unload", name))


class ParallelEngine(LLMEngine):
    def __init__(self, model, tokenizer: Tokenizer | None, cfg: EngineConfig, load_adapter,
                 adapters: Mapping[str, str | Path] | None, driver: Driver):
        self.driver = driver
        driver.site_owners = lora_site_owners(model)

        def load_everywhere(name: str, path):
            return driver.load_adapter(name, path, lambda: load_adapter(name, path))
        super().__init__(model, tokenizer, cfg, load_everywhere, adapters)

    def _make_graphs(self, *args) -> CudaGraphRunner:
        return ParallelGraphRunner(*args, driver=self.driver)

    def _make_runner(self, model, **kw) -> ModelRunner:
        return ParallelRunner(model, self.cache, self.device, driver=self.driver, **kw)

    def _new_pool(self, *args, **kw) -> AdapterPool:
        return ParallelAdapterPool(*args, driver=self.driver, **kw)

    def close(self) -> None:
        """Stop the workers (also done when the engine is collected or the interpreter exits)."""
        self.driver.close()


def build_parallel_engine(model_dir: Path, cfg: EngineConfig, adapters: Mapping[str, str | Path] | None,
                          load_format: str = "auto", seed: int = 0, tokenizer: Tokenizer | None = None
                          ) -> ParallelEngine:
    """Spawn the workers, build rank 0's shard while they build theirs, then the engine (`cfg` resolved).
    `load_format` / `seed` reach every rank; `tokenizer` (with its chat template) is rank 0's alone."""
    from moelora.parallel.adapters import load_adapter_shard
    from moelora.parallel.build import build_rank_model, check_fp8_split, plan_kv_blocks, rank_plan

    model_cfg = cfg.model_config(model_dir)
    pcfg = cfg.parallel_config
    plan = rank_plan(0, model_cfg, cfg)
    plan.check(model_cfg)  # before any process starts
    check_fp8_split(model_cfg, cfg, plan)
    driver = Driver(model_dir, cfg, pcfg, plan, (load_format, seed))
    try:
        model = build_rank_model(model_dir, cfg, driver.shard, load_format, seed)
        cfg = plan_kv_blocks(cfg, model, driver.shard)
        driver.wait_ready()
    except BaseException:
        driver.close()
        raise

    def load(name: str, path: Path):
        return load_adapter_shard(Path(path), model_cfg, name=name, max_rank=cfg.max_lora_rank,
                                  plan=driver.shard.plan)

    try:
        return ParallelEngine(model, tokenizer, cfg, load, adapters, driver)
    except BaseException:
        driver.close()
        raise
