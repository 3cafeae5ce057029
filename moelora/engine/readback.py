"""A step's sampled tokens (and logprobs) device -> host, without waiting for later work.

`tensor.tolist()` on a CUDA tensor is a synchronous copy on the current stream: it returns only
once everything queued before it has run. Overlapped scheduling queues step n+1 before it reads
step n back, so such a read waits for step n+1 too, and the host then schedules step n+2 while the
device idles (measured on the H200: `benchmarks/step_overlap.py`, docs/history/2026-12-01.md). `ReadBack`
queues the copy right behind the step's own sampling, into page-locked memory, and records an
event there: `get()` waits for that event alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class ReadBack:
    """Host copies of `tensors` (None entries stay None), queued now on the current stream;
    `get()` returns them once the copies have landed."""

    def __init__(self, tensors: Sequence[torch.Tensor | None]):
        self._event = None
        if not any(t is not None and t.is_cuda for t in tensors):
            self._host = list(tensors)
            return
        self._host = [None if t is None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(
            t, non_blocking=True) for t in tensors]
        self._event = torch.cuda.Event()
        self._event.record()

    def get(self) -> list[torch.Tensor | None]:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._host
