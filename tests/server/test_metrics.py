"""/metrics under vLLM's names after real traffic: every series a vLLM dashboard, router or the Gateway API
Inference Extension reads, with vLLM's labels and buckets, and values that add up to the traffic sent.

One server (test_server.py's model and adapters) with a KV cache small enough that four long requests at
once preempt, prefix caching on, two adapter slots; requests go over raw httpx (the byte tokenizer makes
a prompt's token count its byte count).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from moelora.server.metrics import ITL_BUCKETS, REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS
from tests.helpers.server import ADAPTERS, BASE, TIMEOUT, make_assets, post, running_server, wait_idle

LABELS = {"model_name": BASE, "engine": "0"}
GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "gpu_cache_usage_perc")
COUNTERS = ("prompt_tokens", "generation_tokens", "num_preemptions", "prefix_cache_queries", "prefix_cache_hits")
HISTOGRAMS = ("request_prompt_tokens", "request_generation_tokens", "request_params_n", "request_params_max_tokens",
              "time_to_first_token_seconds", "inter_token_latency_seconds", "time_per_output_token_seconds",
              "request_time_per_output_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
              "request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds",
              "iteration_tokens_total")
PHASES = ("e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
          "request_decode_time_seconds", "request_inference_time_seconds")


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "overlapped"])
def server(tmp_path_factory, request):
    model_dir, adapters = make_assets(tmp_path_factory.mktemp("server_metrics"))
    # 40 blocks of 4 tokens: one request of max_model_len (32 blocks) fits, four of 70 tokens at once do not
    with running_server(model_dir, {n: adapters[n] for n in ADAPTERS}, num_kv_blocks=40, max_model_len=128,
                        async_scheduling=request.param) as (url, app):
        yield url, app


def scrape(url) -> dict:
    """{family name: family} of /metrics, parsed by prometheus_client's own parser."""
    text = httpx.get(url + "/metrics", timeout=TIMEOUT).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(fams: dict, family: str, sample: str | None = None, **labels) -> float:
    found = [s.value for s in fams[family].samples
             if s.name == (sample or family) and labels.items() <= s.labels.items()]
    assert found, (family, sample, labels)
    return sum(found)


