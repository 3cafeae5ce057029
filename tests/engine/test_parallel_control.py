"""The control channel to other hosts' ranks (`parallel/control.py`) on its own, on localhost with threads: the
handshake keeps out a peer without the key, joining waits a bounded time and names the missing ranks, and a
remote rank's liveness is read off its socket without consuming what it sent."""

from __future__ import annotations

import threading
import time
from multiprocessing import AuthenticationError

import pytest

from moelora.errors import WorkerError
from moelora.parallel.control import ControlListener, connect

KEY = b"k" * 32


def _join(address, rank: int, key: bytes, out: list) -> None:
    try:
        conn = connect(address, key)
        conn.send(("hello", rank, 1000 + rank))
        out.append(conn)
    except (AuthenticationError, OSError, EOFError) as exc:
        out.append(exc)


def _peers(*peers: tuple[int, bytes]) -> tuple[ControlListener, list, list[threading.Thread]]:
    """A listener and one thread a (rank, key) joining it, started in order."""
    listener = ControlListener("127.0.0.1")
    got: list = []
    threads = [threading.Thread(target=_join, args=(listener.address, rank, key, got)) for rank, key in peers]
    for t in threads:
        t.start()
        time.sleep(0.05)
    return listener, got, threads


def test_a_peer_without_the_key_is_refused_and_the_ranks_join():
    listener, got, threads = _peers((9, b"wrong" * 8), (2, KEY), (3, KEY))  # the stranger first
    joined = listener.accept(range(2, 4), KEY, time.monotonic() + 10)
    for t in threads:
        t.join()
    assert sorted(joined) == [2, 3] and [joined[r][1].pid for r in (2, 3)] == [1002, 1003]
    assert sum(isinstance(g, Exception) for g in got) == 1  # the stranger's handshake failed
    for conn, _ in joined.values():
        conn.close()


def test_joining_times_out_naming_the_missing_ranks():
    listener, _, threads = _peers((2, KEY))
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"ranks \[3\]"):
        listener.accept(range(2, 4), KEY, time.monotonic() + 1)
    assert time.monotonic() - start < 5
    threads[0].join()


def test_remote_rank_is_alive_until_its_socket_closes():
    listener, got, threads = _peers((1, KEY))
    conn, rank = listener.accept(range(1, 2), KEY, time.monotonic() + 10)[1]
    threads[0].join()
    remote = got[0]
    assert rank.is_alive()
    remote.send(("ok",))
    time.sleep(0.05)
    assert rank.is_alive() and conn.recv() == ("ok",)  # the peek consumed nothing
    remote.close()
    deadline = time.monotonic() + 5
    while rank.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not rank.is_alive()
    rank.join(1)
    rank.terminate()


def test_the_kv_plan_waits_for_a_slow_rank_longer_than_the_step_timeout(monkeypatch):
    """Ranks build at their own pace: the start-up all-reduce of the KV plan waits for a rank 2 s late although
    the group's (the step's) timeout is 0.5 s, and takes the smallest rank's block count. Two gloo ranks in
    threads; each rank's own count stands in for its memory plan."""
    import socket
    from types import SimpleNamespace

    import torch

    from moelora.engine import loader
    from moelora.engine.config import EngineConfig
    from moelora.parallel.build import plan_kv_blocks
    from moelora.parallel.groups import device_group, open_store
    from moelora.parallel.rules import ShardPlan
    from moelora.parallel.shard import Shard

    monkeypatch.setattr(loader, "_kv_blocks", lambda cfg, model_cfg, model: 100 + model.rank)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = EngineConfig(device="cpu", max_model_len=64, block_size=16, parallel_step_timeout_s=0.5)
    got: dict = {}

    def rank(r: int) -> None:
        store = open_store("127.0.0.1", port, r, 2, 30)
        group = device_group(store, r, 2, torch.device("cpu"), 0.5)
        time.sleep(2.0 * r)
        try:
            got[r] = plan_kv_blocks(cfg, SimpleNamespace(config=None, rank=r), Shard(ShardPlan(r, 2), group))
        except RuntimeError as exc:
            got[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert [getattr(got.get(r), "num_kv_blocks", got.get(r)) for r in (0, 1)] == [100, 100]
