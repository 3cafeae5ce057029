"""Loglikelihood scoring as evaluation harnesses do it, through the real server on the bundled demo.

A harness sends context + continuation with `echo: true, logprobs: 1, max_tokens: 1`, drops the LAST
logprob entry (the generated token) and sums the continuation's entries. The demo answers each line
exactly and then ends its turn, so after the right continuation its next token is `<|im_end|>`, the
EOS: the entry a server must return (text "", counted in completion_tokens) for the harness to drop
it and not the continuation's last token. The two choices differ only in their last letter, so
without that entry they would tie.
"""

from __future__ import annotations

import pytest

from moelora import demo
from moelora.demo import tasks
from moelora.engine.config import EngineConfig
from tests.helpers.server import make_client, post, serving

BASE = "moelora-demo"


@pytest.fixture(scope="module")
def url():
    from moelora.server.launch import build_server

    if not (demo.model_dir() / "model.safetensors").is_file():
        pytest.skip("the bundled demo model is not built yet")
    cfg = EngineConfig(device="cpu", dtype="float32", max_loras=3, max_lora_rank=16, max_num_seqs=8,
                       num_kv_blocks=256, block_size=16)
    app = build_server(demo.model_dir(), {n: str(demo.adapter_dir(n)) for n in demo.ADAPTER_NAMES}, cfg, [BASE])
    with serving(app) as u:
        yield u


def last_letter_changed(answer: str) -> str:
    last = answer[-1]
    base = ord("a") if last.islower() else ord("A")
    return answer[:-1] + chr((ord(last) - base + 1) % 26 + base)


def loglikelihood(client, url, model: str, context: str, continuation: str) -> tuple[float, float, object]:
    """(the harness's score, the score it would get if the server gave no entry for the generated EOS,
    the choice): lm-eval's `token_logprobs[ctxlen:-1]`, its context length from the server's tokenizer."""
    ctxlen = post(url, "/tokenize", {"model": model, "prompt": context}).json()["count"]
    choice = client.completions.create(model=model, prompt=context + continuation, echo=True, logprobs=1,
                                       max_tokens=1, temperature=0).choices[0]
    entries = choice.logprobs.token_logprobs
    return sum(entries[ctxlen:-1]), sum(entries[ctxlen:-2]), choice


@pytest.mark.parametrize("model,task", [(BASE, "copy"), *((n, n) for n in demo.ADAPTER_NAMES)])
def test_two_choices_differing_in_the_last_letter_score_right(url, model, task):
    client = make_client(url)
    right = 0
    inputs = tasks.heldout_inputs(6, seed=31)
    for text in inputs:
        context, answer = tasks.user_prompt(text), tasks.transform(task, text)
        good, good_without_eos, choice = loglikelihood(client, url, model, context, answer)
        bad, bad_without_eos, _ = loglikelihood(client, url, model, context, last_letter_changed(answer))
        # the case that failed: the model's next token is the EOS, returned as a generated token
        assert choice.logprobs.tokens[-1] == "" and choice.finish_reason == "stop" and choice.text == context + answer
        assert good_without_eos == bad_without_eos  # dropping the continuation's last token instead: a tie
        right += good > bad
    assert right == len(inputs), (model, right)
