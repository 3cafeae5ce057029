"""A node other than rank 0's (`moelora serve --headless --nnodes N --node-rank R --master-addr A
--master-port P`, vLLM's flags): join rank 0's rendezvous, start this node's ranks, and exit with them.

The node learns everything else from rank 0 (`control.Job`: model directory, engine and parallel configs,
load format): its own serve flags other than those four are not read, so the nodes cannot disagree. Rank r
of node R is local rank r - R * N / nnodes (its GPU: that index past the configured device's). Each rank is a
spawned child process that connects to rank 0's control listener (`control.connect`) and then
runs the same loop as a worker on rank 0's host (`worker.worker_main`). When a rank dies (killed, or failing
before it reached rank 0) the node stops the others and exits 1; when every rank has exited otherwise (rank 0
closed the engine, or a rank reported its error to rank 0, which then stopped them all) it exits 0; SIGTERM /
SIGINT stop the ranks first. The node exits only after joining its ranks: it leaves no process.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from datetime import timedelta
from multiprocessing.connection import wait

from moelora.errors import ConfigError, WorkerError
from moelora.parallel.control import JOIN_TIMEOUT_S, Job, cluster_key, connect, read_job


def run_node(master_addr: str, master_port: int, nnodes: int, node_rank: int,
             join_timeout_s: float = JOIN_TIMEOUT_S) -> int:
    """Run this node's ranks until they exit; the exit status (0: all stopped cleanly)."""
    from torch.distributed import TCPStore

    from moelora.parallel.driver import end_process

    if not 1 <= node_rank < nnodes:
        raise ConfigError(f"--node-rank {node_rank}: a headless node is one of 1..{nnodes - 1} (node 0 runs the "
                          "scheduler: `moelora serve` without --headless)")
    try:
        store = TCPStore(master_addr, master_port, None, False, timeout=timedelta(seconds=join_timeout_s),
                         wait_for_workers=False)
        job = read_job(store)
    except Exception as exc:  # torch's store errors: not reachable, or no job within the timeout
        raise WorkerError(f"no rank 0 at {master_addr}:{master_port} within {join_timeout_s:.0f} s (is node 0's "
                          f"`moelora serve --nnodes {nnodes}` running?): {exc}") from exc
    if job.pcfg.nnodes != nnodes:
        raise ConfigError(f"--nnodes {nnodes}, but rank 0 at {master_addr}:{master_port} runs {job.pcfg.nnodes} nodes")
    per = job.pcfg.ranks_per_node
    ctx = mp.get_context("spawn")  # one start per node: the node's own children, all joined before it exits
    procs = [ctx.Process(target=remote_worker_main, name=f"moelora-rank{node_rank * per + i}", daemon=True,
                         args=(node_rank * per + i, i, master_addr, master_port, job)) for i in range(per)]

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    old = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for proc in procs:
            proc.start()
        return _wait(procs)
    finally:
        for proc in procs:
            if proc.pid is not None:  # started
                end_process(proc, 0)
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _wait(procs) -> int:
    live = list(procs)
    while live:
        for sentinel in wait([p.sentinel for p in live]):
            proc = next(p for p in live if p.sentinel == sentinel)
            proc.join()
            live.remove(proc)
            if proc.exitcode != 0:
                print(f"moelora node: {proc.name} (pid {proc.pid}) exited with {proc.exitcode}; stopping this "
                      "node's other ranks", flush=True)
                return 1
    return 0


def remote_worker_main(rank: int, local_rank: int, master_addr: str, master_port: int, job: Job) -> None:
    """A rank on a node other than rank 0's: connect to rank 0, say who it is, then the workers' loop."""
    from moelora.parallel.worker import worker_main

    key = cluster_key() or job.key
    if key is None:
        raise WorkerError("rank 0 expects MOELORA_CLUSTER_KEY on every node; it is not set here")
    conn = connect(job.control, key)
    conn.send(("hello", rank, os.getpid()))
    worker_main(rank, master_addr, master_port, job.model_dir, job.cfg, job.pcfg, conn, job.load,
                local_rank=local_rank)
