"""The OpenAI-compatible server, end to end: a real uvicorn on a free loopback port, driven by the
official `openai` client (and raw httpx where a client would not send such a request).

The model is a tiny random Qwen3-MoE saved with `save_pretrained`, a byte-level tokenizer and a
chat template built here, and per-expert PEFT adapters written by `oracle_lora`; the engine runs
on the CPU with 2 adapter slots and a CPU cache of 2 adapters, so serving four adapters exercises
slot evictions and reloads from disk.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.helpers.server import (
    ADAPTERS,
    BASE,
    GREEDY,
    PROMPTS,
    TIMEOUT,
    complete,
    make_assets,
    make_client,
    metric,
    metrics,
    post,
    running_server,
    streamed_text,
    wait_idle,
)

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")


# ------------------------------------------------------------------------------------ fixtures


# server/test_errors.py has the same three fixtures (one server per module)
@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_assets(tmp_path_factory.mktemp("server"))


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "overlapped"])
def server(assets, request):
    """Every route test against both step modes: the CPU engine's default (synchronous) and the CUDA
    engine's (overlapped scheduling: a step's tokens read back after the next step is launched)."""
    model_dir, adapters = assets
    with running_server(model_dir, {n: adapters[n] for n in ADAPTERS}, async_scheduling=request.param) as (url, app):
        yield url, app


@pytest.fixture(scope="module")
def client(server):
    return make_client(server[0])


# ---------------------------------------------------------------------------------- happy paths


def test_health_and_models(server, client, assets):
    url, _ = server
    assert httpx.get(url + "/health", timeout=TIMEOUT).status_code == 200
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards) == [BASE, *ADAPTERS]
    assert cards[BASE].parent is None and cards[BASE].root == str(assets[0])
    for name in ADAPTERS:
        assert cards[name].parent == BASE and cards[name].root == str(assets[1][name])


def test_completions_every_adapter_stream_equals_whole(client):
    outs = {}
    for model in (BASE, *ADAPTERS):
        whole = complete(client, model, PROMPTS[0])
        choice = whole.choices[0]
        assert choice.finish_reason in ("stop", "length") and whole.model == model
        assert whole.usage.prompt_tokens == len(PROMPTS[0].encode())
        assert 0 < whole.usage.completion_tokens <= GREEDY["max_tokens"] or choice.finish_reason == "stop"
        texts, reasons, usage = streamed_text(complete(client, model, PROMPTS[0], stream=True,
                                                       stream_options={"include_usage": True}))
        assert texts == {0: choice.text} and reasons == {0: choice.finish_reason}
        assert usage.completion_tokens == whole.usage.completion_tokens
        outs[model] = choice.text
    assert len(set(outs.values())) == len(outs), f"adapters should change the output: {outs}"


def test_chat_whole_stream_and_logprobs(client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    whole = client.chat.completions.create(model="beta", messages=messages, logprobs=True, top_logprobs=3, **GREEDY)
    choice = whole.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    content = choice.logprobs.content
    assert len(content) == whole.usage.completion_tokens
    for entry in content:  # greedy: the chosen token is the most likely one
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
    chunks = list(client.chat.completions.create(model="beta", messages=messages, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens
    texts, reasons, _ = streamed_text(iter(chunks))
    assert texts == {0: choice.message.content} and reasons == {0: choice.finish_reason}


def test_tokenize_and_detokenize_agree_with_the_generation_routes(server, client):
    url, _ = server
    prompt = "hello, moe lora"
    got = post(url, "/tokenize", {"model": "alpha", "prompt": prompt}).json()
    usage = complete(client, BASE, prompt, max_tokens=1).usage
    assert got["count"] == len(got["tokens"]) == usage.prompt_tokens and got["max_model_len"] > got["count"]
    assert post(url, "/detokenize", {"tokens": got["tokens"]}).json() == {"prompt": prompt}
    messages = [{"role": "user", "content": "hi there"}]
    chat = post(url, "/tokenize", {"messages": messages}).json()
    chat_usage = client.chat.completions.create(model=BASE, messages=messages, max_tokens=1).usage
    assert chat["count"] == chat_usage.prompt_tokens
    for body, status, param in (({"prompt": "a", "messages": messages}, 400, "prompt"), ({}, 400, "prompt"),
                                ({"model": "nope", "prompt": "a"}, 404, "model")):
        r = post(url, "/tokenize", body)
        assert r.status_code == status and r.json()["error"]["param"] == param, r.text
    r = post(url, "/detokenize", {"tokens": [1, 10 ** 6]})
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]
    assert post(url, "/detokenize", {"tokens": [-1]}).status_code == 400


def test_n_seed_top_k_top_p_and_completion_logprobs(client):
    kw = dict(n=3, temperature=1.0, top_p=0.9, seed=7, max_tokens=8, extra_body={"top_k": 50})
    first = complete(client, "alpha", PROMPTS[1], **kw)
    again = complete(client, "alpha", PROMPTS[1], **kw)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert len({c.text for c in first.choices}) > 1
    lp = complete(client, BASE, [PROMPTS[2], PROMPTS[3]], logprobs=2).choices
    assert len(lp) == 2
    for c in lp:
        assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) == len(c.logprobs.top_logprobs)
        assert all(len(top) <= 2 for top in c.logprobs.top_logprobs)
        assert c.logprobs.text_offset[0] == 0


def test_penalties_logit_bias_and_min_tokens_reach_the_engine(client):
    free = complete(client, BASE, PROMPTS[5], logprobs=0, extra_body={"ignore_eos": True}).choices[0]
    forced = complete(client, BASE, PROMPTS[5], logprobs=0, logit_bias={"5": 100},
                      extra_body={"ignore_eos": True}).choices[0]
    assert len(set(forced.logprobs.tokens)) == 1 and forced.text != free.text  # token 5, every step
    penalized = complete(client, BASE, PROMPTS[5], frequency_penalty=2.0, presence_penalty=2.0,
                         extra_body={"ignore_eos": True, "repetition_penalty": 1.5, "min_tokens": 3}).choices[0]
    assert penalized.text != free.text


def test_echo_with_prompt_logprobs_as_eval_harnesses_use_it(client, assets):
    """lm-eval style loglikelihood: echo=True, logprobs, max_tokens 0; the prompt's token logprobs
    must equal the model's (checked against an independent LLM on the same checkpoint)."""
    from moelora import LLM

    prompt = "the cat sat on the mat"
    c = client.completions.create(model=BASE, prompt=prompt, max_tokens=0, echo=True, logprobs=2).choices[0]
    lp = c.logprobs
    assert c.text == prompt and c.finish_reason == "length"
    assert "".join(lp.tokens) == prompt and lp.text_offset[3] == 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ids = [ord(t) for t in lp.tokens]  # the test tokenizer: one token per ASCII byte
    want = LLM(assets[0], device="cpu", dtype="float32").logits([ids], adapter=[None])[0].log_softmax(-1)
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(want[i - 1, ids[i]].item(), abs=1e-4)
        # the top 2 and the prompt token itself (vLLM adds it), keyed by token text: two bytes may both read "\ufffd"
        assert 1 <= len(lp.top_logprobs[i]) <= 3
        assert lp.top_logprobs[i][lp.tokens[i]] == pytest.approx(lp.token_logprobs[i])
        assert max(lp.top_logprobs[i].values()) == pytest.approx(want[i - 1].max().item(), abs=1e-4)
    kw = dict(max_tokens=3, extra_body={"ignore_eos": True})
    plain = complete(client, BASE, prompt, **kw).choices[0].text
    assert complete(client, BASE, prompt, echo=True, **kw).choices[0].text == prompt + plain
    chunks = list(client.completions.create(model=BASE, prompt=prompt, echo=True, stream=True, **{**GREEDY, **kw}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == prompt + plain
    zero = list(client.completions.create(model=BASE, prompt=prompt, echo=True, stream=True, max_tokens=0))
    assert [ch.choices[0].text for ch in zero] == [prompt] and zero[0].choices[0].finish_reason == "length"


def test_stop_strings_whole_and_streamed(client):
    full = complete(client, "gamma", PROMPTS[4], max_tokens=20, extra_body={"ignore_eos": True}).choices[0].text
    i = next(i for i, ch in enumerate(full) if i > 0 and ch != "\ufffd")
    stop = full[i]
    expected = full[:full.index(stop)]
    whole = complete(client, "gamma", PROMPTS[4], max_tokens=20, stop=[stop], extra_body={"ignore_eos": True})
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == (expected, "stop")
    texts, reasons, _ = streamed_text(complete(client, "gamma", PROMPTS[4], max_tokens=20, stop=stop, stream=True,
                                               extra_body={"ignore_eos": True}))
    assert texts == {0: expected} and reasons == {0: "stop"}


# ---------------------------------------------------------------------------- adapters at run time


def test_load_use_unload_at_run_time(server, client, assets):
    url, _ = server
    path = str(assets[1]["delta"])
    r = post(url, "/v1/load_lora_adapter", {"lora_name": "delta", "lora_path": path})
    assert r.status_code == 200, r.text
    assert [m.id for m in client.models.list().data] == [BASE, *ADAPTERS, "delta"]
    assert complete(client, "delta", PROMPTS[0]).choices[0].text != complete(client, BASE, PROMPTS[0]).choices[0].text
    again = post(url, "/v1/load_lora_adapter", {"lora_name": "delta", "lora_path": path})
    assert again.status_code == 400 and "already" in again.json()["error"]["message"]
    clash = post(url, "/v1/load_lora_adapter", {"lora_name": BASE, "lora_path": path})
    assert clash.status_code == 400 and clash.json()["error"]["param"] == "lora_name"
    assert post(url, "/v1/unload_lora_adapter", {"lora_name": "delta"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        complete(client, "delta", PROMPTS[0])
    gone = post(url, "/v1/unload_lora_adapter", {"lora_name": "delta"})
    assert gone.status_code == 404 and gone.json()["error"]["type"] == "NotFoundError"
    assert [m.id for m in client.models.list().data] == [BASE, *ADAPTERS]


def test_reloading_a_name_with_other_weights_does_not_reuse_its_cached_kv(server, client, assets):
    url, _ = server
    paths = assets[1]
    prompt = PROMPTS[0] + " and a longer prompt that fills many KV blocks"
    load = lambda name, path: post(url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
    assert load("delta", paths["delta"]).status_code == 200
    old = complete(client, "delta", prompt).choices[0].text  # its full prompt blocks are now cached
    assert post(url, "/v1/unload_lora_adapter", {"lora_name": "delta"}).status_code == 200
    assert load("delta", paths["alpha"]).status_code == 200  # the same name, other weights
    try:
        assert complete(client, "delta", prompt).choices[0].text == complete(client, "alpha", prompt).choices[0].text
        assert old != complete(client, "alpha", prompt).choices[0].text
    finally:
        assert post(url, "/v1/unload_lora_adapter", {"lora_name": "delta"}).status_code == 200


# ------------------------------------------------------------------------ load and disconnects

MODELS = (BASE, *ADAPTERS)
LOAD_N, LOAD_TOKENS = 64, 8


def load_requests() -> list[tuple[str, str]]:
    """(model, prompt) of every concurrent request: all models, distinct prompts of various lengths."""
    return [(MODELS[i % len(MODELS)], f"{PROMPTS[i % len(PROMPTS)]} #{i}" + "." * (i % 5)) for i in range(LOAD_N)]


def test_64_concurrent_streams_equal_each_request_alone(server, client):
    url, app = server
    alone = {}
    for model, prompt in sorted(load_requests()):  # one model after another: fewer adapter swaps
        c = complete(client, model, prompt, max_tokens=LOAD_TOKENS).choices[0]
        alone[model, prompt] = (c.text, c.finish_reason)

    async def one(aclient, model, prompt):
        stream = await aclient.completions.create(model=model, prompt=prompt, stream=True, temperature=0,
                                                  max_tokens=LOAD_TOKENS)
        text, reason = "", None
        async for chunk in stream:
            for c in chunk.choices:
                text += c.text
                reason = c.finish_reason or reason
        return text, reason

    async def all_at_once():
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                                      timeout=TIMEOUT) as aclient:
            jobs = [one(aclient, m, p) for m, p in load_requests()]
            return await asyncio.wait_for(asyncio.gather(*jobs), timeout=TIMEOUT)

    start = time.monotonic()
    results = asyncio.run(all_at_once())
    elapsed = time.monotonic() - start
    print(f"64 concurrent streams: {elapsed:.2f}s")
    for (model, prompt), got in zip(load_requests(), results, strict=True):
        assert got[1] in ("stop", "length"), (model, prompt, got)
        assert got == alone[model, prompt], (model, prompt)
    assert elapsed < TIMEOUT
    wait_idle(app)


def _sse_lines(response, count):
    lines = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            lines.append(line)
            if len(lines) == count:
                return lines
    return lines


def test_client_disconnect_mid_stream_aborts_and_frees_blocks(server):
    url, app = server
    aborted = metric(metrics(url), "moelora:requests_total", model="gamma", outcome="abort")
    body = {"model": "gamma", "prompt": PROMPTS[3], "max_tokens": 240, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=TIMEOUT) as http, http.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert len(_sse_lines(r, 3)) == 3
        assert app.state.engine.stats.kv_used > 0
    # the connection is closed here, long before 240 tokens
    wait_idle(app)
    assert metric(metrics(url), "moelora:requests_total", model="gamma", outcome="abort") == aborted + 1


def test_client_disconnect_while_waiting_for_whole_response_aborts(server):
    """A client that gives up on a whole (non-streamed) response: its request is aborted, and the server records no
    error of its own (the handler once read the cancelled task's result before the cancellation had run: a 500)."""
    url, app = server
    before = metrics(url)
    aborted = metric(before, "moelora:requests_total", model=BASE, outcome="abort")
    errors = metric(before, "moelora:request_errors_total", status="500")
    body = {"model": BASE, "prompt": PROMPTS[2], "max_tokens": 240, "ignore_eos": True, "n": 4}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json=body, timeout=httpx.Timeout(TIMEOUT, read=0.3))
    wait_idle(app)
    after = metrics(url)
    assert metric(after, "moelora:requests_total", model=BASE, outcome="abort") == aborted + 4
    assert metric(after, "moelora:request_errors_total", status="500") == errors


# ---------------------------------------------------------------------------------------- metrics


def test_metrics_are_scraped_and_parsed(server, client):
    url, _ = server
    for model in MODELS:
        complete(client, model, PROMPTS[0], max_tokens=3)
    for status, bad in ((400, {"max_tokens": 0}), (404, {"model": "nope"})):
        assert post(url, "/v1/completions", {"model": BASE, "prompt": "hi", **bad}).status_code == status
    m = metrics(url)
    for model in MODELS:
        assert metric(m, "moelora:requests_total", model=model) > 0, model
        assert metric(m, "moelora:prompt_tokens_total", model=model) > 0
        assert metric(m, "moelora:generation_tokens_total", model=model) > 0
        assert metric(m, "moelora:time_to_first_token_seconds_count", model=model) > 0
        assert metric(m, "moelora:inter_token_latency_seconds_count", model=model) > 0
        assert metric(m, "moelora:e2e_request_latency_seconds_count", model=model) > 0
    assert metric(m, "moelora:requests_total", outcome="length") > 0
    assert metric(m, "moelora:request_errors_total", status="400") > 0
    assert metric(m, "moelora:request_errors_total", status="404") > 0
    assert metric(m, "moelora:num_requests_waiting") == metric(m, "moelora:num_requests_running") == 0
    assert metric(m, "moelora:kv_cache_usage_perc") == 0 and metric(m, "moelora:kv_cache_blocks_total") == 2048
    assert 0 < metric(m, "moelora:lora_slots_in_use") <= metric(m, "moelora:lora_slots_total") == 2
    assert metric(m, "moelora:lora_adapters_registered") == len(ADAPTERS)
    assert metric(m, "moelora:lora_evictions_total") > 0  # 3 adapters took turns in 2 slots
    assert metric(m, "moelora:lora_loads_total") > 0  # and in a CPU cache of 2
