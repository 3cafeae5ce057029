"""Rank 0's side of the group: spawn the workers on this node (and with several nodes, accept the other nodes'
ranks: `control.py`), send them each step and adapter change, notice faults, stop them.

Faults: before every message the driver checks that each worker is alive; a collective a dead or hung
worker never joins fails (gloo: the peer's connection closes) or times out after
`ParallelConfig.step_timeout_s`; a worker's answer is awaited at most that long. Each raises WorkerError
(naming the rank and, when the worker said why, its error), after which the driver is closed: the engine
is unusable and the server answers 503. `close()` (also run when the engine is collected or the
interpreter exits) stops, then terminates, then kills each worker, and joins it: no process is left.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import pickle
import secrets
import time
import weakref
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

from moelora.engine.config import EngineConfig
from moelora.errors import AdapterError, ConfigError, WorkerError
from moelora.parallel.config import ParallelConfig
from moelora.parallel.control import JOB_KEY, JOIN_TIMEOUT_S, ControlListener, Job, cluster_key
from moelora.parallel.groups import device_group, open_store
from moelora.parallel.rules import ShardPlan
from moelora.parallel.shard import Shard
from moelora.parallel.wire import encode

_FAULT_GRACE_S = 0.5  # after a fault the group is dead: a worker stuck in a collective only needs stopping


def _context():
    """The forkserver start method, its server importing torch and the model code once per process: each worker
    forks from it (CUDA-safe: the server never touches a device) instead of importing them again as a spawned
    worker does (4 ranks on 2 CPU cores: start-up 10.1 s -> 3.5 s for the first engine, 2.2 s after; shutdown
    2.6 -> 0.07 s)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["moelora.parallel.worker", "moelora.parallel.build", "moelora.models.registry"])
    return ctx


