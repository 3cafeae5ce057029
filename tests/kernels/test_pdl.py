"""Programmatic dependent launch (`kernels/pdl.py`): where it is on. The launches themselves are checked on the
GPU by the engine's equivalences (`test_programmatic_dependent_launch_is_bit_exact`)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from moelora.engine.config import EngineConfig  # noqa: E402
from moelora.kernels.pdl import pdl_args  # noqa: E402


def test_pdl_is_off_on_the_cpu_whatever_the_switch_says():
    x = torch.zeros(2)
    assert pdl_args(True, x) == {"PDL": False}
    assert pdl_args(False, x) == {"PDL": False}
    assert EngineConfig(device="cpu").pdl
    assert not EngineConfig(device="cpu", kernel_backend="torch").layer_options().pdl


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pdl_launches_where_the_gpu_has_it():
    x = torch.zeros(2, device="cuda")
    hopper = torch.cuda.get_device_capability() >= (9, 0)
    assert pdl_args(True, x) == ({"PDL": True, "launch_pdl": True} if hopper else {"PDL": False})
    assert pdl_args(False, x) == {"PDL": False}
    assert EngineConfig(device="cuda", kernel_backend="triton").layer_options().pdl
    assert not EngineConfig(device="cuda", kernel_backend="triton", pdl=False).layer_options().pdl
