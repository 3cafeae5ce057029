"""The OpenAI server on a tensor-parallel CPU engine (TP=2, gloo): concurrent mixed-adapter requests equal
their sequential answers, adapters load and unload at run time on every rank, and a killed worker turns
into 503s and a failing /health within a bounded time, with no process left."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest

from tests.helpers.server import (
    ADAPTERS,
    BASE,
    PROMPTS,
    TIMEOUT,
    complete,
    make_assets,
    make_client,
    post,
    running_server,
)

openai = pytest.importorskip("openai")

TP = dict(tensor_parallel_size=2, parallel_step_timeout_s=30, max_num_seqs=32)
MODELS = (BASE, *ADAPTERS)
N, TOKENS = 32, 6


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_assets(tmp_path_factory.mktemp("tp_server"))


def _requests():
    return [(MODELS[i % len(MODELS)], f"{PROMPTS[i % len(PROMPTS)]} #{i}" + "." * (i % 3)) for i in range(N)]


def test_tp2_server_concurrent_adapters_run_time_loads_and_a_killed_worker(assets):
    model_dir, adapters = assets
    with running_server(model_dir, {n: adapters[n] for n in ADAPTERS}, **TP) as (url, app):
        client = make_client(url)
        alone = {}
        for model, prompt in sorted(_requests()):
            c = complete(client, model, prompt, max_tokens=TOKENS).choices[0]
            alone[model, prompt] = c.text

        async def all_at_once():
            async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                                          timeout=TIMEOUT) as aclient:
                jobs = [aclient.completions.create(model=m, prompt=p, temperature=0, max_tokens=TOKENS)
                        for m, p in _requests()]
                return await asyncio.wait_for(asyncio.gather(*jobs), timeout=TIMEOUT)
        for (model, prompt), got in zip(_requests(), asyncio.run(all_at_once()), strict=True):
            assert got.choices[0].text == alone[model, prompt], (model, prompt)

        # run-time adapter on every rank: loaded, used, unloaded
        r = post(url, "/v1/load_lora_adapter", {"lora_name": "delta", "lora_path": str(adapters["delta"])})
        assert r.status_code == 200, r.text
        text = lambda model: complete(client, model, PROMPTS[0]).choices[0].text  # noqa: E731
        assert text("delta") != text(BASE)
        assert post(url, "/v1/unload_lora_adapter", {"lora_name": "delta"}).status_code == 200

        # a killed worker: errors, then 503 and a failing /health, within the step timeout
        procs = app.state.engine.engine.driver.procs  # the AsyncEngine's ParallelEngine
        pids = [p.pid for p in procs]
        os.kill(pids[0], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(openai.APIStatusError):
            complete(client, BASE, PROMPTS[0])
        assert httpx.get(url + "/health", timeout=TIMEOUT).status_code == 503
        with pytest.raises(openai.APIStatusError) as err:
            complete(client, BASE, PROMPTS[1])
        assert err.value.status_code == 503
        assert time.monotonic() - start < TP["parallel_step_timeout_s"]
    deadline = time.monotonic() + 15
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(p.is_alive() for p in procs)

