"""The worker processes (ranks 1..N-1): build the rank's model, then run what rank 0 sends, nothing else.

Rank 0 talks to each worker over a pipe (`multiprocessing` forkserver context): each message is one pickled
tuple, written once per worker (docs/parallel.md: why a pipe and not a broadcast on the group):
- ("step", packed HostStep (`wire.py`), all_logits, graph): upload the step's host lists and run the same
  forward, eagerly or as a decode-graph replay (its collectives meet rank 0's); the logits are rank 0's to
  sample. Under overlapped scheduling the ids of tokens rank 0 has not read back yet arrive first, by a
  broadcast on the device group;
- ("idle", site keys): the LoRA sites rank 0 skips (`LoRABatch.idle`), sent when they change; a worker never
  changes them itself, so its LoRA batches and decode-graph captures are rank 0's;
- ("capture", site keys, width): capture the decode graphs (start-up, `LLMEngine.capture_graphs`); a
  re-capture a replay needs is decided by every rank alike from the step's inputs;
- ("load", name, path): load and validate the adapter, keep this rank's cut; answers ("ok",) or
  ("error", kind, message), so a load failing on any rank fails on every rank;
- ("slot", slot, name | None): write that adapter's cut into a slot (or empty it);
- ("unload", name): forget it; ("stop",): exit.
A worker whose step fails sends ("error", ...) and exits: rank 0's collective then fails or times out and
the engine raises WorkerError. A worker whose pipe closes (rank 0 gone) exits.
"""

from __future__ import annotations

import dataclasses
import traceback
from pathlib import Path

import torch

from moelora.engine.config import EngineConfig
from moelora.parallel.config import ParallelConfig
from moelora.parallel.shard import Shard
from moelora.parallel.wire import decode


def _error(exc: BaseException) -> tuple[str, str, str]:
    return ("error", type(exc).__name__, f"{exc}")


class _Worker:
    def __init__(self, model_dir: str, cfg: EngineConfig, shard: Shard, load: tuple[str, int]):
        from moelora.engine.kv_cache import PagedKVCache
        from moelora.engine.runner import ModelRunner, lora_needs
        from moelora.models.lora_targets import lora_site_owners
        from moelora.parallel.build import build_rank_model, plan_kv_blocks

        self.model_dir, self.shard = model_dir, shard
        self.model = build_rank_model(model_dir, cfg, shard, *load)
        self.cfg = cfg = plan_kv_blocks(cfg, self.model, shard)
        self.cache = PagedKVCache(self.model.kv_cache_shapes(), cfg.num_kv_blocks, cfg.block_size,
                                  cfg.torch_device, cfg.torch_dtype)
        needs = lora_needs(cfg, self.model)  # rank 0's, from the same config
        self.runner = ModelRunner(self.model, self.cache, cfg.torch_device, needs)
        self.owners = lora_site_owners(self.model)
        self.runner.lora_idle = frozenset(self.owners.values()) if cfg.skip_idle_lora_sites else frozenset()
        self.adapters: dict = {}
        self.graphs = self._graphs(cfg, needs)

    def _graphs(self, cfg: EngineConfig, needs):
        """Decode graphs when rank 0's engine has them (the same rule as `LLMEngine`), else None."""
        from moelora.engine.cuda_graphs import CudaGraphRunner
        from moelora.layers.mla import MLAttention

        graph_safe = cfg.mla_absorbed_decode or not any(isinstance(m, MLAttention) for m in self.model.modules())
        if not (cfg.use_cuda_graphs and graph_safe and getattr(self.model, "supports_cuda_graphs", False)):
            return None
        dummy = self.cache.allocator.allocate()  # the block rank 0's engine takes first, too
        return CudaGraphRunner(self.model, self.cache, cfg.max_num_seqs, cfg.max_model_len, dummy, needs,
                               cfg.base_decode_graphs, frozenset(self.owners.values()))

    def set_idle(self, keys: list[str]) -> frozenset:
        self.runner.lora_idle = frozenset(self.owners[k] for k in keys)
        return self.runner.lora_idle

    def load(self, name: str, path: str) -> None:
        from moelora.parallel.adapters import load_adapter_shard

        self.adapters[name] = load_adapter_shard(Path(path), self.model.config, name=name,
                                                 max_rank=self.cfg.max_lora_rank, plan=self.shard.plan)

    def handle(self, msg: tuple):
        kind = msg[0]
        if kind == "step":
            host = decode(msg[1])
            inputs = self.runner.unpack(host)
            if host.lists[7]:  # overlapped scheduling: ids rank 0 sampled on the device, into this rank's ids
                self.shard.broadcast(inputs.input_ids)
            if msg[3]:
                self.graphs.run(inputs)
            else:
                self.runner.run(inputs, all_logits=msg[2], rows_fn=_discard if msg[2] else None)
        elif kind == "idle":
            self.set_idle(msg[1])
        elif kind == "capture":
            self.graphs.capture(self.set_idle(msg[1]), msg[2])
        elif kind == "load":
            try:
                self.load(msg[1], msg[2])
            except Exception as exc:  # reported to rank 0, which fails the load on every rank
                return _error(exc)
            return ("ok",)
        elif kind == "slot":
            self.model.set_lora_slot(msg[1], None if msg[2] is None else self.adapters[msg[2]])
        elif kind == "unload":
            self.adapters.pop(msg[1], None)
        return None


def _discard(first_row: int, logits: torch.Tensor) -> None:
    """A worker's share of every-row logits (rank 0 keeps them): made for the collectives, then dropped."""


def worker_main(rank: int, host: str, port: int, model_dir: str, cfg: EngineConfig, pcfg: ParallelConfig,
                conn, load: tuple[str, int] = ("auto", 0), local_rank: int | None = None) -> None:
    """Entry point of a worker process; `load`: (load_format, seed) of `build_rank_model`; `conn`: a pipe from
    rank 0, or a TCP connection on another node (`control.py`), whose `local_rank` picks its GPU."""
    from moelora.parallel.build import rank_plan
    from moelora.parallel.groups import device_group, open_store

    conn.send(("alive",))
    device = torch.device(cfg.device)
    if device.type == "cuda":  # rank r on the r-th GPU after rank 0's (its node's r-th on another node)
        index = (device.index or 0) + (rank if local_rank is None else local_rank)
        torch.cuda.set_device(index)
        cfg = dataclasses.replace(cfg, device=f"cuda:{index}")
    else:
        torch.set_num_threads(1)  # the ranks share the host's cores
    try:
        store = open_store(host, port, rank, pcfg.world_size, pcfg.step_timeout_s)
        group = device_group(store, rank, pcfg.world_size, cfg.torch_device, pcfg.step_timeout_s)
        plan = rank_plan(rank, cfg.model_config(Path(model_dir)), cfg)
        worker = _Worker(model_dir, cfg, Shard(plan, group), load)
        conn.send(("ready",))
    except BaseException as exc:
        conn.send(("error", type(exc).__name__, f"{exc}\n{traceback.format_exc()}"))
        return
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return  # rank 0 is gone
        if msg[0] == "stop":
            return
        try:
            reply = worker.handle(msg)
        except BaseException as exc:
            conn.send(_error(exc))
            return
        if reply is not None:
            conn.send(reply)
