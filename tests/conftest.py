import os
import signal

import pytest
import torch

from tests.helpers.models import build, random_adapter
from tests.helpers.oracle import tiny_hf_model

# Tiny models: one intra-op thread is faster than two spinning on a 2-core CI machine.
torch.set_num_threads(1)

# A `gpu` test that runs past this many seconds fails (0: no limit): device time is counted, and a test stuck in a
# Python loop once held a whole H200 call (2026-12-03: an input search that never converged, 420 s). Python-level
# only: a kernel that never returns is not interrupted.
GPU_TEST_LIMIT_S = int(os.environ.get("MOELORA_GPU_TEST_LIMIT_S", "240"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    if item.get_closest_marker("gpu") is None or GPU_TEST_LIMIT_S <= 0 or not hasattr(signal, "SIGALRM"):
        yield
        return

    def expire(signum, frame):
        raise TimeoutError(f"{item.nodeid} ran past {GPU_TEST_LIMIT_S} s (MOELORA_GPU_TEST_LIMIT_S)")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(GPU_TEST_LIMIT_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="module")
def setup():
    """A tiny Qwen3-MoE twin with 4 slots of rank 8 and two random adapters ("x" everywhere, "y" on 60 % of
    the sites): the CPU engine tests' shared model, built once per module."""
    hf = tiny_hf_model("qwen3_moe", seed=7)
    model = build(hf, max_loras=4, max_rank=8)
    adapters = {"x": random_adapter(model, 20, 6), "y": random_adapter(model, 21, 8, frac=0.6)}
    return model, adapters
