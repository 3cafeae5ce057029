import pytest
import torch

from tests.helpers.models import build, random_adapter
from tests.helpers.oracle import tiny_hf_model

# Tiny models: one intra-op thread is faster than two spinning on a 2-core CI machine.
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def setup():
    """A tiny Qwen3-MoE twin with 4 slots of rank 8 and two random adapters ("x" everywhere, "y" on 60 % of
    the sites): the CPU engine tests' shared model, built once per module."""
    hf = tiny_hf_model("qwen3_moe", seed=7)
    model = build(hf, max_loras=4, max_rank=8)
    adapters = {"x": random_adapter(model, 20, 6), "y": random_adapter(model, 21, 8, frac=0.6)}
    return model, adapters
