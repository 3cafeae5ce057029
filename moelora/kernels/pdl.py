"""Programmatic dependent launch (PDL): the launch of a kernel overlapping the end of the one before it.

On compute capability >= 9.0 (Hopper) a kernel launched with `launch_pdl` may start while the previous kernel on
its stream (or, in a CUDA graph, any kernel it depends on) is still running. Every kernel here takes a `PDL`
constexpr and calls `pdl_wait(PDL)` as its first statement: `griddepcontrol.wait` blocks until the kernels it
depends on have finished and their writes are visible, then `griddepcontrol.launch_dependents` lets the next
kernel launch. So what overlaps is the next launch and its programs' start-up, never a load or a store: results
are bit for bit those of plain launches, and since every program waits before it can finish, a kernel's end still
implies its predecessors' (the order stays transitive through a chain). A decode step is ~14 dependent launches a
layer, latency-bound at small batches: what it gains and where it loses, docs/performance.md's decision table.

The off switch is `EngineConfig.pdl` (`LayerOptions.pdl`), given to every launcher as `pdl=`; a launcher passes
`**pdl_args(pdl, tensor)`, off on the CPU, under the interpreter and before Hopper.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@functools.cache
def _hopper_or_later(index: int) -> bool:
    """A fact of the hardware, asked once a device: every launch asks (a properties query costs microseconds of
    host time, and an eager prefill step makes hundreds of launches)."""
    return torch.cuda.get_device_capability(index) >= (9, 0)


def pdl_supported(t: torch.Tensor) -> bool:
    """Whether kernels on t's device can take PDL (a CUDA GPU of compute capability >= 9.0)."""
    return t.is_cuda and _hopper_or_later(t.get_device())


def pdl_args(on: bool, t: torch.Tensor) -> dict:
    """Launch keywords of a kernel whose first statement is `pdl_wait(PDL)`: PDL on when `on` and t's device
    supports it (`pdl_supported`), else plain."""
    if on and pdl_supported(t):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """A kernel's first statement: with PDL, wait for the kernels it depends on, then let the next one launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
