"""Tiny models for the FP8 tests, their LoRA sites per family, and one mixed batch."""

from __future__ import annotations

import torch

from tests.helpers.models import ATTN_SITES
from tests.helpers.oracle import tiny_hf_model
from tests.helpers.oracle_lora import ATTN

QWEN_SIZES = dict(hidden_size=144, moe_intermediate_size=136, intermediate_size=200)
SITES = dict(ATTN_SITES, qwen3_moe=ATTN, qwen2_moe=ATTN, minimax_m2=ATTN)


def fp8_model(family: str, seed: int = 11):
    return tiny_hf_model(family, seed=seed, **(QWEN_SIZES if family == "qwen3_moe" else {}))


def mixed_batch(vocab: int):
    g = torch.Generator().manual_seed(0)
    names = ["b", None, "a", "b", "a", None]
    return names, [torch.randint(0, vocab, (int(n),), generator=g) for n in torch.randint(2, 17, (6,), generator=g)]