def complete(url, model, prompt, max_tokens, **kw) -> dict:
    r = post(url, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                      "ignore_eos": True, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def test_vllm_series_add_up_to_the_traffic(server):
    url, app = server
    shared = "a shared prefix of forty bytes, or so..."  # 10 full blocks: the second request reuses them
    jobs = [(BASE, shared, 5, 1), (BASE, shared + "!", 5, 1), ("alpha", "hello", 6, 1), ("beta", "world", 7, 2),
            (BASE, ["two", "prompts"], 3, 2)]
    jobs += [(m, f"long request {i}", 70, 1) for i, m in enumerate((BASE, "alpha", "beta", BASE))]  # 4 x 19 blocks
    expect = dict(requests=0, prompt=0, generated=0, max_tokens=0, prompts=0, choices=0)
    with ThreadPoolExecutor(4) as pool:
        first = [complete(url, *job[:3], n=job[3]) for job in jobs[:2]]  # in order: the second hits the cache
        rest = list(pool.map(lambda job: complete(url, *job[:3], n=job[3]), jobs[2:]))
    for (_, prompt, max_tokens, n), body in zip(jobs, first + rest, strict=True):
        prompts = [prompt] if isinstance(prompt, str) else prompt
        expect["requests"] += len(prompts) * n
        expect["prompt"] += sum(len(p.encode()) for p in prompts) * n
        expect["generated"] += body["usage"]["completion_tokens"]
        expect["max_tokens"] += max_tokens * len(prompts) * n
        expect["prompts"] += len(prompts)
        expect["choices"] += len(prompts) * n
    assert expect["generated"] == sum(j[2] * j[3] * (1 if isinstance(j[1], str) else 2) for j in jobs)
    wait_idle(app)
    m = scrape(url)

    for name in GAUGES + COUNTERS + HISTOGRAMS + ("request_success",):
        fam = m[f"vllm:{name}"]
        assert fam.samples and all(s.labels.items() >= LABELS.items() for s in fam.samples), name
    assert {s.labels["finished_reason"] for s in m["vllm:request_success"].samples
            if s.name.endswith("_total")} == {"stop", "length", "abort", "error"}
    success = value(m, "vllm:request_success", "vllm:request_success_total", finished_reason="length")
    assert success == expect["requests"]
    assert value(m, "vllm:prompt_tokens", "vllm:prompt_tokens_total") == expect["prompt"]
    assert value(m, "vllm:generation_tokens", "vllm:generation_tokens_total") == expect["generated"]
    for name, count, total in (("request_prompt_tokens", expect["requests"], expect["prompt"]),
                               ("request_generation_tokens", expect["requests"], expect["generated"]),
                               ("request_params_max_tokens", expect["requests"], expect["max_tokens"]),
                               ("request_params_n", expect["prompts"], expect["choices"]),
                               ("time_to_first_token_seconds", expect["requests"], None),
                               ("inter_token_latency_seconds", expect["generated"] - expect["requests"], None),
                               *((phase, expect["requests"], None) for phase in PHASES)):
        assert value(m, f"vllm:{name}", f"vllm:{name}_count") == count, name
        if total is not None:
            assert value(m, f"vllm:{name}", f"vllm:{name}_sum") == total, name
    # every token but each request's last is computed once (a preempted one again, less what the cache keeps)
    computed = value(m, "vllm:iteration_tokens_total", "vllm:iteration_tokens_total_sum")
    cached = value(m, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total")
    assert computed >= expect["prompt"] + expect["generated"] - expect["requests"] - cached
    assert value(m, "vllm:iteration_tokens_total", "vllm:iteration_tokens_total_count") >= max(
        j[2] for j in jobs)  # at least one step a token of the longest
    sums = {p: value(m, f"vllm:{p}", f"vllm:{p}_sum") for p in PHASES}
    assert all(v > 0 for k, v in sums.items() if k != "request_queue_time_seconds"), sums
    # per request: e2e = queue + inference, inference = prefill + decode
    assert sums["e2e_request_latency_seconds"] == pytest.approx(
        sums["request_queue_time_seconds"] + sums["request_inference_time_seconds"], rel=1e-6, abs=1e-6)
    assert sums["request_inference_time_seconds"] == pytest.approx(
        sums["request_prefill_time_seconds"] + sums["request_decode_time_seconds"], rel=1e-6, abs=1e-6)
    buckets = lambda name: sorted(float(s.labels["le"]) for s in m[f"vllm:{name}"].samples  # noqa: E731
                                  if s.name.endswith("_bucket") and s.labels["le"] != "+Inf")
    assert buckets("time_to_first_token_seconds") == list(TTFT_BUCKETS)
    assert buckets("inter_token_latency_seconds") == list(ITL_BUCKETS)
    assert buckets("e2e_request_latency_seconds") == list(REQUEST_LATENCY_BUCKETS)
    assert buckets("request_prompt_tokens") == [1, 2, 5, 10, 20, 50, 100]  # up to max_model_len 128

    assert value(m, "vllm:num_preemptions", "vllm:num_preemptions_total") > 0  # 4 x 19 blocks in 40
    hits = value(m, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total")
    assert 40 <= hits <= value(m, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total")
    assert hits % 4 == 0  # whole blocks
    for gauge in GAUGES:
        assert value(m, f"vllm:{gauge}") == 0, gauge
    info = m["vllm:cache_config_info"].samples
    assert len(info) == 1 and info[0].value == 1
    assert {k: info[0].labels[k] for k in ("block_size", "enable_prefix_caching", "num_gpu_blocks", "engine")} == {
        "block_size": "4", "enable_prefix_caching": "True", "num_gpu_blocks": "40", "engine": "0"}
    # moelora's per-adapter and slot series beside them
    assert value(m, "moelora:requests", "moelora:requests_total", model="beta") == 3  # n=2, and a long one
    assert value(m, "moelora:lora_slots_total") == 2 and value(m, "moelora:lora_adapters_registered") == 3


def lora_info(url) -> tuple[dict, float]:
    (sample,) = scrape(url)["vllm:lora_requests_info"].samples
    return sample.labels, sample.value


def test_lora_requests_info_follows_the_running_adapters_and_aborts_count(server):
    url, app = server
    labels, stamp = lora_info(url)
    assert labels == {"max_lora": "2", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert abs(stamp - time.time()) < 3600  # a Unix timestamp: the Gateway API takes the newest
    aborted = value(scrape(url), "vllm:request_success", "vllm:request_success_total", finished_reason="abort")
    body = {"model": "gamma", "prompt": "keep going", "max_tokens": 110, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=TIMEOUT) as http, http.stream("POST", url + "/v1/completions", json=body) as r:
        lines = (line for line in r.iter_lines() if line.startswith("data: "))
        next(lines), next(lines)  # running: tokens are coming
        labels, later = lora_info(url)
        assert labels["running_lora_adapters"] == "gamma" and labels["max_lora"] == "2"
        assert later >= stamp
    wait_idle(app)  # closing the stream aborted it
    m = scrape(url)
    assert value(m, "vllm:request_success", "vllm:request_success_total", finished_reason="abort") == aborted + 1
    assert lora_info(url)[0]["running_lora_adapters"] == ""


def test_scoring_only_requests_count_as_finished_requests_and_scored_generations_once(server):
    """lm-eval's loglikelihood requests (echo + logprobs, max_tokens 0) generate nothing: each choice of each
    prompt counts as one finished request of `length` with its prompt tokens, as vLLM counts them; a request that
    scores its prompt and then generates counts once, by its generation."""
    url, app = server
    wait_idle(app)
    sample = (("vllm:request_success", "vllm:request_success_total", {"finished_reason": "length"}),
              ("vllm:prompt_tokens", "vllm:prompt_tokens_total", {}),
              ("vllm:generation_tokens", "vllm:generation_tokens_total", {}),
              *((f"vllm:{n}", f"vllm:{n}_{s}", {}) for n in ("request_prompt_tokens", "request_generation_tokens",
                                                               "request_params_n", "e2e_request_latency_seconds",
                                                               "time_to_first_token_seconds")
                for s in ("count", "sum")),
              ("moelora:requests", "moelora:requests_total", {"model": "alpha", "outcome": "length"}),
              ("moelora:prompt_tokens", "moelora:prompt_tokens_total", {"model": "alpha"}))

    def read() -> list[float]:
        m = scrape(url)
        return [sum(s.value for s in m[fam].samples if s.name == name and labels.items() <= s.labels.items())
                if fam in m else 0.0 for fam, name, labels in sample]

    before = read()
    prompts = ["score me", "and me too"]  # 8 and 10 tokens
    body = complete(url, "alpha", prompts, 0, echo=True, logprobs=1, n=2)
    assert [c["text"] for c in body["choices"]] == [prompts[0], prompts[0], prompts[1], prompts[1]]
    complete(url, "alpha", "then generate", 3, echo=True, logprobs=1)  # 13 tokens, 3 generated
    wait_idle(app)
    got = [a - b for a, b in zip(read(), before, strict=True)]
    e2e_sum = got[10]
    assert e2e_sum > 0
    got[10], got[12] = None, None  # latency sums: positive, not exact
    assert got == [5, 2 * 8 + 2 * 10 + 13, 3,  # 4 choices + 1 generation, prompt tokens, generated
                   5, 36 + 13, 5, 3,  # prompt-length histogram; generation-length histogram (0 x 4, 3)
                   3, 2 + 2 + 1,  # n: once a prompt
                   5, None,  # e2e
                   1, None,  # first-token latency: the generating request only
                   5, 36 + 13]  # moelora's per-adapter series


def test_engine_thread_histogram_buckets_are_inclusive_and_cumulative():
    from moelora.server.metric_types import Hist

    h = Hist((0.1, 0.5, 1.0))
    for v in (0.05, 0.1, 0.1000001, 0.5, 3.0):
        h.observe(v)
    fam = h.family("vllm:x", "doc", {"model_name": "m", "engine": "0"})
    got = {s.labels["le"]: s.value for s in fam.samples if s.name == "vllm:x_bucket"}
    assert got == {"0.1": 2, "0.5": 4, "1.0": 4, "+Inf": 5}
    (count,) = [s.value for s in fam.samples if s.name == "vllm:x_count"]
    (total,) = [s.value for s in fam.samples if s.name == "vllm:x_sum"]
    assert count == 5 and total == pytest.approx(3.7500001)
