"""Where kernel tests run: on CUDA at real sizes, or on the CPU under TRITON_INTERPRET=1 at tiny sizes."""

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
INTERP = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cuda" if CUDA and not INTERP else "cpu"
kernel_test = pytest.mark.skipif(not (INTERP or CUDA), reason="needs TRITON_INTERPRET=1 or CUDA")
gpu_only = pytest.mark.skipif(not CUDA or INTERP, reason="needs CUDA (not the interpreter)")
# an fp32 comparison at 1e-4 holds under the interpreter only: on CUDA, tl.dot rounds fp32 inputs to TF32
# (H200: 5e-3..1e-2 on a tiny model's logits, test_kernels_model_backend and test_kernels_fp8_backend alike)
interp_only = pytest.mark.skipif(not INTERP, reason="exact fp32 comparison (on CUDA, tl.dot computes in TF32)")


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


def record_planned_sites(monkeypatch) -> list[bool]:
    """Force every dense LoRA site of >= 17 rows onto the "planned" delta (the default keeps it for
    >= 1024-wide shapes, which tiny models lack) and record, per call, whether it was handed the
    runner's row grouping (True) or had none (False)."""
    import moelora.kernels.dense_lora.planned as planned
    import moelora.kernels.lora_linear as dense

    monkeypatch.setattr(dense, "_prefers_splitk", lambda rows, n_in, n_out, has_lora: False)
    monkeypatch.setattr(dense, "_prefers_planned", lambda rows, n_in, n_out: dense.wants_row_plan(rows))
    calls = []
    real = planned.add_delta
    monkeypatch.setattr(planned, "add_delta",
                        lambda x, out, lora, *a: calls.append(lora.row_plan is not None) or real(x, out, lora, *a))
    return calls