class Driver:
    def __init__(self, model_dir: str | Path, cfg: EngineConfig, pcfg: ParallelConfig, plan: ShardPlan,
                 load: tuple[str, int] = ("auto", 0)):
        """`plan`: rank 0's (`build.rank_plan`); `load`: (load_format, seed), every rank's
        (`build.build_rank_model`)."""
        from moelora.parallel.worker import worker_main

        self.pcfg, self.closed = pcfg, False
        self.site_owners: dict = {}  # adapter site key -> LoRA owner module on rank 0 (set by the engine)
        self.sent_idle: frozenset | None = None  # the idle set the workers hold
        size, timeout = pcfg.world_size, pcfg.step_timeout_s
        host = pcfg.master_addr
        try:  # port 0 (one node): the OS picks a free one
            store = open_store(host, pcfg.master_port, 0, size, timeout)
        except Exception as exc:  # several nodes: their fixed port, taken or not on this host
            raise ConfigError(f"cannot host the rendezvous at master_addr={host} master_port={pcfg.master_port}: "
                              f"{exc}") from exc
        ctx = _context()
        self.conns, self.procs = [], []
        self._finalizer = weakref.finalize(self, _stop, self.conns, self.procs)
        for rank in range(1, pcfg.ranks_per_node):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, name=f"moelora-rank{rank}", daemon=True,
                               args=(rank, host, store.port, str(model_dir), cfg, pcfg, child, load))
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        if pcfg.nnodes > 1:
            self._join_nodes(store, Job(str(model_dir), cfg, pcfg, load, ("", 0), None))
        self._await_alive()  # a worker that dies before the rendezvous fails now, not at the group's timeout
        try:
            group = device_group(store, 0, size, cfg.torch_device, timeout)
        except Exception as exc:
            self._fail(f"the process group did not form: {exc}")
        self._store = store  # the workers' rendezvous: alive as long as the group
        self.shard = Shard(plan, group)

    def _join_nodes(self, store, job: Job) -> None:
        """The other nodes' ranks, connected to a control listener whose address the job in the store gives."""
        listener = ControlListener(self.pcfg.master_addr)
        key = cluster_key()
        job = dataclasses.replace(job, control=listener.address, key=None if key else secrets.token_bytes(32))
        store.set(JOB_KEY, pickle.dumps(job))
        try:
            joined = listener.accept(range(self.pcfg.ranks_per_node, self.pcfg.world_size), key or job.key,
                                     time.monotonic() + JOIN_TIMEOUT_S)
        except WorkerError as exc:
            self._fail(f"{exc}")
        for rank in sorted(joined):
            self.conns.append(joined[rank][0])
            self.procs.append(joined[rank][1])

    def _await_alive(self, poll_s: float = 0.05) -> None:
        for rank, (conn, proc) in enumerate(zip(self.conns, self.procs, strict=True), start=1):
            deadline = time.monotonic() + self.startup_s
            while not conn.poll(poll_s):
                if not proc.is_alive():
                    self._fail(f"rank {rank} exited at start-up (exit code {proc.exitcode})")
                if time.monotonic() > deadline:
                    self._fail(f"rank {rank} did not start within {self.startup_s} s")
            try:
                conn.recv()
            except (EOFError, OSError):  # the pipe closed: the process is exiting
                proc.join(5)
                self._fail(f"rank {rank} exited at start-up (exit code {proc.exitcode})")

    def wait_ready(self) -> None:
        """Every worker built its shard (call after rank 0 built its own: their collectives interleave)."""
        self.replies("start-up", self.startup_s)

    @property
    def startup_s(self) -> float:
        """How long start-up waits for a rank (loading its shard takes as long as it takes, and ranks load at
        their own pace): a join's bound, or the step timeout if longer. A rank that dies is seen at once."""
        return max(JOIN_TIMEOUT_S, self.pcfg.step_timeout_s)

    # messages -----------------------------------------------------------------------------------
    def send(self, msg: tuple) -> None:
        """One pickle of `msg`, its bytes written to every worker's pipe (`Connection.recv` reads them)."""
        self.check()
        data = ForkingPickler.dumps(msg)
        try:
            for conn in self.conns:
                conn.send_bytes(data)
        except (BrokenPipeError, OSError) as exc:
            self._fail(f"a worker's pipe broke: {exc}")

    def send_step(self, host, all_logits: bool, graph: bool, idle: frozenset | None) -> None:
        """One step for the workers; first rank 0's idle LoRA sites (by site key) when they changed since the
        last step that had a LoRA batch, so every rank's `LoRABatch.idle`, and so its decode graphs, agree."""
        if idle is not None and idle is not self.sent_idle:
            self.send(("idle", self.idle_keys(idle)))
            self.sent_idle = idle
        self.send(("step", encode(host), all_logits, graph))

    def share_ids(self, inputs) -> None:
        """Overlapped scheduling: a step whose token ids rank 0 took from its previous step's samples on the
        device (`HostStep` pending sources) broadcasts them on the device group, with no host sync; the workers
        receive them into their own ids (`worker.py`). Called after `send_step`, before the forward."""
        if inputs.host.lists[7]:
            self.shard.broadcast(inputs.input_ids)

    def idle_keys(self, idle: frozenset) -> list[str]:
        return [key for key, owner in self.site_owners.items() if owner in idle]

    def replies(self, what: str, timeout_s: float | None = None) -> list[tuple]:
        out = []
        timeout_s = self.pcfg.step_timeout_s if timeout_s is None else timeout_s
        for rank, (conn, proc) in enumerate(zip(self.conns, self.procs, strict=True), start=1):
            if not conn.poll(timeout_s):
                self._fail(f"rank {rank} did not answer ({what}) within {timeout_s} s"
                           f"{'' if proc.is_alive() else ' and is dead'}")
            try:
                reply = conn.recv()
            except (EOFError, OSError):
                self._fail(f"rank {rank} died during {what} (exit code {proc.exitcode})")
            if reply[0] == "error" and what == "start-up":
                self._fail(f"rank {rank} failed at start-up: {reply[1]}: {reply[2]}")
            out.append(reply)
        return out

    def load_adapter(self, name: str, path: str | Path, load_local):
        """Load an adapter on every rank: `load_local()` is rank 0's (its cut); any rank failing fails the
        load everywhere, with that rank's error (workers that loaded it forget it again)."""
        self.send(("load", name, str(path)))
        local_error = None
        try:
            adapter = load_local()
        except Exception as exc:
            local_error = exc
        replies = self.replies(f"loading adapter {name!r}")
        bad = [(rank, r) for rank, r in enumerate(replies, start=1) if r[0] != "ok"]
        if local_error is not None or bad:
            self.send(("unload", name))
            if local_error is not None:
                raise local_error
            rank, (_, kind, text) = bad[0]
            raise AdapterError(f"adapter {name!r} failed to load on rank {rank}: {kind}: {text}")
        return adapter

    # faults -------------------------------------------------------------------------------------
    def check(self) -> None:
        if self.closed:
            raise WorkerError("the tensor-parallel workers are stopped (an earlier fault or shutdown)")
        for rank, proc in enumerate(self.procs, start=1):
            if not proc.is_alive():
                self._fail(f"rank {rank} (pid {proc.pid}) is dead, exit code {proc.exitcode}")

    def fault(self, exc: BaseException) -> WorkerError:
        """The WorkerError for a failed collective (a worker's own report when it sent one, or which rank is
        dead, watched for `_FAULT_GRACE_S`: its pipe or socket may close a moment after its peers see it);
        closes."""
        why, deadline = f"{exc}", time.monotonic() + _FAULT_GRACE_S
        while why == f"{exc}" and time.monotonic() < deadline:
            why = self._culprit(exc) or why
            time.sleep(0.01)
        self.close(grace_s=_FAULT_GRACE_S)
        return WorkerError(f"a tensor-parallel step failed: {why}")

    def _culprit(self, exc: BaseException) -> str | None:
        for rank, (conn, proc) in enumerate(zip(self.conns, self.procs, strict=True), start=1):
            try:
                if conn.poll(0):
                    reply = conn.recv()
                    if reply[0] == "error":
                        return f"rank {rank}: {reply[1]}: {reply[2]}"
            except (EOFError, OSError):
                return f"rank {rank} died ({exc})"
            if not proc.is_alive():
                return f"rank {rank} died ({exc})"
        return None

    def _fail(self, why: str):
        self.close(grace_s=_FAULT_GRACE_S)
        raise WorkerError(why)

    def close(self, grace_s: float = 5.0) -> None:
        """Stop every worker: `grace_s` to exit on request, as long again after SIGTERM, then SIGKILL."""
        self.closed = True
        stop = self._finalizer.detach()  # None once run (at collection / exit, or an earlier close)
        if stop is not None:
            _, func, args, _ = stop
            func(*args, grace_s=grace_s)


def _stop(conns, procs, grace_s: float = 5.0) -> None:
    for conn in conns:
        try:
            conn.send(("stop",))
        except (BrokenPipeError, OSError):
            pass
    for proc in procs:
        end_process(proc, grace_s, grace_s)
    for conn in conns:
        conn.close()


def end_process(proc, wait_s: float, grace_s: float = 5.0) -> None:
    """Give `proc` `wait_s` to exit on its own and `grace_s` after SIGTERM, then SIGKILL; joined, so gone."""
    proc.join(wait_s)
    if proc.is_alive():
        proc.terminate()
        proc.join(grace_s)
    if proc.is_alive():
        proc.kill()
        proc.join()
