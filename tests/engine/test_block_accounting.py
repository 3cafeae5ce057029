"""KV-block accounting: whatever a request does (finishes, is aborted before, inside or after the step in
flight, is held for its last token, is preempted, shares prefix-cached blocks), every block comes back, in
both step modes; the idle engine shows zero blocks in use, also with the decode graphs' padding block
taken out of the pool.

`LLMEngine.check_blocks()` is the invariant checked after every operation: each block's refcount equals
the number of live requests holding it, free and cached-free blocks are where the allocator says, and the
blocks in use are exactly those live requests hold."""

from __future__ import annotations

import random

import pytest

import moelora.engine.engine as engine_module
from moelora.engine.config import EngineConfig
from moelora.engine.request import SamplingParams
from moelora.errors import RequestError
from tests.helpers.models import build, engine, random_adapter
from tests.helpers.oracle import tiny_hf_model


@pytest.fixture(scope="module")
def setup():
    model = build(tiny_hf_model("qwen3_moe", seed=7), max_loras=2, max_rank=8)
    adapters = {"x": random_adapter(model, 20, 6), "y": random_adapter(model, 21, 8, frac=0.6)}
    return model, adapters


class _PaddingOnlyGraphs:
    """Stands in for `CudaGraphRunner` on the CPU: takes the padding block the engine hands it and replays
    nothing (every step runs eager), so the engine's block accounting around decode graphs runs here."""

    def __init__(self, model, cache, max_num_seqs, max_model_len, dummy_block, *args):
        self.pad_block = dummy_block

    def capture(self, *args) -> None:
        pass

    def can_run(self, num_seqs: int) -> bool:
        return False


def test_idle_engine_with_decode_graphs_uses_no_block(setup, monkeypatch):
    """The CUDA "leak" (test_bench's `num_free == 13498 of 13499`, the server's `kv_cache_blocks_used`
    stuck at 1): the padding block graph buckets write to was taken from the allocator like a request's,
    so it counted as in use for good. Reproduced on the CPU with overlapped scheduling and graphs on."""
    model, adapters = setup
    monkeypatch.setattr(EngineConfig, "use_cuda_graphs", property(lambda self: True))
    monkeypatch.setattr(engine_module, "CudaGraphRunner", _PaddingOnlyGraphs)
    # the piecewise graphs (real CUDA captures) off: they write the same padding block
    eng = engine(model, adapters, max_loras=2, async_scheduling=True, num_kv_blocks=64, piecewise_graph_tokens=0)
    pad = eng.graphs.pad_block
    reqs = [eng.add_request([5 + i, 6, 7, 8, 9], SamplingParams(max_tokens=40, ignore_eos=True, temperature=0),
                            [None, "x", "y"][i % 3]) for i in range(6)]
    for _ in range(4):
        eng.step()
        eng.check_blocks()
        assert all(pad not in r.block_ids for r in reqs)  # never handed to a request
    for r in reqs[:3]:  # dropped mid-decode, as a client that closes its stream
        eng.abort(r.request_id)
        eng.check_blocks()
    while eng.has_unfinished():
        eng.step()
        eng.check_blocks()
    alloc = eng.cache.allocator
    assert alloc.num_used == 0 and alloc.num_free == alloc.num_blocks == 63
    assert all(len(r.output_ids) == 40 for r in reqs[3:])


@pytest.mark.parametrize("overlapped", [False, True], ids=["sync", "overlapped"])
def test_every_abort_path_returns_its_blocks(setup, overlapped):
    """The paths one by one, with prefix caching (blocks shared by refcount): a request aborted while held
    for its last token, one aborted in the step that admitted it (its blocks allocated by the step in
    flight), one finishing by length while held, one preempted while its token is in flight."""
    model, adapters = setup
    eng = engine(model, adapters, max_loras=2, async_scheduling=overlapped, block_size=2, num_kv_blocks=14)
    shared = [7, 8, 9, 10]
    held = eng.add_request(shared + [3], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), "x")
    ends = eng.add_request(shared + [4], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), "x")
    eng.step()
    eng.step()
    eng.check_blocks()
    if overlapped:
        assert held in eng.scheduler.held  # its last token is in flight
    eng.abort(held.request_id)
    eng.check_blocks()
    fresh = eng.add_request(shared + [5, 6], SamplingParams(max_tokens=9, ignore_eos=True), "x")
    eng.step()  # admits `fresh` (its prefix from the cache, new blocks taken) into the step in flight
    assert fresh.block_ids
    eng.abort(fresh.request_id)
    eng.check_blocks()
    long = [eng.add_request([20 + i] * 7, SamplingParams(max_tokens=6, ignore_eos=True), None) for i in range(3)]
    while eng.has_unfinished():  # 3 x 13 tokens in 14 blocks of 2: preemption
        eng.step()
        eng.check_blocks()
    assert ends.finish_reason == "length" and fresh.finish_reason == "abort"
    assert held.finish_reason == ("abort" if overlapped else "length")  # synchronous: done in 2 steps
    assert sum(r.num_preemptions for r in long) > 0 and all(len(r.output_ids) == 6 for r in long)
    assert eng.cache.allocator.num_used == 0


