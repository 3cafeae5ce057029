"""Layer options reach every layer through its constructor (contract 8): an engine builds its model with its
config's `LayerOptions`, refuses a model built with others, and `with_options` makes a twin that shares the
model's tensors. CPU, tiny models."""

from __future__ import annotations

import pytest
import torch

from moelora.config import ModelConfig
from moelora.engine.config import EngineConfig
from moelora.engine.engine import LLMEngine
from moelora.errors import ConfigError
from moelora.layers.attention import Attention
from moelora.layers.mla import MLAttention
from moelora.layers.moe import Experts, SparseMoE
from moelora.layers.options import LayerOptions
from moelora.models.lora_targets import restrict_lora_sites
from moelora.models.registry import model_class
from tests.helpers.models import build, random_adapter
from tests.helpers.oracle import tiny_hf_model


def cpu_config(model, **kw) -> EngineConfig:
    return EngineConfig(**dict(dict(device="cpu", dtype="float32", max_loras=2, max_lora_rank=8, block_size=4,
                                    num_kv_blocks=16, max_model_len=64), **kw)).resolve(model.config)


@pytest.fixture(scope="module")
def model():
    return build(tiny_hf_model("qwen2_moe", seed=3), max_loras=2, max_rank=8)


def test_every_layer_holds_the_options_it_was_built_with():
    """Attention, MLA, experts and the MoE block each read the option they switch on from their own
    constructor's options; nothing else sets them."""
    options = LayerOptions(fused_moe_table="t.json", overlap_shared_experts=True, mla_absorbed_decode=False,
                           merge_qkv=False)
    for family, kind in (("qwen2_moe", Attention), ("deepseek_v3", MLAttention)):
        hf = tiny_hf_model(family, seed=5)
        cfg = ModelConfig.from_dict(dict(hf.config.to_dict(), architectures=[type(hf).__name__]))
        built = model_class(cfg)(cfg, max_loras=1, max_rank=4, options=options)
        holders = [m for m in built.modules() if isinstance(m, (kind, Experts, SparseMoE))]
        assert {type(m) for m in holders} >= {kind, Experts, SparseMoE}
        assert all(m.options is options for m in holders)


def test_engine_refuses_a_model_built_with_other_options(model):
    """The engine cannot change a layer's options: a model built for another config is refused, naming the
    option and both values."""
    with pytest.raises(ConfigError, match=r"merge_qkv=True \(the config's: False\)"):
        LLMEngine(model, None, cpu_config(model, merge_qkv=False), lambda name, path: None)
    LLMEngine(model, None, cpu_config(model), lambda name, path: None)  # the CPU defaults: the model's own


def test_twin_shares_every_tensor_and_the_lora_sites(model):
    """`with_options`: a twin built through the constructors, holding this model's parameters and buffers
    (the same tensors: a slot written in one is in the other) and its LoRA sites as `lora_targets` left
    them; the same options give the model itself."""
    hf = tiny_hf_model("qwen2_moe", seed=3)
    narrow = build(hf, max_loras=2, max_rank=8)
    restrict_lora_sites(narrow, ("q_proj", "experts"))
    ds = tiny_hf_model("deepseek_v3", seed=5)
    cfg = ModelConfig.from_dict(dict(ds.config.to_dict(), architectures=[type(ds).__name__]))
    mla = model_class(cfg)(cfg, max_loras=1, max_rank=4)
    for source in (model, narrow, mla):
        twin = source.with_options(LayerOptions(merge_qkv=False, mla_absorbed_decode=False))
        assert twin is not source and not twin.options.merge_qkv and source.options.merge_qkv
        mine = dict(source.named_parameters()) | dict(source.named_buffers())
        theirs = dict(twin.named_parameters()) | dict(twin.named_buffers())
        assert mine.keys() == theirs.keys() and all(theirs[k] is mine[k] for k in mine)
        assert twin.lora_sites().keys() == source.lora_sites().keys()
    assert model.with_options(model.options) is model
    adapter = random_adapter(model, seed=4, rank=8)
    twin = model.with_options(LayerOptions(merge_qkv=False))
    twin.set_lora_slot(1, adapter)
    key, (site, _) = next((k, v) for k, v in model.lora_sites().items() if v[1] is None)
    assert torch.equal(site.lora_b[1, :, :adapter.sites[key].rank], adapter.sites[key].b)
    model.set_lora_slot(1, None)
