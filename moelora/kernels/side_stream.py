"""Fork and join of a side stream inside a launcher or a layer (the LoRA side stream, `EngineConfig.overlap_lora`;
MLA decode's absorb stream, `overlap_mla_absorb`; the shared experts', `overlap_shared_experts`); `side` None:
no-ops. `layer_streams`: the graphs' capture stream and the layers' side streams, distinct CUDA streams.

Every buffer the forked kernels write is allocated on the current stream before `forked`, kept until after
`join` and read only after it, so no block is reused while the side stream uses it (contract 2).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch


class LayerStreams(NamedTuple):
    capture: torch.cuda.Stream  # every CUDA graph's capture and warm-up stream (`torch.cuda.graph(stream=...)`)
    shared_experts: torch.cuda.Stream  # every layer's shared experts beside its routed ones
    mla_absorb: torch.cuda.Stream  # every MLA layer's decode absorb beside its rope kernel


_LAYER_STREAMS: dict[int, LayerStreams] = {}


def layer_streams(device: torch.device) -> LayerStreams:
    """`device`'s capture stream and layer side streams, drawn together once a process: three streams in a row of
    torch's pool (32 a priority, handed out round robin) are distinct. A stream drawn per layer wrapped around: with
    32 or more (DeepSeek-V2-Lite drew 26 for its shared experts and 27 for MLA's absorb) some layer's side stream was
    torch.cuda.graph's own capture stream, its fork a no-op, and its side work ran in series in every captured graph
    (44th session, H100: layer 13's shared experts after the routed combine in the no-LoRA engine's replay). Layers
    share a side stream: each joins it before the next layer forks."""
    index = torch.cuda.current_device() if device.index is None else device.index
    if index not in _LAYER_STREAMS:
        streams = LayerStreams(*(torch.cuda.Stream(index) for _ in LayerStreams._fields))
        assert len({s.cuda_stream for s in streams}) == len(streams)
        _LAYER_STREAMS[index] = streams
    return _LAYER_STREAMS[index]


def lora_stream(device: torch.device) -> torch.cuda.Stream:
    """A new LoRA side stream (`EngineConfig.overlap_lora`: the engine's, and the MoE benchmarks' that time as it
    runs), at high CUDA priority: its shrinks and deltas sit on the critical path (the GEMM that adds them waits), so
    their programs take SM slots ahead of a base GEMM's next wave; a captured graph keeps it (kernel nodes record the
    capturing stream's priority; torch instantiates graphs with node priority). It is also a stream of another pool:
    torch hands out its 32 streams a priority round robin, so a priority-0 LoRA stream can be the very CUDA stream of
    some layer's shared experts (DeepSeek-V2-Lite makes 26). H200, DSV2 shape, 8 adapters r16, 64 requests: 11.88 ->
    11.17 ms a step; Qwen3 shape (no shared experts) within 1 % (docs/performance.md)."""
    return torch.cuda.Stream(device, priority=-1)  # above every other stream here (all at 0)


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
