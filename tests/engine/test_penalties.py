"""Logit adjustments for sampling: penalties (presence / frequency, OpenAI; repetition, vLLM /
transformers), logit_bias (OpenAI) and min_tokens (vLLM): the batched device form against per-row
references, and the engine's greedy decode against recomputation."""

from __future__ import annotations

import pytest
import torch

from moelora.engine.request import SamplingParams
from moelora.engine.sampler import PenaltyState, adjust_logits, record_tokens
from moelora.errors import RequestError
from tests.helpers.models import engine
from tests.helpers.runs import (
    prompts,  # noqa: F401  (module fixture)
    reference_row,
)


def test_batched_penalties_equal_the_row_reference():
    g = torch.Generator().manual_seed(0)
    V = 50
    logits = torch.randn(4, V, generator=g) * 3
    cases = {0: ([1, 2, 3], [4, 4, 9], SamplingParams(frequency_penalty=0.7, presence_penalty=0.3)),
             2: ([5, 5, 6], [6, 7], SamplingParams(repetition_penalty=1.8)),
             3: ([8], [8, 9, 9, 9], SamplingParams(repetition_penalty=0.7, frequency_penalty=-0.5,
                                                    presence_penalty=1.5))}
    rows, states, params = [], [], []
    for i, (prompt, outputs, p) in cases.items():
        st = PenaltyState.new(prompt, V, logits.device)
        for tok in outputs:  # the engine's path: each sampled token recorded on the device
            record_tokens(torch.tensor([tok]), [0], [st])
        rows.append(i)
        states.append(st)
        params.append(p)
    got = adjust_logits(logits, rows, params, states, [()] * len(rows))
    assert torch.equal(got[1], logits[1])  # a row without penalties is untouched
    for i, (prompt, outputs, p) in cases.items():
        torch.testing.assert_close(got[i], reference_row(logits[i], prompt, outputs, p), rtol=0, atol=1e-6)
    assert not torch.equal(got[0], logits[0])


@pytest.mark.parametrize("bad", [dict(presence_penalty=2.5), dict(frequency_penalty=-3), dict(repetition_penalty=0)])
def test_out_of_range_penalties_are_refused(bad):
    with pytest.raises(RequestError, match=next(iter(bad))):
        SamplingParams(**bad)


def greedy_penalized_by_recompute(eng, prompt, name, n, p: SamplingParams) -> list[int]:
    outs: list[int] = []
    for _ in range(n):
        last = eng.prompt_logits([prompt + outs], [name])[0][-1].float()
        outs.append(int(reference_row(last, prompt, outs, p).argmax()))
    return outs


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_greedy_with_penalties_equals_recompute(setup, async_scheduling):  # noqa: F811
    model, adapters = setup
    eng = engine(model, adapters, async_scheduling=async_scheduling)
    ps = prompts(4, model.config.vocab_size, seed=11)
    names = ["x", None, "y", None]
    strong = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, frequency_penalty=1.5,
                            presence_penalty=0.5, repetition_penalty=1.3)
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    params = [strong, plain, strong, plain]
    reqs = [eng.add_request(q, pp, a) for q, pp, a in zip(ps, params, names, strict=True)]
    while eng.has_unfinished():
        eng.step()
    for r, q, a, pp in zip(reqs, ps, names, params, strict=True):
        want = greedy_penalized_by_recompute(eng, q, a, 12, pp)
        assert r.output_ids == want, (a, pp.penalized)
    # the penalties change what is generated (else this test could not fail)
    free = engine(model, adapters)
    unpenalized = free.add_request(ps[0], plain, names[0])
    while free.has_unfinished():
        free.step()
    assert unpenalized.output_ids != reqs[0].output_ids


