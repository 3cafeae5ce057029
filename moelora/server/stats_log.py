"""The periodic stats log line of a busy server (vLLM's, unless `--disable-log-stats`): throughput since
the last line, queue lengths, KV cache use and the prefix-cache hit rate; silent while idle."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from moelora.server.async_engine import EngineStats

log = logging.getLogger("moelora.server")


def stats_line(prev: tuple, now: tuple, stats: EngineStats) -> str | None:
    """The line for the interval from `prev` to `now` ((time, prompt tokens, generation tokens,
    prefix queried, prefix hit) each), or None when nothing ran or waited in it."""
    dt = max(now[0] - prev[0], 1e-9)
    prompt, generated = (now[1] - prev[1]) / dt, (now[2] - prev[2]) / dt
    if not (prompt or generated or stats.running or stats.waiting):
        return None
    queried = now[3] - prev[3]
    hit_rate = (now[4] - prev[4]) / queried if queried else 0.0
    usage = stats.kv_used / stats.kv_total if stats.kv_total else 0.0
    return (f"Avg prompt throughput: {prompt:.1f} tokens/s, Avg generation throughput: {generated:.1f} tokens/s, "
            f"Running: {stats.running} reqs, Waiting: {stats.waiting} reqs, KV cache usage: {usage:.1%}, "
            f"Prefix cache hit rate: {hit_rate:.1%}")


async def log_stats_while_serving(stats: Callable[[], EngineStats], totals, interval_s: float) -> None:
    """Log `stats_line` every `interval_s` seconds (0: never); `totals.prompt_tokens` and
    `totals.generation_tokens` are the token counts so far (the metrics' running sums)."""
    if interval_s <= 0:
        return

    def sample() -> tuple:
        s = stats()
        return time.monotonic(), totals.prompt_tokens, totals.generation_tokens, s.prefix_queried_tokens, \
            s.prefix_hit_tokens

    prev = sample()
    while True:
        await asyncio.sleep(interval_s)
        now = sample()
        line = stats_line(prev, now, stats())
        if line is not None:
            log.info(line)
        prev = now
