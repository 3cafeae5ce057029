"""benchmarks/decode.py builds its engines from its arguments: without --pool-rank the slots take the
adapters' rank (issue 27: `run_model` passed pool_rank=None into EngineConfig, a TypeError in resolve)."""

from __future__ import annotations

import pytest

from tests.helpers.scripts import load_script

# needs triton importable (the kernels' module imports it)
decode = load_script("benchmarks/decode.py", skip_missing=True)


class _Built(Exception):
    pass


@pytest.mark.parametrize("pool_rank,want", [(None, 16), (64, 64)])
def test_run_model_gives_the_lora_engine_a_slot_rank(monkeypatch, pool_rank, want):
    from torch.nn import Identity

    from moelora.config import ModelConfig

    cfg = ModelConfig(**{**decode.QWEN3_30B, "num_layers": 1}).resolve()
    built = []

    def fake_engine(model, cfg, max_loras, rank, max_seqs, adapters, **kw):
        built.append(decode.engine_config(cfg, max_loras, rank, max_seqs, device="cpu", **kw))
        raise _Built

    monkeypatch.setattr(decode, "model_with_adapters", lambda *a, **k: (cfg, Identity(), {}))
    monkeypatch.setattr(decode, "no_lora_twin", lambda model, cfg, quant=None: Identity())
    monkeypatch.setattr(decode, "engine", fake_engine)
    with pytest.raises(_Built):
        decode.run_model("qwen3_30b", 1, [1, 8], 4, 16, 1e12, engine_kw=dict(async_scheduling=None),
                         pool_rank=pool_rank)
    assert built[0].max_lora_rank == want and built[0].max_loras == 8 and built[0].max_num_seqs == 8
