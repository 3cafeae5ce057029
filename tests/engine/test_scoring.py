"""Prompt scoring (`engine/scoring.py`): every position's logprobs of many sequences, packed into forwards of
the step budget and `max_loras` adapters, long ones chunked over several forwards, logits made a few rows at a
time. The oracle: transformers with each adapter merged into its weights, run on each sequence alone."""

from __future__ import annotations

import pytest
import torch

from moelora.engine.runner import ModelRunner
from moelora.errors import RequestError
from tests.helpers.models import build, build_from_architecture, engine, merged_hf, random_adapter
from tests.helpers.oracle import tiny_hf_model

BUDGET = 16  # tokens a forward
LOGIT_ROWS = 5  # logits rows made at once
K = 3


def _oracle(hf, adapter, ids: list[int]) -> torch.Tensor:
    model = hf if adapter is None else merged_hf(hf, adapter)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def _forwards(eng) -> list[tuple[int, set]]:
    """Spy on the runner: (rows, adapters) of each forward."""
    seen, run = [], eng.runner.run

    def spy(inputs, all_logits=False, rows_fn=None):
        slots = set() if inputs.lora is None else set(inputs.lora.token_slots.tolist()) - {-1}
        seen.append((inputs.input_ids.shape[0], slots))
        return run(inputs, all_logits, rows_fn)
    eng.runner.run = spy
    return seen


