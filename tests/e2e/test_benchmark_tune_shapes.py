"""benchmarks/tune_fused_moe.py --model DIR --tensor-parallel-size N: the routed-expert shapes its ranks run (the
tuned table is keyed by them), read from config.json on the CPU."""

from __future__ import annotations

from tests.helpers.oracle import tiny_hf_config
from tests.helpers.scripts import load_script

tune = load_script("benchmarks/tune_fused_moe.py")


def test_the_ranks_shapes_of_a_model(tmp_path):
    """GLM-4.5-Air's experts (128 of 1408 rows, H 4096): at TP=4 on FP8 weights two shapes (whole blocks: 384 rows on
    ranks 0-2, 256 on rank 3), in bf16 one (352 rows each), under EP one (32 whole experts); one rank: the model's."""
    tiny_hf_config("glm4_moe", hidden_size=4096, moe_intermediate_size=1408, n_routed_experts=128,
                   num_experts_per_tok=8).save_pretrained(str(tmp_path / "air"))
    model = str(tmp_path / "air")
    whole = dict(E=128, K=8, H=4096)
    assert tune.model_shapes(model) == [("air", dict(whole, I=1408))]
    assert tune.model_shapes(model, 4, fp8=True) == [("air:rank0", dict(whole, I=384)),
                                                     ("air:rank3", dict(whole, I=256))]
    assert tune.model_shapes(model, 4) == [("air:rank0", dict(whole, I=352))]
    assert tune.model_shapes(model, 4, expert_parallel=True, fp8=True) == [("air:rank0", dict(whole, E=32, I=1408))]


def test_every_timing_launches_as_the_engine(monkeypatch):
    """Each layer call the tuner times (tiles, TMA, per-route plan, the LoRA paths, the wide round) runs `how` it
    was asked: the engine's LoRA side stream and PDL. Timed on the CPU with the replay stubbed: the calls made
    are what is checked, on a Qwen3-shaped layer cut to 16 experts."""
    from moe_bench_common import make_layer

    seen = []
    monkeypatch.setattr(tune, "graph_time_ms", lambda fn, rep=40: 1.0)
    monkeypatch.setattr(tune, "moe_call", lambda layer, x, wts, ids, lora, cfg, side, pdl: seen.append(
        (lora is not None, side, pdl)))
    shape = dict(E=16, K=8, H=2048, I=768)
    layer = make_layer(shape, pool_ranks=(16, 64), device="cpu")
    how = tune.Launch(side="lora stream", pdl=True)
    tune.tune_one(layer, 1, [], how)
    assert any(lora for lora, _, _ in seen) and any(not lora for lora, _, _ in seen)
    assert all((side, pdl) == ("lora stream", True) for _, side, pdl in seen), set(seen)

