"""`EngineConfig.lora_target_modules`: only the named modules keep LoRA slots (the others launch no
LoRA kernel); adapters with LoRA elsewhere are refused when added; outputs at the kept sites are
unchanged."""

from __future__ import annotations

import pytest
import torch

from moelora.engine.request import SamplingParams
from moelora.errors import AdapterError, ConfigError
from moelora.lora.adapter import LoRAAdapter
from moelora.models.lora_targets import matches, restrict_lora_sites, site_kinds
from tests.helpers.models import build, engine, random_adapter
from tests.helpers.oracle import tiny_hf_model
from tests.helpers.runs import prompts, run


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model("qwen3_moe", seed=7)


def kinds(model) -> list[str]:
    return site_kinds(model.lora_sites())


def test_matching_is_by_whole_name_components():
    key = "model.layers.3.mlp.experts.gate_up"
    assert all(matches(key, t) for t in ("experts", "mlp.experts", "gate_up", "layers.3", key))
    assert not any(matches(key, t) for t in ("expert", "gate", "layers.30", "up"))


def test_restrict_keeps_the_named_sites_and_frees_the_others(hf):
    model = build(hf, max_loras=2, max_rank=8)
    everything = kinds(model)
    assert {"self_attn.q_proj", "self_attn.k_proj", "mlp.gate", "mlp.experts.gate_up"} <= set(everything)
    restrict_lora_sites(model, ("q_proj", "o_proj", "experts"))
    assert kinds(model) == ["mlp.experts.down", "mlp.experts.gate_up", "self_attn.o_proj", "self_attn.q_proj"]
    layer = model.model.layers[0]
    assert layer.mlp.gate.lora_a is None and not layer.mlp.gate.has_lora  # router slots freed
    qkv = layer.self_attn.qkv_proj  # merged q/k/v keep one buffer: q is targeted, k and v stay rank 0
    assert qkv.has_lora and qkv.lora_a is not None and not layer.self_attn.k_proj.has_lora
    restrict_lora_sites(model, ("q_proj", "o_proj", "experts"))  # idempotent
    assert len(kinds(model)) == 4
    restrict_lora_sites(model, ("o_proj",))
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert not qkv.has_lora and qkv.lora_a is None  # no segment left: the merged buffers go too


def test_a_target_naming_nothing_is_a_config_error(hf):
    model = build(hf, max_loras=2, max_rank=8)
    with pytest.raises(ConfigError, match=r"\['qproj'\].*self_attn.q_proj"):
        restrict_lora_sites(model, ("q_proj", "qproj"))
    assert len(kinds(model)) > 4  # nothing dropped


def test_engine_refuses_adapters_outside_and_keeps_outputs_inside(hf):
    model = build(hf, max_loras=2, max_rank=8)
    full = random_adapter(model, 30, 8)
    attn = LoRAAdapter("attn", "", {k: w for k, w in full.sites.items() if ".self_attn." in k})
    ps = prompts(4, model.config.vocab_size, seed=3)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = run(engine(model, {"attn": attn}), ps, ["attn", None, "attn", None], params)
    restricted_model = build(hf, max_loras=2, max_rank=8)
    served = {"attn": attn}
    eng = engine(restricted_model, served, lora_target_modules=("self_attn",))
    assert run(eng, ps, ["attn", None, "attn", None], params) == want
    served["full"] = full
    with pytest.raises(AdapterError, match=r"'full' has LoRA on .*mlp.experts.down.*lora_target_modules"):
        eng.pool.add("full", "full")
    assert "full" not in eng.pool.names
    assert eng.model.model.layers[0].mlp.experts.lora_gate_up_a is None  # the twin built with the targets


def test_config_checks_the_type():
    from moelora.engine.config import EngineConfig

    hf_cfg = build(tiny_hf_model("qwen3_moe", seed=7)).config
    with pytest.raises(ConfigError, match="lora_target_modules"):
        EngineConfig(device="cpu", lora_target_modules="q_proj").resolve(hf_cfg)
    assert EngineConfig(device="cpu", lora_target_modules=("q_proj",)).resolve(hf_cfg).lora_target_modules == (
        "q_proj",)
    assert torch.device(EngineConfig(device="cpu").resolve(hf_cfg).device).type == "cpu"
