"""Where kernel tests run: on CUDA at real sizes, or on the CPU under TRITON_INTERPRET=1 at tiny sizes."""

import dataclasses
import os

import pytest
import torch

from moelora.kernels.dense_policy import DenseLoRAPolicy

CUDA = torch.cuda.is_available()
INTERP = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cuda" if CUDA and not INTERP else "cpu"
kernel_test = pytest.mark.skipif(not (INTERP or CUDA), reason="needs TRITON_INTERPRET=1 or CUDA")
gpu_only = pytest.mark.skipif(not CUDA or INTERP, reason="needs CUDA (not the interpreter)")
# an fp32 comparison at 1e-4 holds under the interpreter only: on CUDA, tl.dot rounds fp32 inputs to TF32
# (H200: 5e-3..1e-2 on a tiny model's logits, kernels/test_model_backend and kernels/test_fp8_backend alike)
interp_only = pytest.mark.skipif(not INTERP, reason="exact fp32 comparison (on CUDA, tl.dot computes in TF32)")


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """|got - want| / |want| (Frobenius norms, in `want`'s dtype); 0.0 for an empty or all-zero `want`. A NaN
    in `got` fails at once (rows the kernel never wrote)."""
    assert not torch.isnan(got).any(), "NaN in output (unwritten rows?)"
    if not want.numel() or want.norm() == 0:
        return 0.0
    return ((got.to(want.dtype) - want).norm() / want.norm()).item()


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


class PlannedPast16(DenseLoRAPolicy):
    """Every dense LoRA site of >= 17 rows on the "planned" delta when handed the rows' grouping, never on
    splitk (the shipped policy keeps planned for >= 1024-wide shapes, which tiny models lack)."""

    def prefers_splitk(self, num_tokens: int, n_in: int, n_out: int, has_lora: bool) -> bool:
        return False

    def prefers_planned(self, num_tokens: int, n_in: int, n_out: int) -> bool:
        return self.wants_row_plan(num_tokens)


def planned_everywhere(model):
    """`model`'s twin (the same tensors) whose dense LoRA sites follow `PlannedPast16`."""
    return model.with_options(dataclasses.replace(model.options, dense_lora_policy=PlannedPast16()))


def record_planned_sites(monkeypatch) -> list[bool]:
    """Record, per "planned" delta, whether it was handed the runner's row grouping (True) or had none, or one
    of other blocks, and built its own (False)."""
    import moelora.kernels.dense_lora.planned as planned

    calls = []
    real = planned.add_delta

    def recorded(x, out, lora, cfg):
        calls.append(lora.row_plan is not None and lora.row_plan.block_m == cfg.block_m)
        return real(x, out, lora, cfg)

    monkeypatch.setattr(planned, "add_delta", recorded)
    return calls
