"""Fork and join of a side stream inside a launcher or a layer (the LoRA side stream, `EngineConfig.overlap_lora`;
MLA decode's absorb stream, `overlap_mla_absorb`); `side` None: no-ops.

Every buffer the forked kernels write is allocated on the current stream before `forked`, kept until after
`join` and read only after it, so no block is reused while the side stream uses it (contract 2).
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
