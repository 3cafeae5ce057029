"""Prometheus metrics of one server: a registry per app (no global state).

Two families of series (every one is listed, with its meaning, in moelora/server/README.md "Metrics"):

- `vllm:*`, under vLLM's names, types, labels and histogram buckets, so vLLM dashboards, routers and
  the Gateway API Inference Extension read them unchanged: labels `model_name` (the first served name:
  the base model, for every request, adapters included, as vLLM does) and `engine` ("0"). Request series
  are recorded on the engine thread (`RequestObserver`) from the engine's own timestamps; engine state
  and cumulative engine counters are read at scrape time from the published `EngineStats`.
- `moelora:*`, the per-adapter detail vLLM has no label for (label `model`: the served name or the
  adapter name, only names the server knows) and the adapter-slot state.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from moelora.engine.request import Request
from moelora.server.async_engine import EngineStats, GenerateSpec, ScoreRequest
from moelora.server.metric_types import Family, Hist

# vLLM's buckets (its PrometheusStatLogger): first-token, inter-token and whole-request latencies
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
N_BUCKETS = (1, 2, 5, 10, 20)
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
FINISH_REASONS = ("stop", "length", "abort", "error")
# moelora's per-adapter latency series (finer at the low end: a small model's tokens come in milliseconds)
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)


def buckets_1_2_5(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's buckets of token counts, up to max_model_len)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class _EngineCollector:
    """The series read at scrape time from the engine thread's latest `EngineStats`."""

    def __init__(self, stats: Callable[[], EngineStats], labels: dict[str, str], cache_config: Mapping[str, str],
                 max_loras: int):
        self._stats, self._labels, self._max_loras = stats, labels, max_loras
        self._cache_config = {**{k: str(v) for k, v in cache_config.items()}, "engine": labels["engine"]}

    def _vllm_gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(f"vllm:{name}", doc, labels=list(self._labels))
        g.add_metric(list(self._labels.values()), value)
        return g

    def _vllm_counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(f"vllm:{name}", doc, labels=list(self._labels))
        c.add_metric(list(self._labels.values()), value)
        return c

    def collect(self):
        s = self._stats()
        usage = s.kv_used / s.kv_total if s.kv_total else 0.0
        yield self._vllm_gauge("num_requests_running", "Number of requests in model execution batches.", s.running)
        yield self._vllm_gauge("num_requests_waiting", "Number of requests waiting to be processed.", s.waiting)
        yield self._vllm_gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage)
        yield self._vllm_gauge("gpu_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage (vLLM's older "
                               "name of kv_cache_usage_perc).", usage)
        yield self._vllm_counter("num_preemptions", "Cumulative number of preemption from the engine.",
                                 s.preemptions)
        yield self._vllm_counter("prefix_cache_queries", "Prefix cache queries, in terms of number of queried "
                                 "tokens.", s.prefix_queried_tokens)
        yield self._vllm_counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                                 s.prefix_hit_tokens)
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=list(self._cache_config))
        info.add_metric(list(self._cache_config.values()), 1.0)
        yield info
        lora = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                 labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
        lora.add_metric([str(self._max_loras), ",".join(s.waiting_adapters), ",".join(s.running_adapters)],
                        s.time or time.time())
        yield lora
        gauges = {
            "num_requests_waiting": ("Requests waiting to be scheduled.", s.waiting),
            "num_requests_running": ("Requests in the running batch.", s.running),
            "kv_cache_usage_perc": ("Fraction of KV cache blocks in use (0..1).", usage),
            "kv_cache_blocks_used": ("KV cache blocks in use.", s.kv_used),
            "kv_cache_blocks_total": ("KV cache blocks in all.", s.kv_total),
            "lora_slots_in_use": ("Device adapter slots holding an adapter.", s.slots_in_use),
            "lora_slots_total": ("Device adapter slots (max_loras).", s.slots_total),
            "lora_adapters_registered": ("Adapters registered (servable by name).", len(s.adapters)),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"moelora:{name}", doc, value=value)
        yield CounterMetricFamily("moelora:lora_loads", "Adapter weights re-read from disk after a CPU-cache "
                                  "eviction.", value=s.loads)
        yield CounterMetricFamily("moelora:lora_evictions", "Adapters evicted from a device slot.",
                                  value=s.evictions)


_PHASES = {"e2e": ("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds."),
           "queue": ("request_queue_time_seconds", "Histogram of time spent in WAITING phase for request."),
           "prefill": ("request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request."),
           "decode": ("request_decode_time_seconds", "Histogram of time spent in DECODE phase for request."),
           "inference": ("request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.")}


