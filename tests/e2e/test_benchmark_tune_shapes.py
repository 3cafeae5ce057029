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
