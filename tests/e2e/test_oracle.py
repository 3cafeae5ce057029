"""moelora from disk equals transformers + PEFT: every family, every adapter layout, one mixed batch.

Each family's tiny model is saved as a real checkpoint (per-expert or fused keys, sharded or not);
adapters are written in layouts (a) per-expert keys, (b) real PEFT `target_parameters`, (c) packed
3D, with rsLoRA and rank/alpha patterns; the LLM loads them all and one batch mixing every adapter
and base rows must give, row for row, the oracle's logits (fp32, max abs diff <= 1e-4).
"""

from __future__ import annotations

import pytest
import torch

from moelora import LLM
from tests.helpers.oracle import tiny_hf_model
from tests.helpers.oracle_lora import build_peft_adapter, oracle_logits, per_expert_lora, write_packed, write_per_expert

CASES = {  # family -> (checkpoint form, shard size)
    "qwen3_moe": ("per_expert", None),
    "qwen2_moe": ("fused", "30KB"),
    "mixtral": ("per_expert", "40KB"),
    "olmoe": ("fused", None),
    "minimax_m2": ("per_expert", "40KB"),  # Hub names: block_sparse_moe ... w1 / w3 / w2 and the block's bias
}


def save_checkpoint(hf, path, form, shard):
    kwargs = {"save_original_format": False} if form == "fused" else {}
    if shard:
        kwargs["max_shard_size"] = shard
    hf.save_pretrained(str(path), **kwargs)


@pytest.mark.parametrize("family", list(CASES))
def test_mixed_adapters_from_disk_equal_oracle(family, tmp_path):
    hf = tiny_hf_model(family, seed=11)
    form, shard = CASES[family]
    save_checkpoint(hf, tmp_path / "model", form, shard)
    if shard:
        assert (tmp_path / "model" / "model.safetensors.index.json").is_file()

    peft_dir = build_peft_adapter(hf, tmp_path / "peft", seed=1, r=4, lora_alpha=8, use_rslora=True,
                                  rank_pattern={"q_proj": 6}, alpha_pattern={"o_proj": 3})
    raw_a = per_expert_lora(hf, seed=2, r=3, lora_alpha=5, rank_pattern={"down_proj": 2},
                            hub_names=family in ("mixtral", "minimax_m2"))
    raw_c = per_expert_lora(hf, seed=3, r=4, lora_alpha=4, use_rslora=True, router=False)
    a_dir = write_per_expert(raw_a, tmp_path / "per_expert")
    c_dir = write_packed(raw_c, tmp_path / "packed")

    llm = LLM(tmp_path / "model", {"b": peft_dir, "a": a_dir, "c": c_dir}, device="cpu", dtype="float32",
              max_lora_rank=16, max_loras=3)
    g = torch.Generator().manual_seed(0)
    names = ["b", None, "a", "c", "b", None, "c", "a"]
    seqs = [torch.randint(0, hf.config.vocab_size, (int(n),), generator=g)
            for n in torch.randint(2, 17, (len(names),), generator=g)]
    ours = llm.logits([s.tolist() for s in seqs], names)
    oracle = {"b": dict(adapter_dir=peft_dir), "a": dict(raw=raw_a), "c": dict(raw=raw_c), None: {}}
    for seq, name, got in zip(seqs, names, ours, strict=True):
        ref = oracle_logits(hf, seq[None], **oracle[name])[0]
        base = oracle_logits(hf, seq[None])[0]
        if name is not None:
            assert (ref - base).abs().max() > 1e-2, f"adapter {name} has no visible effect"
        diff = (got - ref).abs().max().item()
        assert diff <= 1e-4, f"{family} adapter {name}: max |diff| {diff:.2e}"
