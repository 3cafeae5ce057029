"""The torch forward equals transformers on every family; LoRA deltas equal merged weights;
a mixed-adapter batch equals each row run alone."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.models import build, engine, merged_hf, random_adapter
from tests.helpers.oracle import FAMILIES, tiny_hf_model


@pytest.mark.parametrize("family", FAMILIES)
def test_base_logits_equal_transformers(family):
    hf = tiny_hf_model(family, seed=1)
    model = build(hf)
    ids = torch.randint(0, hf.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
    ours = engine(model).prompt_logits(ids.tolist(), [None, None])
    for row in range(2):
        assert (ours[row] - ref[row]).abs().max() < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_equals_merged_weights(family):
    hf = tiny_hf_model(family, seed=2)
    model = build(hf, max_loras=2, max_rank=8)
    adapter = random_adapter(model, seed=3, rank=5)
    ids = torch.randint(0, hf.config.vocab_size, (1, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = merged_hf(hf, adapter)(ids).logits[0]
        base = hf(ids).logits[0]
    ours = engine(model, {"a": adapter}, max_loras=2).prompt_logits(ids.tolist(), ["a"])[0]
    assert (ref - base).abs().max() > 1e-2  # the adapter really changes the output
    assert (ours - ref).abs().max() < 1e-4


def test_mixed_batch_equals_each_row_alone():
    hf = tiny_hf_model("qwen2_moe", seed=4)
    model = build(hf, max_loras=4, max_rank=8)
    adapters = {f"a{seed}": random_adapter(model, seed, rank, frac=0.7) for seed, rank in [(10, 8), (11, 3), (12, 6)]}
    g = torch.Generator().manual_seed(5)
    lengths, names = [7, 12, 3, 9, 1, 5], ["a10", None, "a11", "a12", "a10", None]
    seqs = [torch.randint(0, hf.config.vocab_size, (n,), generator=g).tolist() for n in lengths]
    eng = engine(model, adapters)
    batched = eng.prompt_logits(seqs, names)
    for seq, name, got in zip(seqs, names, batched, strict=True):
        alone = eng.prompt_logits([seq], [name])[0]
        assert got.shape == alone.shape
        assert (got - alone).abs().max() < 1e-5
    # different adapters really give different logits on the same tokens
    same = [seqs[1]] * 4
    outs = eng.prompt_logits(same, ["a10", "a11", "a12", None])
    for i in range(3):
        assert (outs[i] - outs[3]).abs().max() > 1e-2
