"""Tensors derived from parameters (a dequantized copy, a weight split into parts), kept until a source changes.

A source changes when it is replaced (another storage) or written in place (its version counter: a checkpoint
load or a test writing it). Made outside CUDA-graph capture: a layer asks for its derived tensor on every step,
prefill included, so the engine's profiling prefill makes it before the KV pool is sized.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def write_version(t: torch.Tensor) -> int | None:
    """t's in-place write counter; None for an inference tensor (made under inference_mode: it keeps none)."""
    return None if t.is_inference() else t._version


class Derived:
    """One derived tensor: `get(sources, make, *extra)` returns make()'s result, made again when a source's storage
    or version, or `extra` (e.g. a dtype), differs from the last call's."""

    def __init__(self):
        self._key, self._value = None, None

    def get(self, sources: tuple[torch.Tensor, ...], make: Callable[[], torch.Tensor], *extra) -> torch.Tensor:
        key = tuple((t.data_ptr(), write_version(t)) for t in sources) + extra
        if key != self._key:
            self._value, self._key = None, None  # the old tensor freed before the new one is made
            self._value, self._key = make(), key
        return self._value