class _VllmRequestSeries:
    """vLLM's request series: filled on the engine thread (a `RequestObserver`), exposed at scrape time (a
    collector)."""

    def __init__(self, labels: dict[str, str], max_model_len: int):
        self.labels = labels
        tokens = buckets_1_2_5(max_model_len)
        self.prompt_tokens = self.generation_tokens = 0  # the periodic stats line reads them too
        self.success = dict.fromkeys(FINISH_REASONS, 0)
        self.prompt_len, self.generation_len = Hist(tokens), Hist(tokens)
        self.params_n, self.params_max_tokens = Hist(N_BUCKETS), Hist(tokens)
        self.ttft, self.itl, self.request_tpot = Hist(TTFT_BUCKETS), Hist(ITL_BUCKETS), Hist(ITL_BUCKETS)
        self.phase = {key: Hist(REQUEST_LATENCY_BUCKETS) for key in _PHASES}
        self.iteration = Hist(ITERATION_BUCKETS)

    # RequestObserver ----------------------------------------------------------------------------
    def added(self, specs: Sequence[GenerateSpec]) -> None:
        for i, spec in enumerate(specs):
            if i % spec.n == 0:  # once per prompt: its n choices are consecutive
                self.params_n.observe(spec.n)

    def step(self, tokens: int) -> None:
        self.iteration.observe(tokens)

    def tokens(self, req: Request, new: int, gap: float | None) -> None:
        self.generation_tokens += new
        if gap is None:
            self.prompt_tokens += len(req.prompt_ids)
            self.ttft.observe(req.first_token_time - req.arrival)
        else:
            for _ in range(new):
                self.itl.observe(gap / new)

    def finished(self, req: Request, reason: str) -> None:
        end = req.finished_time if req.finished_time is not None else time.monotonic()
        scheduled = req.scheduled_time if req.scheduled_time is not None else end
        first = req.first_token_time if req.first_token_time is not None else end
        self.success[reason if reason in self.success else "stop"] += 1
        phase = self.phase
        phase["e2e"].observe(end - req.arrival)
        phase["queue"].observe(scheduled - req.arrival)
        phase["prefill"].observe(first - scheduled)
        phase["decode"].observe(end - first)
        phase["inference"].observe(end - scheduled)
        generated = len(req.output_ids)
        self.prompt_len.observe(len(req.prompt_ids))
        self.generation_len.observe(generated)
        self.params_max_tokens.observe(req.params.max_tokens)
        if generated > 1:
            self.request_tpot.observe((end - first) / (generated - 1))

    def scored(self, score: ScoreRequest, started: float, end: float, reason: str) -> None:
        """Each of its n choices counts as a finished request that generated nothing, as vLLM counts them."""
        for _ in range(score.n):
            self.success[reason] += 1
            for key, seconds in (("e2e", end - score.arrival), ("queue", started - score.arrival),
                                 ("prefill", end - started), ("decode", 0.0), ("inference", end - started)):
                self.phase[key].observe(seconds)
            self.prompt_len.observe(score.prompt_tokens)
            self.generation_len.observe(0)
            self.params_max_tokens.observe(0)
            if reason != "error":
                self.prompt_tokens += score.prompt_tokens
        self.params_n.observe(score.n)

    # collector ----------------------------------------------------------------------------------
    def collect(self):
        labels, names, values = self.labels, list(self.labels), list(self.labels.values())
        for name, doc, value in (("prompt_tokens", "Number of prefill tokens processed.", self.prompt_tokens),
                                 ("generation_tokens", "Number of generation tokens processed.",
                                  self.generation_tokens)):
            c = CounterMetricFamily(f"vllm:{name}", doc, labels=names)
            c.add_metric(values, value)
            yield c
        c = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                labels=[*names, "finished_reason"])
        for reason, count in self.success.items():
            c.add_metric([*values, reason], count)
        yield c
        hists = [(self.prompt_len, "request_prompt_tokens", "Number of prefill tokens processed."),
                 (self.generation_len, "request_generation_tokens", "Number of generation tokens processed."),
                 (self.params_n, "request_params_n", "Histogram of the n request parameter."),
                 (self.params_max_tokens, "request_params_max_tokens", "Histogram of the max_tokens request "
                  "parameter."),
                 (self.ttft, "time_to_first_token_seconds", "Histogram of time to first token in seconds."),
                 (self.itl, "inter_token_latency_seconds", "Histogram of inter-token latency in seconds."),
                 (self.itl, "time_per_output_token_seconds", "Histogram of time per output token in seconds "
                  "(vLLM's older name of inter_token_latency_seconds)."),
                 (self.request_tpot, "request_time_per_output_token_seconds", "Histogram of "
                  "time_per_output_token_seconds per request."),
                 (self.iteration, "iteration_tokens_total", "Histogram of number of tokens per engine_step.")]
        hists += [(self.phase[key], name, doc) for key, (name, doc) in _PHASES.items()]
        for hist, name, doc in hists:
            yield hist.family(f"vllm:{name}", doc, labels)


class ServerMetrics:
    """`model_name`: the served base name; `cache_config`: the labels of vllm:cache_config_info."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str = "", max_model_len: int = 1 << 16,
                 cache_config: Mapping[str, object] | None = None, max_loras: int = 0):
        self.registry = r = CollectorRegistry()
        labels = {"model_name": model_name, "engine": "0"}
        self.vllm = _VllmRequestSeries(labels, max_model_len)
        r.register(self.vllm)
        # per adapter (moelora:*): recorded by the request handlers (serving.py), on the event loop
        self.requests = Family("moelora:requests", "Finished sequences by model and outcome.", ["model", "outcome"])
        self.errors = Family("moelora:request_errors", "Requests refused with an HTTP error.", ["status"])
        self.prompt_tokens = Family("moelora:prompt_tokens", "Prompt tokens admitted.", ["model"])
        self.generation_tokens = Family("moelora:generation_tokens", "Tokens generated.", ["model"])
        self.ttft = Family("moelora:time_to_first_token_seconds", "Arrival to first token.", ["model"],
                           _LATENCY_BUCKETS)
        self.itl = Family("moelora:inter_token_latency_seconds", "Time between consecutive tokens.", ["model"],
                          _LATENCY_BUCKETS)
        self.e2e = Family("moelora:e2e_request_latency_seconds", "Arrival to finish.", ["model"], _LATENCY_BUCKETS)
        for family in (self.requests, self.errors, self.prompt_tokens, self.generation_tokens, self.ttft, self.itl,
                       self.e2e):
            r.register(family)
        r.register(_EngineCollector(stats, labels, cache_config or {}, max_loras))

    @property
    def observer(self) -> _VllmRequestSeries:
        """What the engine thread reports requests to (`AsyncEngine.observe`)."""
        return self.vllm

    def render(self) -> bytes:
        return generate_latest(self.registry)
