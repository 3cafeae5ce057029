"""The profilers' kernel tables (`decode_profile.CATEGORIES`, `prefill_profile.CATEGORIES`) name every Triton
kernel moelora launches: a kernel left out lands in the catch-all row, and a profile then hides it (the routed
LoRA's `act_spread_kernel` was read as "other torch kernels")."""

from __future__ import annotations

import pytest

from tests.helpers.kernel_source import jit_functions
from tests.helpers.scripts import load_script


def _triton_kernels() -> list[str]:
    """Names of the `@triton.jit` functions under moelora/kernels that are launched (named `*_kernel`)."""
    return [fn.name for _, fn in jit_functions() if fn.name.endswith("_kernel")]


def test_the_scan_finds_the_kernels():
    names = _triton_kernels()
    assert {"gate_up_kernel", "down_kernel", "act_spread_kernel", "splitk_partial_kernel"} <= set(names)


@pytest.mark.parametrize("script", ["benchmarks/decode_profile.py", "benchmarks/prefill_profile.py"])
def test_every_kernel_has_a_category(script):
    decode_profile = load_script("benchmarks/decode_profile.py", skip_missing=True)
    table = load_script(script, skip_missing=True).CATEGORIES
    cats = {cat for cat, _ in table}
    missing = [n for n in _triton_kernels() if decode_profile.category(n, table) not in cats]
    assert not missing, f"{script}: kernels in no category: {missing}"
