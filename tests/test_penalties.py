"""Sampling penalties (presence / frequency, OpenAI; repetition, vLLM / transformers): the batched
device form against per-row references, and the engine's greedy decode against recomputation."""

from __future__ import annotations

import pytest
import torch
from test_engine import prompts, setup  # noqa: F401  (module fixture)
from test_forward import engine

from moelora.engine.request import SamplingParams
from moelora.engine.sampler import PenaltyState, apply_penalties, record_tokens
from moelora.errors import RequestError


def reference_row(logits: torch.Tensor, prompt: list[int], outputs: list[int], p: SamplingParams) -> torch.Tensor:
    """One row, written out: repetition on prompt + outputs (transformers' processor), then the
    OpenAI frequency / presence terms on the outputs."""
    from transformers import RepetitionPenaltyLogitsProcessor

    row = logits.clone()
    seen = prompt + outputs
    if seen:
        row = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(torch.tensor([seen]), row[None])[0]
    for tok in set(outputs):
        row[tok] -= p.frequency_penalty * outputs.count(tok) + p.presence_penalty
    return row


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
    got = apply_penalties(logits, rows, states, params)
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
