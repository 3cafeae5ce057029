"""vLLM's output rules in the engine: the EOS / stop token that ends a request is an output token (with
its logprob and rank) and `stop_reason` names it; min_p filters sampling per row, after temperature."""

from __future__ import annotations

import pytest
import torch

from moelora.engine.request import SamplingParams
from moelora.engine.sampler import sample
from moelora.errors import RequestError
from tests.helpers.models import engine
from tests.helpers.runs import prompts  # noqa: F401  (module fixture)

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]


@pytest.mark.parametrize("device", DEVICES)
def test_min_p_drops_tokens_below_its_share_of_the_top_probability_per_row(device):
    row = torch.tensor([0.0, -0.1, -0.2, -2.0, -3.0, -3.5, -4.0, -5.0], device=device)
    logits = row.repeat(3, 1)
    params = [SamplingParams(min_p=0.5), SamplingParams(), SamplingParams(min_p=0.5, temperature=10.0)]
    seen: list[set[int]] = [set(), set(), set()]
    for seed in range(600):
        gens = [torch.Generator(device).manual_seed(seed * 3 + i) for i in range(3)]
        for i, t in enumerate(sample(logits, params, gens).tolist()):
            seen[i].add(t)
    # p / p_max = exp(logit): kept at >= 0.5, i.e. logit >= ln 0.5 = -0.69 (at temperature 10: logit >= -6.9)
    assert seen[0] == {0, 1, 2}
    assert seen[1] - {0, 1, 2}, "without min_p the unlikely tokens are drawn too"
    assert seen[2] - {0, 1, 2, 3}, "min_p applies to the tempered distribution"
    greedy = sample(logits[:1], [SamplingParams(min_p=1.0)], [torch.Generator(device).manual_seed(1)])
    assert greedy.tolist() == [0]  # min_p 1 keeps only the most likely token
    with pytest.raises(RequestError, match="min_p"):
        SamplingParams(min_p=1.5)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_stop_token_is_the_last_output_token_with_its_logprob(setup, async_scheduling):  # noqa: F811
    model, adapters = setup
    eng = engine(model, adapters, async_scheduling=async_scheduling)
    p = prompts(1, model.config.vocab_size, seed=41)[0]
    free = eng.add_request(p, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1), "x")
    while eng.has_unfinished():
        eng.step()
    stop = free.output_ids[2]
    first = free.output_ids.index(stop)
    req = eng.add_request(p, SamplingParams(max_tokens=8, temperature=0, stop_token_ids=(stop,), logprobs=1), "x")
    while eng.has_unfinished():
        eng.step()
    assert req.output_ids == free.output_ids[:first + 1]
    assert (req.finish_reason, req.stop_reason) == ("stop", stop)
    assert len(req.logprobs) == len(req.output_ids)
    assert req.logprobs == free.logprobs[:first + 1]  # the stop token's entry too: (logprob, rank 1, top)
    assert req.logprobs[-1][1] == 1 and req.logprobs[-1][2][0][0] == stop
    assert (free.finish_reason, free.stop_reason) == ("length", None)
    assert eng.cache.allocator.num_used == 0
