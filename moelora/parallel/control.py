"""The control channel to ranks on other hosts: TCP connections of `multiprocessing.connection`, the same
`Connection` API (send_bytes / recv / poll) as the pipes of the workers rank 0 forks on its own host, so the
driver and the worker loop treat both alike; and `RemoteRank`, what rank 0 knows of such a worker in place
of its process object.

Joining (docs/parallel.md, "Several hosts"): rank 0 hosts the TCPStore at master_addr:master_port, opens a
listening socket on a free port of master_addr and publishes the `Job` (the model directory, the configs,
that control address) in the store; each other node's `moelora serve --headless` reads it and starts its
ranks (`parallel/node.py`), each of which connects, passes the HMAC handshake of `multiprocessing` and says
("hello", rank, pid). The handshake key: MOELORA_CLUSTER_KEY when set (the same on every node: only holders
of it can join or talk to rank 0), else a random key rank 0 publishes in the store, which guards against
stray connections only: the store, like torchrun's, is unauthenticated (a trusted network).
"""

from __future__ import annotations

import os
import pickle
import socket
import struct
import time
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, answer_challenge, deliver_challenge

from moelora.engine.config import EngineConfig
from moelora.errors import WorkerError
from moelora.parallel.config import ParallelConfig

JOB_KEY = "moelora/job"
KEY_ENV = "MOELORA_CLUSTER_KEY"
KEEPALIVE_S = 60
# How long rank 0 waits for the other nodes' ranks, and a node for rank 0's job: nodes are started by hand or by
# a scheduler, in any order, and a rank imports torch before it connects (not the step timeout's business)
JOIN_TIMEOUT_S = 600.0
HANDSHAKE_S = 10.0


@dataclass(frozen=True)
class Job:
    """What a node that joins needs: every rank builds its shard of `model_dir` (the same path on every host)."""

    model_dir: str
    cfg: EngineConfig
    pcfg: ParallelConfig
    load: tuple[str, int]  # (load_format, seed)
    control: tuple[str, int]  # rank 0's control listener
    key: bytes | None  # the handshake key when MOELORA_CLUSTER_KEY is not set on rank 0


def cluster_key() -> bytes | None:
    value = os.environ.get(KEY_ENV)
    return value.encode() if value else None


def read_job(store) -> Job:
    """The job rank 0 published (waits for it up to the store's timeout)."""
    return pickle.loads(store.get(JOB_KEY))


class RemoteRank:
    """A worker on another host, seen through its connection: alive while the connection is open (a process
    that dies closes its socket; a peek tells, consuming nothing). Stopping it closes the connection, on
    which the worker exits (its node's `moelora serve --headless` reaps it)."""

    exitcode = "unknown (another host)"

    def __init__(self, rank: int, pid: int, conn: Connection):
        self.rank, self.pid, self.conn = rank, pid, conn
        self._peek = socket.socket(fileno=os.dup(conn.fileno()))
        self._peek.setblocking(False)
        self._gone = False

    def is_alive(self) -> bool:
        if not self._gone:
            try:
                self._gone = self._peek.recv(1, socket.MSG_PEEK) == b""
            except BlockingIOError:  # open, nothing to read
                pass
            except OSError:
                self._gone = True
            if self._gone:
                self._peek.close()
        return not self._gone

    def join(self, timeout: float | None = None) -> None:
        """Wait until the worker closes its end (or `timeout`), discarding what it still sends."""
        deadline = time.monotonic() + (timeout if timeout is not None else 1e9)
        while self.is_alive() and time.monotonic() < deadline:
            try:
                if self.conn.poll(min(0.05, max(0.0, deadline - time.monotonic()))):
                    self.conn.recv_bytes()
            except (EOFError, OSError):
                self._gone = True

    def terminate(self) -> None:
        self._gone = True
        self._peek.close()
        self.conn.close()

    kill = terminate


class ControlListener:
    """Rank 0's end: a socket on master_addr (a free port) that the other nodes' ranks connect to."""

    def __init__(self, host: str):
        self.sock = socket.create_server((host, 0))
        self.address = (host, self.sock.getsockname()[1])

    def accept(self, ranks: range, key: bytes, deadline: float) -> dict[int, tuple[Connection, RemoteRank]]:
        """Every rank of `ranks`, each after the handshake and its hello; WorkerError at `deadline`."""
        joined: dict[int, tuple[Connection, RemoteRank]] = {}
        try:
            while len(joined) < len(ranks):
                self.sock.settimeout(max(0.01, deadline - time.monotonic()))
                try:
                    raw, _ = self.sock.accept()
                except TimeoutError:
                    missing = sorted(set(ranks) - set(joined))
                    raise WorkerError(f"ranks {missing} (other nodes) did not join at {self.address[0]} in time: "
                                      "is `moelora serve --headless` running there?") from None
                raw.setblocking(True)
                # a silent stranger holds the join at most HANDSHAKE_S (a rank answers at once)
                _read_timeout(raw, max(0.01, min(HANDSHAKE_S, deadline - time.monotonic())))
                fd = raw.detach()
                conn = Connection(fd)
                try:  # the order of multiprocessing's Listener.accept; a stranger fails it and is dropped
                    deliver_challenge(conn, key)
                    answer_challenge(conn, key)
                    hello = conn.recv()
                except Exception:
                    conn.close()
                    continue
                with socket.socket(fileno=os.dup(fd)) as view:
                    _read_timeout(view, 0)  # from now on a read waits as long as the driver's poll says
                    _keepalive(view)
                rank = hello[1]
                if hello[0] != "hello" or rank not in ranks or rank in joined:
                    conn.close()
                    raise WorkerError(f"a node joined as rank {rank!r}, expected one of {list(ranks)} once each")
                joined[rank] = (conn, RemoteRank(rank, hello[2], conn))
        except BaseException:
            for conn, _ in joined.values():
                conn.close()
            raise
        finally:
            self.sock.close()
        return joined


def _read_timeout(sock: socket.socket, seconds: float) -> None:
    """SO_RCVTIMEO on a blocking socket (0: none): a read past it fails instead of waiting."""
    whole = int(seconds)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", whole, int((seconds - whole) * 1e6)))


def _keepalive(sock: socket.socket) -> None:
    """TCP keepalive probes after KEEPALIVE_S idle: a host that vanishes without closing its connections (power,
    network) is noticed by the other end's blocked read within ~2 x KEEPALIVE_S, not the system's 2 hours."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", KEEPALIVE_S), ("TCP_KEEPINTVL", KEEPALIVE_S // 6), ("TCP_KEEPCNT", 6)):
        if hasattr(socket, name):  # Linux; elsewhere the system's defaults
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def connect(address: tuple[str, int], key: bytes) -> Connection:
    """A rank's end on another node: connect to rank 0's listener and pass the handshake."""
    conn = Client(address, authkey=key)
    with socket.socket(fileno=os.dup(conn.fileno())) as view:
        _keepalive(view)
    return conn
