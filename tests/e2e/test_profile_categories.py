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


def test_exposed_time_counts_what_each_kernel_adds_to_the_span():
    """A side-stream kernel hidden under the GEMM adds nothing; one that outlasts it adds its tail; idle gaps apart."""
    dp = load_script("benchmarks/decode_profile.py", skip_missing=True)
    kernels = [  # start, duration (µs); by start, as trace_kernels returns them
        {"name": "_rms_norm_kernel", "ts": 100.0, "dur": 2.0},
        {"name": "gate_up_kernel", "ts": 103.0, "dur": 10.0},   # 1 µs idle before it
        {"name": "act_spread_kernel", "ts": 104.0, "dur": 4.0},  # under gate_up: adds 0
        {"name": "splitk_partial_kernel", "ts": 110.0, "dur": 6.0},  # past gate_up's end (113) by 3
        {"name": "down_kernel", "ts": 120.0, "dur": 5.0},  # 4 µs idle before it
    ]
    exposed, idle = dp.exposed_by_category(kernels)
    assert idle == 5.0
    assert exposed == {"fused norm/rotary/router/silu": 2.0, "moe gemm + plan + combine": 15.0, "moe lora": 0.0,
                       "dense splitk: base GEMM + LoRA shrink, reduce + expand": 3.0}
    assert sum(exposed.values()) + idle == 125.0 - 100.0  # the span
    assert dp.exposed_by_category([]) == ({}, 0.0)


@pytest.mark.parametrize("script", ["benchmarks/decode_profile.py", "benchmarks/prefill_profile.py"])
def test_cublas_helpers_count_as_its_gemms(script):
    """cuBLAS's split-K reduction and its GEMV kernels (what it runs for a projection at decode rows) belong to the
    dense GEMM row, not "other" (likely most of the no-LoRA engine's "other" at decode in the 53rd session's H100
    profile: 2.7 µs a layer against the LoRA engines' 0.9, whose q/k/v / o run Triton's splitk; not checked by name)."""
    decode_profile = load_script("benchmarks/decode_profile.py", skip_missing=True)
    table = load_script(script, skip_missing=True).CATEGORIES
    gemm_row = decode_profile.category("nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT", table)
    for name in ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, false, "
                 "false, false>(cublasLt::cublasSplitKParams<float>, float const*, __nv_bfloat16 const*)",
                 "void gemvx::kernel<int, int, __nv_bfloat16, __nv_bfloat16, float, float, false, true, true, false, "
                 "7, false, cublasGemvParamsEx<int, cublasGemvTensorStridedBatched<__nv_bfloat16 const>>>()",
                 "void gemv2N_kernel<int, int, __nv_bfloat16, __nv_bfloat16, float, float, 128, 8, 4, 4, false>()"):
        assert decode_profile.category(name, table) == gemm_row, name
    assert gemm_row != "other torch kernels"