def _serve(server, loop, awaitable):
    """Start the `AsyncEngine`, wait for `awaitable` (at most 60 s), shut it down."""
    import asyncio

    server.start()
    try:
        return loop.run_until_complete(asyncio.wait_for(awaitable, 60))
    finally:
        server.shutdown()
        loop.close()


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2"])
def test_batched_chunked_prompt_logprobs_equal_each_sequence_alone_in_transformers(family):
    hf = tiny_hf_model(family, seed=3)
    model = build_from_architecture(hf, max_loras=2, max_rank=8)
    adapters = {n: random_adapter(model, 30 + i, 4 + 2 * i) for i, n in enumerate("abc")}
    eng = engine(model, adapters, max_loras=2, max_num_batched_tokens=BUDGET)
    eng.runner.logit_rows = LOGIT_ROWS
    forwards = _forwards(eng)
    g = torch.Generator().manual_seed(5)
    lengths, names = [3, 37, 1, 20, 9, 2, 15], [None, "a", "b", "a", None, "c", "b"]
    seqs = [torch.randint(3, hf.config.vocab_size, (n,), generator=g).tolist() for n in lengths]
    free = eng.cache.allocator.num_free
    got = eng.prompt_logprobs_batch([(ids, name, K) for ids, name in zip(seqs, names, strict=True)])
    assert eng.cache.allocator.num_free == free
    # packed: every forward full but the last, at most 2 adapters each, 37 tokens over three or more of them
    assert [rows for rows, _ in forwards[:-1]] == [BUDGET] * (len(forwards) - 1)
    assert len(forwards) == -(-sum(lengths) // BUDGET) and all(len(slots) <= 2 for _, slots in forwards)
    for ids, name, rows in zip(seqs, names, got, strict=True):
        want = _oracle(hf, None if name is None else adapters[name], ids)
        assert len(rows) == len(ids) and rows[0] == (None, None, ())
        for p in range(1, len(ids)):
            lp, rank, top = rows[p]
            row = want[p - 1]
            assert lp == pytest.approx(row[ids[p]].item(), abs=1e-4)
            assert rank == int((row > row[ids[p]]).sum()) + 1
            assert [t for t, _ in top] == row.topk(K).indices.tolist()
            assert [v for _, v in top] == pytest.approx(row.topk(K).values.tolist(), abs=1e-4)


def test_prompt_logits_in_chunks_equal_one_forward():
    """`prompt_logits` (`LLM.logits`, verify) over forwards of the budget and logits chunks: the same values as
    one forward of each sequence with its logits made at once."""
    hf = tiny_hf_model("qwen3_moe", seed=4)
    model = build(hf, max_loras=2, max_rank=8)
    adapters = {"a": random_adapter(model, 40, 6)}
    seqs, names = [[5, 6, 7, 8, 9] * 7, [11, 12, 13], [4] * 19], ["a", None, "a"]
    whole = engine(model, adapters, max_num_batched_tokens=128)
    want = [whole.prompt_logits([s], [n])[0] for s, n in zip(seqs, names, strict=True)]
    small = engine(model, adapters, max_num_batched_tokens=BUDGET, max_num_seqs=2)
    small.runner.logit_rows = LOGIT_ROWS
    seen, run = [], small.runner.run
    small.runner.run = lambda inputs, *a, **k: seen.append(len(inputs.meta.seqs)) or run(inputs, *a, **k)
    for got, ref, s in zip(small.prompt_logits(seqs + seqs[1:2], names + [None]), want + want[1:2],
                           seqs + seqs[1:2], strict=True):
        assert got.shape == (len(s), hf.config.vocab_size)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert max(seen) == 2  # max_num_seqs sequences a forward at most


def test_a_sequence_that_cannot_be_scored_fails_alone():
    hf = tiny_hf_model("qwen3_moe", seed=4)
    model = build(hf, max_loras=1, max_rank=8)
    eng = engine(model, {"a": random_adapter(model, 41, 4)}, max_loras=1, max_num_batched_tokens=BUDGET,
                 num_kv_blocks=8, max_model_len=64)  # 8 blocks of 4 tokens: 32 tokens of cache
    free = eng.cache.allocator.num_free
    items = [([5, 6, 7], "a", 1), ([5, 6], "nope", 1), ([], None, 1), ([7] * 65, None, 1), ([7] * 40, None, 1),
             ([8, 9, 10, 11], None, 2)]
    got = eng.prompt_logprobs_batch(items)
    assert [type(r) for r in got] == [list, RequestError, RequestError, RequestError, RequestError, list]
    assert "unknown adapter 'nope'" in str(got[1]) and "allowed 1..64" in str(got[3])
    assert "needs 10 KV cache blocks; the cache has 8" in str(got[4])
    assert len(got[5]) == 4 and len(got[5][3][2]) == 2
    assert eng.cache.allocator.num_free == free
    with pytest.raises(RequestError, match="unknown adapter"):
        eng.prompt_logprobs([1, 2], "nope", 1)


def test_logit_rows_follow_the_vocabulary():
    """~256 MiB of fp32 logits a chunk: 441 rows of a 152k vocabulary."""
    class Model:
        class config:
            vocab_size = 151936
    assert ModelRunner(Model(), None, torch.device("cpu")).logit_rows == 441


def test_the_server_thread_scores_a_budget_at_a_time_between_generation_steps():
    """`AsyncEngine`: prompt_logprobs calls queued together share forwards, up to one step budget of tokens a
    turn (at least one call), and take turns with the steps of the requests generating meanwhile."""
    import asyncio

    from moelora.engine.request import SamplingParams
    from moelora.server.async_engine import AsyncEngine

    model = build(tiny_hf_model("qwen3_moe", seed=4))
    eng = engine(model, max_num_batched_tokens=BUDGET, warmup=False)
    events, step, batch = [], eng.step, eng.prompt_logprobs_batch
    eng.step = lambda: events.append("step") or step()
    eng.prompt_logprobs_batch = lambda items: events.append([len(i[0]) for i in items]) or batch(items)
    eng.add_request([5, 6, 7], SamplingParams(max_tokens=30, ignore_eos=True))
    server, loop = AsyncEngine(eng), asyncio.new_event_loop()
    lengths = [10, 10, 4, 4, 4, 4, 20]
    futures = [loop.create_future() for _ in lengths]
    for n, future in zip(lengths, futures, strict=True):  # all queued before the thread looks
        server.send(("prompt_logprobs", list(range(3, 3 + n)), None, 1, None, loop, future))
    got = _serve(server, loop, asyncio.gather(*futures))
    assert [len(rows) for rows in got] == lengths
    assert [e for e in events if e != "step"] == [[10], [10, 4], [4, 4, 4], [20]]
    scored = [i for i, e in enumerate(events) if e != "step"]
    assert all(events[i + 1] == "step" for i in scored[:-1])  # a generation step after each turn


def test_a_scored_prompt_leaves_its_blocks_for_its_generation():
    """lm-eval's loglikelihood request scores the prompt, then generates from it: the scoring's full blocks are
    in the prefix cache (keyed by adapter) and the generation computes the rest only, with the same tokens as
    an engine that never scored it."""
    from moelora.engine.request import SamplingParams

    hf = tiny_hf_model("qwen3_moe", seed=4)
    model = build(hf, max_loras=2, max_rank=8)
    adapters = {"a": random_adapter(model, 42, 6)}
    prompt, params = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], SamplingParams(max_tokens=6, temperature=0.0)
    outs = []
    for scored in (False, True):
        eng = engine(model, adapters, max_num_batched_tokens=BUDGET)  # blocks of 4 tokens
        if scored:
            eng.prompt_logprobs(prompt, "a", 1)
            assert eng.scheduler.prefix_hit_tokens == 0
        req = eng.add_request(prompt, params, "a")
        while eng.has_unfinished():
            eng.step()
        outs.append(req.output_ids)
        assert eng.scheduler.prefix_hit_tokens == (8 if scored else 0)
        eng.check_blocks()
        eng.add_request(prompt, params, None)  # the base model's KV is not the adapter's
        while eng.has_unfinished():
            eng.step()
        assert eng.scheduler.prefix_hit_tokens == (8 if scored else 0)
        eng.check_blocks()
    assert outs[0] == outs[1]


