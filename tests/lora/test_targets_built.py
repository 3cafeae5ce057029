"""`lora_target_modules` is a layer option: a model's constructor drops the untargeted sites' slots, an engine
refuses a model built with other targets instead of changing it, and a twin built with targets shares the
slots it keeps. CPU, tiny model."""

from __future__ import annotations

import pytest
import torch

from moelora.config import ModelConfig
from moelora.engine.config import EngineConfig
from moelora.engine.engine import LLMEngine
from moelora.errors import ConfigError
from moelora.layers.options import LayerOptions
from moelora.models.lora_targets import site_kinds
from moelora.models.registry import model_class
from tests.helpers.oracle import tiny_hf_model


def test_the_constructor_decides_the_lora_sites_and_the_engine_keeps_them():
    hf = tiny_hf_model("qwen2_moe", seed=3)
    cfg = ModelConfig.from_dict(dict(hf.config.to_dict(), architectures=[type(hf).__name__]))
    targets = ("self_attn",)
    full = model_class(cfg)(cfg, max_loras=2, max_rank=8)
    narrow = model_class(cfg)(cfg, max_loras=2, max_rank=8, options=LayerOptions(lora_target_modules=targets))
    assert any(k.startswith("mlp.") for k in site_kinds(full.lora_sites()))
    assert site_kinds(narrow.lora_sites()) and all(k.startswith("self_attn.") for k in site_kinds(narrow.lora_sites()))
    assert narrow.model.layers[0].mlp.experts.lora_gate_up_a is None  # no slot memory for a dropped site

    engine_cfg = EngineConfig(device="cpu", dtype="float32", max_loras=2, max_lora_rank=8, block_size=4,
                              num_kv_blocks=16, max_model_len=64, lora_target_modules=targets).resolve(cfg)
    with pytest.raises(ConfigError, match=r"lora_target_modules=None \(the config's: \('self_attn',\)\)"):
        LLMEngine(full, None, engine_cfg, lambda name, path: None)
    assert full.model.layers[0].mlp.experts.lora_gate_up_a is not None  # refused, not changed
    assert LLMEngine(narrow, None, engine_cfg, lambda name, path: None).model is narrow

    twin = full.with_options(engine_cfg.layer_options(full.options))
    assert twin.lora_sites().keys() == narrow.lora_sites().keys()
    assert full.lora_sites().keys() > twin.lora_sites().keys()  # the source keeps its own sites
    key = next(iter(twin.lora_sites()))
    mine, theirs = full.lora_sites()[key][0], twin.lora_sites()[key][0]
    assert theirs.lora_a.data_ptr() == mine.lora_a.data_ptr() and torch.equal(theirs.lora_ranks, mine.lora_ranks)
