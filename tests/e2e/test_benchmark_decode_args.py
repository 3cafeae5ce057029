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

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the benchmark's Triton backend on this CPU: the interpreter's
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


def test_ab_takes_layer_options_and_refuses_what_shapes_the_model():
    """--ab: a layer option (overlap_*, merge_qkv, mla_absorbed_decode, pdl, kernel_backend) reaches the B
    engines through the twin `engine` builds; what shapes the shared model itself (its LoRA slots, dtype, the
    sites that keep slots) cannot differ between A and B and is refused, and the MoE table has --ab-table."""
    got = decode.parse_ab("overlap_mla_absorb=0,overlap_shared_experts=false,merge_qkv=0,overlap_lora=1,pdl=0")
    assert got == dict(overlap_mla_absorb=False, overlap_shared_experts=False, merge_qkv=False, overlap_lora=True,
                       pdl=False)
    for key in ("max_loras=2", "max_lora_rank=8", "dtype=float16", "lora_target_modules=q_proj", "fused_moe_table=t"):
        with pytest.raises(SystemExit, match=key.split("=")[0]):
            decode.parse_ab(key)


def test_ab_engine_of_a_layer_option_is_a_twin_sharing_the_weights(monkeypatch):
    """The B engine of `--ab mla_absorbed_decode=0` runs a twin of the model holding B's option in its MLA layers
    while A's keeps its own, over the same weight tensors (no copy): the A/B of such a switch in one run (the
    stream overlaps are CUDA-only options, off on this CPU in both)."""
    from moelora.layers.mla import MLAttention
    from tests.helpers.gpu_engine import DSV3_SIZES
    from tests.helpers.models import build_from_architecture
    from tests.helpers.oracle import tiny_hf_model

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the benchmark's Triton backend on the CPU: the interpreter's
    model = build_from_architecture(tiny_hf_model("deepseek_v3", seed=3, **DSV3_SIZES), 2, 8)
    a = decode.engine(model, model.config, 2, 8, 4, {}, device="cpu")
    b = decode.engine(model, model.config, 2, 8, 4, {}, device="cpu", **decode.parse_ab("mla_absorbed_decode=0"))
    mla = lambda eng: [m for m in eng.model.modules() if isinstance(m, MLAttention)]  # noqa: E731
    assert b.model is not a.model and mla(a) and mla(b)
    assert {m.options.mla_absorbed_decode for m in mla(a)} == {True}
    assert {m.options.mla_absorbed_decode for m in mla(b)} == {False}
    assert all(x.data_ptr() == y.data_ptr() for x, y in zip(a.model.parameters(), b.model.parameters(), strict=True))
    torch_b = decode.engine(model, model.config, 2, 8, 4, {}, device="cpu", **decode.parse_ab("kernel_backend=torch"))
    assert torch_b.cfg.kernel_backend == "torch" and a.cfg.kernel_backend == "triton"