def test_the_server_thread_retries_a_sequence_whose_blocks_running_requests_hold():
    """A prompt to score while generating requests hold the blocks it needs waits for them (no error), then is
    scored as on an idle engine."""
    import asyncio

    from moelora.engine.request import SamplingParams
    from moelora.server.async_engine import AsyncEngine

    model = build(tiny_hf_model("qwen3_moe", seed=4))
    kw = dict(max_num_batched_tokens=64, warmup=False, num_kv_blocks=16)  # 16 blocks of 4 tokens
    prompt = list(range(3, 31))  # 7 blocks
    want = engine(model, **kw).prompt_logprobs(prompt, None, 2)
    eng = engine(model, **kw)
    eng.add_request(list(range(30, 70)), SamplingParams(max_tokens=8, ignore_eos=True))  # 10 blocks, 12 at its end
    eng.step()
    assert eng.cache.allocator.num_free < 7
    events, step, batch = [], eng.step, eng.prompt_logprobs_batch
    eng.step = lambda: events.append("step") or step()
    eng.prompt_logprobs_batch = lambda items: events.append("score") or batch(items)
    server, loop = AsyncEngine(eng), asyncio.new_event_loop()
    future = loop.create_future()
    server.send(("prompt_logprobs", prompt, None, 2, None, loop, future))
    got = _serve(server, loop, future)
    assert events[0] == "score" and events[-1] == "score" and "step" in events
    assert [e[:2] for e in got[1:]] == [e[:2] for e in want[1:]]


def test_a_prompt_of_another_adapter_waits_for_a_slot_the_running_requests_free():
    """Running requests hold both adapter slots (a, b): a prompt of adapter c to score waits for them to finish
    instead of evicting a slot the next step copies back in; prompts of a (held) or the base model are scored
    meanwhile. One eviction in all (c's, after they finished); its logprobs as on an idle engine."""
    import asyncio

    from moelora.engine.request import SamplingParams
    from moelora.server.async_engine import AsyncEngine

    model = build(tiny_hf_model("qwen3_moe", seed=4), max_loras=2, max_rank=8)
    adapters = {name: random_adapter(model, seed, 4) for name, seed in (("a", 41), ("b", 42), ("c", 43))}
    kw = dict(max_num_batched_tokens=BUDGET, warmup=False, max_loras=2)
    prompt = list(range(3, 10))  # two in a forward of BUDGET tokens
    want = engine(model, adapters, **kw).prompt_logprobs(prompt, "c", 2)
    eng = engine(model, adapters, **kw)
    for name in ("a", "b"):
        eng.add_request([5, 6, 7], SamplingParams(max_tokens=6, ignore_eos=True), name)
    eng.step()
    evictions = eng.pool.evictions
    events, step, batch = [], eng.step, eng.prompt_logprobs_batch
    eng.step = lambda: events.append("step") or step()
    eng.prompt_logprobs_batch = lambda items: events.append([i[1] for i in items]) or batch(items)
    server, loop = AsyncEngine(eng, {n: "" for n in adapters}), asyncio.new_event_loop()
    futures = [loop.create_future() for _ in range(3)]
    for name, future in zip(("c", "a", None), futures, strict=True):
        server.send(("prompt_logprobs", prompt, name, 2, None, loop, future))
    got = _serve(server, loop, asyncio.gather(*futures))
    scored = [e for e in events if e != "step"]
    assert scored == [["a", None], ["c"]]
    assert events.index(["c"]) == len(events) - 1 and events.count("step") >= 5  # after the decodes
    assert eng.pool.evictions == evictions + 1
    assert [e[:2] for e in got[0][1:]] == [e[:2] for e in want[1:]]


def test_scoring_between_decode_steps_leaves_them_as_they_were():
    """Scoring rounds between the steps of decodes over 4 adapters on 2 slots (the scoring's forwards take slots
    the decodes' adapters held): the decodes' tokens and logprobs as an engine's that never scored, the scores
    (forwards of 16 tokens, one sequence over several) each sequence's own logits. On the GPU, under the decode
    graphs: test_gpu_engine.py's `test_scoring_beside_graphed_decodes`."""
    from tests.helpers.runs import scoring_beside_decodes

    model = build(tiny_hf_model("qwen3_moe", seed=4), max_loras=2, max_rank=8)
    adapters = {f"a{i}": random_adapter(model, 50 + i, 4 + i) for i in range(4)}

    def make(**kw):
        eng = engine(model, adapters, max_loras=2, **{"max_num_batched_tokens": BUDGET, **kw})
        eng.runner.logit_rows = LOGIT_ROWS
        return eng

    g = torch.Generator().manual_seed(6)
    ps = [torch.randint(3, 90, (n,), generator=g).tolist() for n in (5, 9, 3, 12, 7)]
    seqs = [torch.randint(3, 90, (n,), generator=g).tolist() for n in (6, 40, 2)]
    same, own = scoring_beside_decodes(make, ps, [None, "a0", "a1", "a2", "a3"], seqs, ["a3", None, "a1"], 10)
    assert same <= 1e-4 and own <= 1e-4
