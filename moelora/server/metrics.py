"""Prometheus metrics of one server: a registry per app (no global state), vLLM-style names.

Request-level series (`ServerMetrics` methods, called from the request handlers):
  moelora:requests_total{model,outcome}          finished sequences; outcome stop|length|abort|error
  moelora:request_errors_total{status}           requests refused with an HTTP error (400, 404, 503...)
  moelora:prompt_tokens_total{model}             prompt tokens admitted
  moelora:generation_tokens_total{model}         tokens generated
  moelora:time_to_first_token_seconds{model}     arrival -> first token (histogram)
  moelora:inter_token_latency_seconds{model}     between consecutive tokens of a sequence (histogram)
  moelora:e2e_request_latency_seconds{model}     arrival -> finished (histogram)
Engine state, read at scrape time from the engine thread's published `EngineStats`:
  moelora:num_requests_waiting, moelora:num_requests_running, moelora:kv_cache_usage_perc (0..1),
  moelora:kv_cache_blocks_used, moelora:kv_cache_blocks_total, moelora:lora_slots_in_use,
  moelora:lora_slots_total, moelora:lora_adapters_registered,
  moelora:lora_loads_total (adapter weights re-read from disk after a CPU-cache eviction),
  moelora:lora_evictions_total (adapters evicted from a device slot).
`model` is the served model name or the adapter name (only names the server knows: no
user-chosen label values).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from moelora.server.async_engine import EngineStats

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)


class _EngineCollector:
    def __init__(self, stats: Callable[[], EngineStats]):
        self._stats = stats

    def collect(self):
        s = self._stats()
        gauges = {
            "num_requests_waiting": ("Requests waiting to be scheduled.", s.waiting),
            "num_requests_running": ("Requests in the running batch.", s.running),
            "kv_cache_usage_perc": ("Fraction of KV cache blocks in use (0..1).",
                                    s.kv_used / s.kv_total if s.kv_total else 0.0),
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


class ServerMetrics:
    def __init__(self, stats: Callable[[], EngineStats]):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("moelora:requests", "Finished sequences by model and outcome.",
                                ["model", "outcome"], registry=r)
        self.errors = Counter("moelora:request_errors", "Requests refused with an HTTP error.", ["status"],
                              registry=r)
        self.prompt_tokens = Counter("moelora:prompt_tokens", "Prompt tokens admitted.", ["model"], registry=r)
        self.generation_tokens = Counter("moelora:generation_tokens", "Tokens generated.", ["model"], registry=r)
        self.ttft = Histogram("moelora:time_to_first_token_seconds", "Arrival to first token.", ["model"],
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("moelora:inter_token_latency_seconds", "Time between consecutive tokens.",
                             ["model"], buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("moelora:e2e_request_latency_seconds", "Arrival to finish.", ["model"],
                             buckets=_LATENCY_BUCKETS, registry=r)
        r.register(_EngineCollector(stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)