def test_bias_and_min_tokens_suppression_come_before_penalties():
    g = torch.Generator().manual_seed(1)
    V = 40
    logits = torch.randn(3, V, generator=g) * 2
    p = SamplingParams(logit_bias={3: 5.0, "7": -2.5}, repetition_penalty=1.5, frequency_penalty=0.4)
    st = PenaltyState.new([3, 9], V, logits.device)
    for tok in (7, 7, 12):
        record_tokens(torch.tensor([tok]), [0], [st])
    got = adjust_logits(logits, [1, 2], [p, SamplingParams(min_tokens=2)], [st, None], [(), (4, 39)])
    want = logits[1].clone()
    want[3] += 5.0
    want[7] -= 2.5
    want = reference_row(want, [3, 9], [7, 7, 12], p)
    torch.testing.assert_close(got[1], want, rtol=0, atol=1e-6)
    assert torch.equal(got[0], logits[0])
    assert got[2, 4] == float("-inf") and got[2, 39] == float("-inf")
    keep = torch.ones(V, dtype=torch.bool)
    keep[[4, 39]] = False
    assert torch.equal(got[2][keep], logits[2][keep])


def test_logit_bias_and_min_tokens_validation(setup):  # noqa: F811
    model, adapters = setup
    with pytest.raises(RequestError, match="logit_bias"):
        SamplingParams(logit_bias={5: 101})
    with pytest.raises(RequestError, match="logit_bias"):
        SamplingParams(logit_bias={"five": 1})
    with pytest.raises(RequestError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    eng = engine(model, adapters)
    with pytest.raises(RequestError, match="outside the vocabulary"):
        eng.add_request([5, 6], SamplingParams(logit_bias={model.config.vocab_size: 1.0}), None)


def test_engine_logit_bias_forces_and_bans_tokens(setup):  # noqa: F811
    model, adapters = setup
    p = prompts(1, model.config.vocab_size, seed=13)[0]
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    eng = engine(model, adapters)

    def run(params):
        req = eng.add_request(p, params, "x")
        while eng.has_unfinished():
            eng.step()
        return req.output_ids

    free = run(greedy)
    assert run(SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logit_bias={11: 100})) == [11] * 6
    banned = run(SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logit_bias={free[0]: -100}))
    assert free[0] not in banned and banned != free


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_min_tokens_holds_back_stop_tokens(setup, async_scheduling):  # noqa: F811
    model, adapters = setup
    eng = engine(model, adapters, async_scheduling=async_scheduling)
    p = prompts(1, model.config.vocab_size, seed=17)[0]
    free = eng.add_request(p, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True), None)
    while eng.has_unfinished():
        eng.step()
    stop = free.output_ids[1]
    early = eng.add_request(p, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True,
                                              stop_token_ids=(stop,)), None)
    held = eng.add_request(p, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, stop_token_ids=(stop,),
                                             min_tokens=4), None)
    while eng.has_unfinished():
        eng.step()
    assert early.output_ids == free.output_ids[:free.output_ids.index(stop) + 1]  # ends with the stop token
    # reference: greedy with the stop token masked for the first 4 draws, then stopping on it
    want: list[int] = []
    while len(want) < 10:
        last = eng.prompt_logits([p + want], [None])[0][-1].float().clone()
        if len(want) < 4:
            last[stop] = float("-inf")
        tok = int(last.argmax())
        want.append(tok)
        if tok == stop:
            break
    assert held.output_ids == want and len(want) >= 5
    assert held.finish_reason == ("stop" if want[-1] == stop else "length")


class _LetterTokenizer:
    """One letter per token id (id % 26): text positions are token positions."""

    eos_token_id = None

    def decode(self, ids):
        return "".join(chr(97 + i % 26) for i in ids)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_min_tokens_defers_stop_strings(setup, async_scheduling):  # noqa: F811
    """A stop string that ends within the first min_tokens outputs does not stop the request; the next
    one after them does (vLLM's rule)."""
    model, adapters = setup
    eng = engine(model, adapters, async_scheduling=async_scheduling)
    eng.tokenizer = _LetterTokenizer()
    p = prompts(1, model.config.vocab_size, seed=23)[0]
    free = eng.add_request(p, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), None)
    while eng.has_unfinished():
        eng.step()
    full = free.text
    stop = next(ch for ch in full[1:] if full.count(ch) >= 2)
    first = full.index(stop)
    second = full.index(stop, first + 1)
    reqs = [eng.add_request(p, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=(stop,), **kw), None)
            for kw in ({}, {"min_tokens": first + 1})]
    while eng.has_unfinished():
        eng.step()
    assert (reqs[0].text, reqs[0].finish_reason) == (full[:first], "stop")
    assert (reqs[1].text, reqs[1].finish_reason) == (full[:second], "stop")
