"""Where kernel tests run: on CUDA at real sizes, or on the CPU under TRITON_INTERPRET=1 at tiny sizes."""

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
INTERP = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cuda" if CUDA and not INTERP else "cpu"
kernel_test = pytest.mark.skipif(not (INTERP or CUDA), reason="needs TRITON_INTERPRET=1 or CUDA")
gpu_only = pytest.mark.skipif(not CUDA or INTERP, reason="needs CUDA (not the interpreter)")


def graph_replayed(call, out: torch.Tensor) -> torch.Tensor:
    """`out` as a CUDA graph of `call(out)` leaves it: captured (kernels compiled already), `out` filled
    with NaN, replayed, synchronized."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(out)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    return out
