"""What a prefill chunk costs the requests decoding beside it: their inter-token latency (ITL) while long
prompts arrive, and the prefill's tokens/s with them, per chunk size (max_num_batched_tokens).

`benchmarks/prefill.py --itl N` calls `itl_workloads` with its engines (one pair per chunk size). A run, per
engine and workload (no LoRA; 8 adapters of rank 16 spread over every request): N requests of `decode_len`
random prompt tokens are prefilled and decode (greedy, no end), `quiet` decode steps are timed with no prompt
waiting (the decodes' ITL alone), then `prompts` long prompts (one greedy token each) are added at once and
the engine steps until every one has its token. The scheduler puts the running decodes first into every step
(one token each) and fills the rest of the chunk with prompt tokens, so while the prompts last each decode
gets one token a step and its ITL is the step's length with a chunk of prompt beside it.

ITL: the wall time between two tokens of one decode request, read on the host after each `step()` (the token
has reached the host by then: with overlapped scheduling a step returns the previous step's tokens, which is
what a streaming client sees). p50 / p99 over every decode request and every gap in the window; prefill
tokens/s = prompt tokens / (from adding the prompts until the last has its token). The engines are prefill.py's:
eager by default (mixed and quiet steps; the quiet ITL is then an eager decode's, above what the decode graphs give
in serving); with its --cuda-graphs decode the quiet steps replay decode graphs, with piecewise the mixed steps of
up to --piecewise-tokens tokens replay the piecewise graphs too.
"""

from __future__ import annotations

import statistics
import time

import torch

from moelora.bench import random_prompts
from moelora.engine.request import SamplingParams
from moelora.errors import CapacityError

ITL_WORKLOADS = ("no LoRA", "8 adapters")


def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile (0..100) of xs, linear between the two nearest ranks."""
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (k - lo)


def _sync(eng) -> None:
    if eng.device.type == "cuda":
        torch.cuda.synchronize(eng.device)


def _gaps(decodes, last: list[int], stamp: list[float], now: float, out: list[float]) -> None:
    """Append, for each decode request that got tokens since `last`, the time since its previous token (a step
    that brings k tokens counts k gaps of 1/k each); update `last` / `stamp`."""
    for i, r in enumerate(decodes):
        got = len(r.output_ids) - last[i]
        if got > 0:
            out.extend([(now - stamp[i]) / got] * got)
            last[i], stamp[i] = len(r.output_ids), now


def time_itl(eng, decode_prompts, long_prompts, names, quiet: int) -> dict:
    """One run (see the module docstring): {'quiet': ITL samples s, 'mixed': ITL samples s while the prompts
    lasted, 'prefill_s': s, 'steps': mixed steps}. The engine is left with no request."""
    room = eng.cfg.max_model_len - max(map(len, decode_prompts))
    decode_params = SamplingParams(max_tokens=room, temperature=0.0, ignore_eos=True)
    reqs, prompts = [], []
    try:
        for i, p in enumerate(decode_prompts):
            reqs.append(eng.add_request(p, decode_params, names[i % len(names)]))
        while any(len(r.output_ids) < 2 for r in reqs):  # prefilled, and one decode step behind them
            eng.step()
        _sync(eng)
        last, stamp = [len(r.output_ids) for r in reqs], [time.perf_counter()] * len(reqs)
        quiet_gaps: list[float] = []
        for _ in range(quiet):
            eng.step()
            _gaps(reqs, last, stamp, time.perf_counter(), quiet_gaps)
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        mixed: list[float] = []
        t0, steps = time.perf_counter(), 0
        for i, p in enumerate(long_prompts):
            prompts.append(eng.add_request(p, params, names[(len(reqs) + i) % len(names)]))
        while not all(r.finished for r in prompts):
            eng.step()
            steps += 1
            _gaps(reqs, last, stamp, time.perf_counter(), mixed)
        prefill_s = time.perf_counter() - t0
        if any(r.num_preemptions or r.finished for r in reqs) or any(r.num_preemptions for r in prompts):
            raise CapacityError("a request was preempted or a decode finished during the ITL run: give the KV cache "
                                "more room or lower --itl")
        return dict(quiet=quiet_gaps, mixed=mixed, prefill_s=prefill_s, steps=steps)
    finally:
        for r in reqs + prompts:
            if not r.finished:
                eng.abort(r.request_id)
        while eng.has_unfinished():  # an overlapped step in flight holds only aborted requests
            eng.step()


def itl_workloads(by_chunk: dict, n_decode: int, decode_len: int, prompt_len: int, n_prompts: int, quiet: int,
                  repeats: int, vocab: int, log) -> list[dict]:
    """Every chunk's engines (`prefill.build_engines`' pairs) with `ITL_WORKLOADS`, after a warm-up run each;
    logs a table and returns its CSV rows. Samples of the rounds are pooled."""
    log(f"ITL: {n_decode} requests decoding ({decode_len}-token prompts) while {n_prompts} prompts of {prompt_len} "
        f"arrive at once; {repeats} rounds pooled; ms")
    log(f"{'chunk':>5} {'workload':<10} {'quiet p50':>9} {'quiet p99':>9} {'ITL p50':>8} {'ITL p99':>8} "
        f"{'ITL max':>8} {'steps':>5} {'prefill tok/s':>13}")
    rows = []
    for chunk, engines in by_chunk.items():
        for label, eng, names in engines:
            if label not in ITL_WORKLOADS:
                continue
            seed = chunk * 100 + len(names)
            time_itl(eng, random_prompts(n_decode, decode_len, vocab, -seed),
                     random_prompts(n_prompts, prompt_len, vocab, -seed - 1), names, 2)  # warm-up
            runs = [time_itl(eng, random_prompts(n_decode, decode_len, vocab, seed * 10 + k),
                             random_prompts(n_prompts, prompt_len, vocab, seed * 10 + k + 5), names, quiet)
                    for k in range(repeats)]
            quiet_s = [g for r in runs for g in r["quiet"]]
            mixed = [g for r in runs for g in r["mixed"]]
            tps = n_prompts * prompt_len / statistics.median(r["prefill_s"] for r in runs)
            row = dict(chunk=chunk, config=label, decodes=n_decode, prompt_len=prompt_len, prompts=n_prompts,
                       quiet_p50_ms=1e3 * percentile(quiet_s, 50), quiet_p99_ms=1e3 * percentile(quiet_s, 99),
                       itl_p50_ms=1e3 * percentile(mixed, 50), itl_p99_ms=1e3 * percentile(mixed, 99),
                       itl_max_ms=1e3 * max(mixed), steps=runs[0]["steps"], prefill_tokens_per_s=tps)
            log(f"{chunk:>5} {label:<10} {row['quiet_p50_ms']:9.1f} {row['quiet_p99_ms']:9.1f} "
                f"{row['itl_p50_ms']:8.1f} {row['itl_p99_ms']:8.1f} {row['itl_max_ms']:8.1f} {row['steps']:>5} "
                f"{tps:13.0f}")
            rows.append(row)
    return rows
