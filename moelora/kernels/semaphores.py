"""Arrival counters of the one-launch split-K reductions (`fp8_linear`, `router_topk`).

The split arriving last at its output tile (an atomic add on the tile's counter returns SPLIT - 1) sums the
fp32 partials of every split in split order, so the result does not depend on which came last, and sets the
counter back to zero. One zeroed int32 pool a device, handed out round robin, so calls that might overlap on two
streams (a side stream's shared expert) count on different counters. Allocated by the first eager call: the
engine's graph warm-up makes one before any capture.
"""

from __future__ import annotations

import torch

from moelora.kernels.checks import need


class Semaphores:
    SIZE = 1 << 16

    def __init__(self):
        self.pools: dict[torch.device, torch.Tensor] = {}
        self.next = 0

    def take(self, device: torch.device, n: int) -> torch.Tensor:
        """n counters, zero, for one launch (which leaves them zero)."""
        pool = self.pools.get(device)
        if pool is None:
            need(not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()),
                 "split-K counters are allocated by an eager call before any graph capture")
            pool = self.pools[device] = torch.zeros(self.SIZE, dtype=torch.int32, device=device)
        if self.next + n > self.SIZE:
            self.next = 0
        self.next += n
        return pool[self.next - n:self.next]


SEMAPHORES = Semaphores()
