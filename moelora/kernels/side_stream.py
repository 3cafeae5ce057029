"""Fork and join of the LoRA side stream (`EngineConfig.overlap_lora`) inside a launcher.

The launcher allocates every buffer the forked kernels write on the current stream before `forked`,
keeps it referenced until after `join`, and reads it only after `join`: then no allocator block is
handed out again while the side stream still uses it (contract 2). `side` None: both are no-ops and
the kernels run on the current stream, in the same order, with the same results.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def forked(side: torch.cuda.Stream | None, device: torch.device) -> Iterator[None]:
    """Launch the body's kernels on `side`, after all the work queued so far on the current stream."""
    if side is None:
        yield
        return
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        yield


def join(side: torch.cuda.Stream | None, device: torch.device) -> None:
    """The current stream waits for everything queued on `side` so far."""
    if side is not None:
        torch.cuda.current_stream(device).wait_stream(side)
