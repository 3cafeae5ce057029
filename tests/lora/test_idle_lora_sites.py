"""Idle LoRA sites (`EngineConfig.skip_idle_lora_sites`): a site at which no slot holds adapter
weights runs no LoRA at all, a site turns on when the first adapter with LoRA there is written,
and skipping changes no output bit (the skipped delta is exactly zero)."""

from __future__ import annotations

import pytest

import moelora.layers.moe as moe_layer
from moelora.engine.config import EngineConfig
from moelora.engine.engine import LLMEngine
from moelora.engine.request import SamplingParams
from moelora.layers.moe import Experts
from moelora.lora.adapter import LoRAAdapter
from moelora.models.lora_targets import lora_site_owners
from tests.helpers.models import build, engine, random_adapter
from tests.helpers.oracle import tiny_hf_model


@pytest.fixture(scope="module")
def setup():
    model = build(tiny_hf_model("qwen2_moe", seed=5), max_loras=4, max_rank=8)
    full = random_adapter(model, 30, 8)
    attn_sites = {k: w for k, w in random_adapter(model, 31, 6).sites.items() if ".self_attn." in k}
    assert attn_sites and len(attn_sites) < len(full.sites)
    return model, {"full": full, "attn": LoRAAdapter("attn", "", attn_sites)}


def owners_of(model, pred) -> set:
    return {owner for key, owner in lora_site_owners(model).items() if pred(key)}


def generate(eng, names, n_tokens=6, seed=0):
    params = SamplingParams(max_tokens=n_tokens, temperature=0, ignore_eos=True, logprobs=0)
    vocab = eng.model_config.vocab_size
    reqs = [eng.add_request([(7 * i + 3 * j + seed) % (vocab - 3) + 3 for j in range(5 + i)], params, name)
            for i, name in enumerate(names)]
    while eng.has_unfinished():
        eng.step()
    return reqs


def unregistered(model, adapters, **kw) -> LLMEngine:
    """A CPU engine whose loader knows `adapters` but has registered none of them yet."""
    cfg = EngineConfig(**dict(dict(device="cpu", dtype="float32", max_loras=4, max_lora_rank=8, block_size=4,
                                   num_kv_blocks=64, max_model_len=128), **kw)).resolve(model.config)
    return LLMEngine(model, None, cfg, lambda name, path: adapters[name])


def test_sites_start_idle_turn_on_with_their_adapter_and_stay_on(setup):
    model, adapters = setup
    eng = unregistered(model, adapters, max_loras=1)
    everything = set(lora_site_owners(model).values())
    assert eng.lora_idle == everything
    attention = owners_of(model, lambda k: ".self_attn." in k)
    eng.pool.add("attn", "attn")
    generate(eng, ["attn"])
    assert eng.lora_idle == everything - attention
    eng.pool.add("full", "full")
    generate(eng, ["full"])  # one slot: "attn" is evicted, its sites stay on
    assert eng.pool.evictions == 1
    assert eng.lora_idle == frozenset()
    off = engine(model, adapters, skip_idle_lora_sites=False)
    assert off.lora_idle == frozenset()


def test_adding_an_adapter_turns_its_sites_on(setup):
    """Registering an adapter (`pool.add`: the server's load endpoint, `LLM.add_adapter`) turns its
    sites on, so graphs can be re-captured before the first request (`capture_graphs`; no graphs
    on the CPU); adapters given to the engine at construction are registered before its capture."""
    model, adapters = setup
    eng = unregistered(model, adapters)
    everything = set(lora_site_owners(model).values())
    assert eng.lora_idle == everything
    eng.pool.add("attn", "attn")
    assert eng.lora_idle == everything - owners_of(model, lambda k: ".self_attn." in k)
    assert eng.pool.slots_in_use() == 0  # registered, not yet in a slot
    eng.capture_graphs()  # nothing to capture on the CPU
    at_start = LLMEngine(model, None, eng.cfg, lambda name, path: adapters[name], {"attn": "attn"})
    assert at_start.pool.names == ["attn"]
    assert at_start.lora_idle == eng.lora_idle  # registered before the (GPU) graphs would be captured


def test_idle_sites_launch_no_lora_and_change_no_bit(setup, monkeypatch):
    """Adapters on attention only: the routed experts get no LoRA arguments (the torch twin is never
    handed a LoRA batch there), and tokens and logprobs equal those of the engine that runs every
    site's (all-zero) LoRA."""
    model, adapters = setup
    names = ["attn", None, "attn", None]
    expert_lora = []
    real = moe_layer.fused_moe_ref

    def recording(*args, lora=None):
        expert_lora.append(lora)
        return real(*args, lora=lora)

    monkeypatch.setattr(moe_layer, "fused_moe_ref", recording)
    skipped = generate(engine(model, {"attn": adapters["attn"]}), names)
    assert expert_lora and all(lora is None for lora in expert_lora)
    expert_lora.clear()
    ran = generate(engine(model, {"attn": adapters["attn"]}, skip_idle_lora_sites=False), names)
    assert any(lora is not None for lora in expert_lora)
    for a, b in zip(skipped, ran, strict=True):
        assert a.output_ids == b.output_ids and a.logprobs == b.logprobs, a.request_id


def test_a_site_turning_on_mid_run_changes_no_bit(setup):
    """The second adapter's expert sites turn on while requests of the first are still decoding."""
    model, adapters = setup

    def staggered(eng):
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
        eng.pool.add("attn", "attn")
        first = [eng.add_request([5 + i, 9, 11 + i], params, name) for i, name in enumerate(["attn", None])]
        for _ in range(3):
            eng.step()
        eng.pool.add("full", "full")  # registered (its sites on) while the first requests decode
        second = [eng.add_request([4, 8 + i, 15], params, name) for i, name in enumerate(["full", "attn"])]
        while eng.has_unfinished():
            eng.step()
        return first + second

    on = staggered(unregistered(model, adapters))
    off = staggered(unregistered(model, adapters, skip_idle_lora_sites=False))
    for a, b in zip(on, off, strict=True):
        assert a.output_ids == b.output_ids and a.logprobs == b.logprobs, a.request_id


def test_an_idle_owner_gets_no_lora_args(setup):
    model, _ = setup
    from moelora.lora.batch import LoRABatch

    experts = next(m for m in model.modules() if isinstance(m, Experts))
    qkv = model.model.layers[0].self_attn
    batch = LoRABatch.build([0, -1], [8] * 4, "cpu", idle=frozenset({experts}))
    assert experts.lora_args(batch) is None
    assert experts.lora_args(LoRABatch.build([0, -1], [8] * 4, "cpu")) is not None
    sites = [m for m in qkv.modules() if hasattr(m, "lora_owner") and m.has_lora]
    assert sites and all(m.lora_args(batch) is not None for m in sites)
    idle_attn = LoRABatch.build([0, -1], [8] * 4, "cpu", idle=frozenset(m.lora_owner for m in sites))
    assert all(m.lora_args(idle_attn) is None for m in sites)  # a q/k/v segment follows its merged owner
