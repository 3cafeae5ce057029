"""The CPU engine end to end: paged decode equals full recompute; caching and preemption are
invisible in the output; stop rules; aborts free every block."""

from __future__ import annotations

import pytest

from moelora.engine.config import EngineConfig
from moelora.engine.request import SamplingParams
from moelora.errors import ConfigError, RequestError
from moelora.layers.moe import Experts
from tests.helpers.models import engine
from tests.helpers.runs import greedy_by_recompute, prompts, run


def test_paged_decode_equals_full_recompute(setup):
    model, adapters = setup
    eng = engine(model, adapters, block_size=4)
    ps = prompts(6, model.config.vocab_size)
    names = ["x", None, "y", "x", None, "y"]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    outs = run(eng, ps, names, params)
    for p, name, out in zip(ps, names, outs, strict=True):
        assert out == greedy_by_recompute(eng, p, name, 10)
    assert eng.cache.allocator.num_used == 0


def test_prefix_cache_chunking_and_preemption_do_not_change_output(setup):
    model, adapters = setup
    ps = prompts(8, model.config.vocab_size, seed=1)
    ps = ps + [list(p) for p in ps]  # repeated prompts hit the prefix cache
    names = ["x", "y", None, "x"] * 4
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ref = run(engine(model, adapters, enable_prefix_caching=False, num_kv_blocks=512), ps, names, params)
    cached = run(engine(model, adapters, block_size=2), ps, names, params)
    tight = engine(model, adapters, block_size=2, num_kv_blocks=64, max_num_batched_tokens=7)
    squeezed = run(tight, ps, names, params)
    assert cached == ref
    assert squeezed == ref
    assert tight.cache.allocator.num_used == 0


def test_seeded_sampling_is_reproducible_across_batches(setup):
    model, adapters = setup
    p = prompts(1, model.config.vocab_size, seed=3)[0]
    params = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, top_k=20, seed=123, ignore_eos=True)
    alone = run(engine(model, adapters), [p], ["x"], params)[0]
    others = SamplingParams(max_tokens=8, temperature=0.8, seed=9, ignore_eos=True)
    eng = engine(model, adapters)
    reqs = [eng.add_request(q, others, None) for q in prompts(3, model.config.vocab_size, seed=4)]
    mine = eng.add_request(p, params, "x")
    while eng.has_unfinished():
        eng.step()
    assert mine.output_ids == alone and all(r.output_ids for r in reqs)


def test_stop_token_and_max_tokens(setup):
    model, adapters = setup
    eng = engine(model, adapters)
    p = prompts(1, model.config.vocab_size, seed=5)[0]
    free = run(eng, [p], [None], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    stop_at = free[3]
    first = free.index(stop_at)
    req = eng.add_request(p, SamplingParams(max_tokens=6, temperature=0, stop_token_ids=(stop_at,)), None)
    while eng.has_unfinished():
        eng.step()
    # the stop token is the last output token (vLLM's), and not in the text
    assert req.output_ids == free[:first + 1] and (req.finish_reason, req.stop_reason) == ("stop", stop_at)
    req = eng.add_request(p, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), None)
    while eng.has_unfinished():
        eng.step()
    assert req.output_ids == free[:2] and (req.finish_reason, req.stop_reason) == ("length", None)


def test_abort_frees_blocks_and_bad_requests_are_refused(setup):
    model, adapters = setup
    eng = engine(model, adapters)
    r = eng.add_request([5, 6, 7, 8, 9], SamplingParams(max_tokens=50, ignore_eos=True), "x")
    eng.step()
    eng.step()
    assert eng.cache.allocator.num_used > 0
    eng.abort(r.request_id)
    assert eng.cache.allocator.num_used == 0 and not eng.has_unfinished()
    with pytest.raises(RequestError, match="unknown adapter 'nope'"):
        eng.add_request([1, 2], SamplingParams(), "nope")
    with pytest.raises(RequestError, match="max_model_len"):
        eng.add_request([1] * 500, SamplingParams(), None)
    with pytest.raises(RequestError, match="outside the vocabulary"):
        eng.add_request([1, 10_000], SamplingParams(), None)
    with pytest.raises(RequestError, match="max_tokens"):
        SamplingParams(max_tokens=-1)


def test_reused_adapter_name_never_reuses_old_kv(setup):
    model, adapters = setup
    swapped = {"x": adapters["x"], "y": adapters["y"]}
    eng = engine(model, swapped, block_size=2)
    p = list(range(5, 21))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    before = run(eng, [p], ["x"], params)[0]
    eng.pool.remove("x")
    swapped["x"] = adapters["y"]  # the same name now loads other weights
    eng.pool.add("x", "x")
    after = run(eng, [p], ["x"], params)[0]
    fresh = run(engine(model, {"x": adapters["y"]}), [p], ["x"], params)[0]
    assert after == fresh and before != fresh


def test_fused_moe_table_reaches_the_routed_experts(setup, tmp_path):
    """EngineConfig.fused_moe_table: the engine's model is built with it (its layer options, given to every
    layer's constructor), so every routed-experts module reads the file (checked when the config
    resolves); the caller's model keeps its own options; a missing file is a ConfigError."""
    model, adapters = setup
    path = tmp_path / "table.json"
    path.write_text('{"device": "NVIDIA H200", "configs": {}}')
    eng = engine(model, adapters, fused_moe_table=str(path))
    experts = [m for m in eng.model.modules() if isinstance(m, Experts)]
    assert experts and {m.options.fused_moe_table for m in experts} == {str(path.resolve())}
    assert {m.options.fused_moe_table for m in model.modules() if isinstance(m, Experts)} == {None}
    with pytest.raises(ConfigError, match="fused_moe_table: no fused-MoE table file"):
        engine(model, adapters, fused_moe_table=str(tmp_path / "missing.json"))
    assert engine(model, adapters).model is model


def test_triton_backend_off_cuda_is_refused_unless_interpreted(setup, monkeypatch):
    """kernel_backend "triton" on a CPU device is a ConfigError naming the fix (Triton's launcher would fail at the
    first kernel on a CPU tensor), unless Triton's interpreter runs the kernels (TRITON_INTERPRET=1: the tests)."""
    model, _ = setup
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match=r"kernel_backend='triton' runs its kernels on a CUDA device, not on "
                                          r"device='cpu': use kernel_backend='torch'"):
        EngineConfig(device="cpu", kernel_backend="triton").resolve(model.config)
    assert EngineConfig(device="cpu").resolve(model.config).kernel_backend == "torch"  # the CPU's default
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert EngineConfig(device="cpu", kernel_backend="triton").resolve(model.config).kernel_backend == "triton"


def test_a_dropped_engine_and_model_are_freed_without_the_cycle_collector():
    """No reference cycle holds an engine or its model (the adapter pool's loader, merged q/k/v's
    segments): dropped, they are freed at once, so a process that builds engines one after another
    (tests, benchmarks) gets the memory back without waiting for the collector; on CUDA a collection that
    freed a dropped engine's graphs inside another engine's capture would invalidate it."""
    import gc
    import weakref

    from moelora.demo.show import load_demo_llm

    gc.collect()
    gc.disable()
    try:
        llm = load_demo_llm("cpu", max_num_seqs=4)
        llm.generate(["hello"], SamplingParams(max_tokens=2))
        eng, model = weakref.ref(llm.engine), weakref.ref(llm.engine.model)
        del llm
        assert eng() is None and model() is None
    finally:
        gc.enable()