@pytest.mark.parametrize("overlapped", [False, True], ids=["sync", "overlapped"])
@pytest.mark.parametrize("seed", range(4))
def test_random_adds_aborts_and_steps_leave_no_block_in_use(setup, overlapped, seed):
    """Random adds (shared prefixes, adapters, stop tokens, short and long outputs), aborts at any time,
    prompt_logits calls (they settle the step in flight) and steps on a cache small enough to preempt;
    the invariant holds after every operation and nothing is in use at the end."""
    model, adapters = setup
    rng = random.Random(seed * 2 + overlapped)
    V = model.config.vocab_size
    eng = engine(model, adapters, max_loras=2, block_size=rng.choice([2, 4]), num_kv_blocks=rng.choice([12, 20, 64]),
                 max_num_batched_tokens=rng.choice([4, 9, 32]), enable_prefix_caching=rng.random() < 0.7,
                 async_scheduling=overlapped, max_num_seqs=rng.choice([2, 4, 8]), max_model_len=32)
    shared = [rng.randrange(3, V) for _ in range(6)]
    live, ops = [], []
    for _ in range(50):
        op = rng.random()
        if op < 0.3:
            prompt = (shared if rng.random() < 0.5 else []) + [rng.randrange(3, V) for _ in range(rng.randrange(1, 8))]
            kw = dict(max_tokens=rng.randrange(1, 10), temperature=0, ignore_eos=rng.random() < 0.8)
            if rng.random() < 0.3:
                kw["stop_token_ids"] = (rng.randrange(3, V),)
            live.append(eng.add_request(prompt, SamplingParams(**kw), rng.choice([None, "x", "y"])))
        elif op < 0.5 and live:
            victim = rng.choice(live)
            ops.append((victim in eng.scheduler.held, victim.finished))
            eng.abort(victim.request_id)
        elif op < 0.55:
            try:
                eng.prompt_logits([shared[:3]], [rng.choice([None, "x"])])
            except RequestError:  # no room in the cache right now
                pass
        else:
            eng.step()
        eng.check_blocks()
    for r in live:
        if rng.random() < 0.5:
            eng.abort(r.request_id)
    for _ in range(1000):
        if not eng.has_unfinished():
            break
        eng.step()
        eng.check_blocks()
    assert not eng.has_unfinished() and eng.step() == []
    assert eng.cache.allocator.num_used == 0 and not eng.requests and len(ops) > 3


def test_allocator_reserve_and_the_invariant_catch_what_they_should():
    from collections import Counter

    from moelora.engine.kv_cache import BlockAllocator

    alloc = BlockAllocator(4, 2)
    pad = alloc.reserve()
    assert alloc.num_blocks == 3 and alloc.num_free == 3 and alloc.num_used == 0
    taken = [alloc.allocate() for _ in range(3)]
    assert pad not in taken and alloc.num_free == 0
    alloc.check(Counter(taken))
    with pytest.raises(AssertionError, match="refcount 1, held by 0"):  # a block no live request holds: a leak
        alloc.check(Counter(taken[:2]))
    alloc.register(taken[0], 123)
    for b in taken:
        alloc.free(b)
    alloc.check(Counter())  # one cached-free (evictable) block, two free ones
    assert alloc.num_free == 3
    with pytest.raises(AssertionError, match="reserved"):
        alloc.free(pad)
