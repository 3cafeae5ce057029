"""scripts/compile_check.py: a kernel the interpreter runs but the sm_90 compiler refuses is reported."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compile_check compiles; under the interpreter @triton.jit makes no compilable kernel",
                allow_module_level=True)
import triton.language as tl  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from compile_check import Compiler  # noqa: E402


@triton.jit
def _loop_carried_reshaped(x_ptr, n, B: tl.constexpr):
    xs = tl.zeros([B, B], tl.float32)
    i = 0
    while i < n:  # the interpreter runs this; the compiler refuses xs changing shape in the loop
        xs = tl.zeros([B, 16], tl.float32)
        i += 1
    tl.store(x_ptr + tl.arange(0, B), tl.sum(xs, 1))


@triton.jit
def _loop_carried_same(x_ptr, n, B: tl.constexpr):
    xs = tl.zeros([B, B], tl.float32)
    i = 0
    while i < n:
        xs = xs + 1.0
        i += 1
    tl.store(x_ptr + tl.arange(0, B), tl.sum(xs, 1))


def test_compile_error_reported_and_clean_kernel_passes():
    x = torch.zeros(32)
    with Compiler(resources=False) as comp:
        _loop_carried_same[(1,)](x, 3, B=32)
        assert comp.failures == [] and len(comp.seen) == 1
        _loop_carried_reshaped[(1,)](x, 3, B=32)
    assert len(comp.failures) == 1
    assert "_loop_carried_reshaped" in comp.failures[0] and "Loop-carried" in comp.failures[0]
    assert x.eq(0).all()  # compiled, never run


def test_table_entries_compile_for_sm90(tmp_path, monkeypatch):
    """Every launch the Qwen3-shape table entries make (LoRA off, 1 adapter r16, 8 adapters r64) compiles
    for the H200 (TMA entries without TMA: their descriptors need a GPU)."""
    import compile_check

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # compile, not read last run's cubins
    assert compile_check.main(["--shapes", "qwen3_30b_a3b", "--picks"]) == 0
