"""Process groups without torch.distributed's global default group (so two engines can live in one
process, and tests can start and stop groups freely): a TCPStore rendezvous, then the device group used
by the forward's collectives, NCCL on CUDA and gloo on the CPU, built straight from the store.

Rendezvous: the engine's rank 0 opens the store on a free port the OS picks at run time (port 0), never a
fixed one, and hands host:port to the workers it spawns (one host; several hosts: docs/parallel.md).
"""

from __future__ import annotations

from datetime import timedelta

import torch
from torch.distributed import PrefixStore, TCPStore


def open_store(host: str, port: int, rank: int, size: int, timeout_s: float) -> TCPStore:
    """Rank 0 hosts the store (port 0: a free port, read back from `store.port`); the others connect."""
    return TCPStore(host, port, size, rank == 0, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def device_group(store, rank: int, size: int, device: torch.device, timeout_s: float):
    """The group the model's collectives run on: NCCL for a CUDA device, gloo for the CPU. Its timeout
    bounds how long a collective waits for a dead or hung peer."""
    timeout = timedelta(seconds=timeout_s)
    prefixed = PrefixStore(f"moelora/{device.type}", store)
    if device.type == "cuda":
        from torch.distributed import ProcessGroupNCCL

        opts = ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return ProcessGroupNCCL(prefixed, rank, size, opts)
    from torch.distributed import ProcessGroupGloo

    return ProcessGroupGloo(prefixed, rank, size, timeout)
