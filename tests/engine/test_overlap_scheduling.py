"""Overlapped scheduling (`EngineConfig.async_scheduling`): step n+1 is launched before step n is
read back, its input ids gathered on the device from step n's samples. It must never change what
a request outputs: greedy tokens, logprobs, seeded samples, stop tokens and lengths, under prefix
caching, chunked prefill, preemption, aborts and mixed adapters, with every block returned."""

from __future__ import annotations

import torch

from moelora.engine.request import SamplingParams
from tests.helpers.models import engine
from tests.helpers.runs import prompts  # noqa: F401  (module fixture)


def outputs(eng, ps, names, params_list):
    reqs = [eng.add_request(p, params, a) for p, a, params in zip(ps, names, params_list, strict=True)]
    while eng.has_unfinished():
        eng.step()
    assert eng.cache.allocator.num_used == 0 and not eng.scheduler.held
    return [(r.output_ids, r.finish_reason, r.logprobs) for r in reqs]


def mixed_params(vocab: int, n: int) -> list[SamplingParams]:
    g = torch.Generator().manual_seed(11)
    out = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            out.append(SamplingParams(max_tokens=int(torch.randint(1, 12, (), generator=g)), temperature=0,
                                      ignore_eos=True, logprobs=2))
        elif kind == 1:  # stops on a common token (checked one step late, its extra row dropped)
            out.append(SamplingParams(max_tokens=14, temperature=0, stop_token_ids=tuple(range(3, vocab, 3))))
        elif kind == 2:
            out.append(SamplingParams(max_tokens=9, temperature=0.9, top_k=20, seed=100 + i, ignore_eos=True))
        else:
            out.append(SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    return out


def test_overlapped_equals_synchronous(setup):  # noqa: F811
    model, adapters = setup
    vocab = model.config.vocab_size
    ps = prompts(12, vocab, seed=8)
    ps = ps + [list(p) for p in ps[:4]]  # prefix-cache hits
    names = ["x", None, "y", "x"] * 4
    params = mixed_params(vocab, len(ps))
    for kw in (dict(block_size=4), dict(block_size=2, num_kv_blocks=48, max_num_batched_tokens=7)):
        want = outputs(engine(model, adapters, **kw), ps, names, params)
        got = outputs(engine(model, adapters, async_scheduling=True, **kw), ps, names, params)
        assert [g[0] for g in got] == [w[0] for w in want]
        assert [g[1] for g in got] == [w[1] for w in want]
        for g, w in zip(got, want, strict=True):
            assert len(g[2]) == len(w[2])
            for a, b in zip(g[2], w[2], strict=True):
                assert abs(a[0] - b[0]) <= 1e-5 and a[1] == b[1] and [t for t, _ in a[2]] == [t for t, _ in b[2]]


def test_overlapped_engine_really_overlaps_and_stops_at_max_model_len(setup):  # noqa: F811
    model, adapters = setup
    eng = engine(model, adapters, async_scheduling=True, max_model_len=24)
    p = prompts(1, model.config.vocab_size, seed=9)[0]
    req = eng.add_request(p, SamplingParams(max_tokens=100, temperature=0, ignore_eos=True), "x")
    first = eng.step()  # launches the prefill, reads nothing back yet
    assert first == [] and eng.has_unfinished() and req.num_pending == 1 and not req.output_ids
    most = 0
    while eng.has_unfinished():
        eng.step()
        most = max(most, req.num_computed)
    # a request certain to finish by length is not scheduled again (no row past max_model_len)
    assert most == 23 and req.finish_reason == "length" and len(req.prompt_ids) + len(req.output_ids) == 24
    sync = engine(model, adapters, max_model_len=24)
    ref = sync.add_request(p, SamplingParams(max_tokens=100, temperature=0, ignore_eos=True), "x")
    while sync.has_unfinished():
        sync.step()
    assert req.output_ids == ref.output_ids and eng.cache.allocator.num_used == 0


def test_abort_while_a_step_is_in_flight(setup):  # noqa: F811
    model, adapters = setup
    eng = engine(model, adapters, async_scheduling=True)
    a = eng.add_request([5, 6, 7, 8, 9], SamplingParams(max_tokens=50, ignore_eos=True), "x")
    b = eng.add_request([9, 8, 7], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), None)
    eng.step()
    eng.step()
    eng.abort(a.request_id)
    while eng.has_unfinished():
        eng.step()
    assert a.finish_reason == "abort" and b.finish_reason == "length" and len(b.output_ids) == 5
    assert eng.cache.allocator.num_used == 0


def test_abort_returns_blocks_and_leaves_nothing_unfinished(setup):  # noqa: F811
    """What test_engine checks of aborts holds with a step in flight: blocks are back at once and
    nothing is left unfinished (the in-flight rows are dropped by the next step)."""
    model, adapters = setup
    eng = engine(model, adapters, async_scheduling=True)
    r = eng.add_request([5, 6, 7, 8, 9], SamplingParams(max_tokens=50, ignore_eos=True), "x")
    eng.step()
    eng.step()
    assert eng.cache.allocator.num_used > 0 and r.output_ids
    eng.abort(r.request_id)
    assert eng.cache.allocator.num_used == 0 and not eng.has_unfinished()
    assert eng.step() == [] and eng._launched is None


def test_overlap_is_on_by_default_with_cuda_only(setup):  # noqa: F811
    """None (the default) resolves to the device's choice: off on the CPU, where there is no device
    work to hide host work behind; an explicit value is kept."""
    from moelora.engine.config import EngineConfig

    model, _ = setup
    assert EngineConfig(device="cpu").resolve(model.config).async_scheduling is False
    assert EngineConfig(device="cpu", async_scheduling=True).resolve(model.config).async_scheduling is True
    if torch.cuda.is_available():
        assert EngineConfig(device="cuda").resolve(model.config).async_scheduling is True
        assert EngineConfig(device="cuda", async_scheduling=False).resolve(model.config).async_scheduling is False


def test_a_step_settled_by_prompt_logits_is_still_reported(setup):  # noqa: F811
    """`prompt_logits` (the server's echo) reads the step in flight back itself; the requests that
    step changed, finished ones included, must still come out of the next `step()` (the server
    delivers tokens and finishes from what step() returns: a lost finish is a client that waits
    forever)."""
    model, adapters = setup
    eng = engine(model, adapters, async_scheduling=True)
    p = prompts(2, model.config.vocab_size, seed=12)
    done = eng.add_request(p[0], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True), "x")
    assert eng.step() == []  # its prefill is in flight, not read back
    eng.prompt_logits([p[1]], [None])
    assert done.finished and eng.has_unfinished()
    assert eng.step() == [done] and not eng.has_unfinished()
    # a request still running: its settled token comes out with the next step, once
    going = eng.add_request(p[1], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), "y")
    eng.step()
    eng.step()
    eng.prompt_logits([p[0]], ["x"])
    got = eng.step()
    assert got.count(going) == 1 and len(going.output_ids) == 2
    while eng.has_unfinished():
        eng.step()
    assert going.finish_reason == "length" and len(going.output_ids) == 3
