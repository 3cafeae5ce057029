"""`moelora bench`: decode throughput of your model with and without its adapters, on this machine.

What a deployer asks before serving: how many tokens a second at my concurrency, and what do my
adapters cost. One engine (the model with its adapters registered, built as `moelora serve` builds
it) runs, at each concurrency, three workloads in turns for `repeats` rounds (medians):
  base         every request on the base model: no adapter, so no LoRA work (on CUDA the decode
               graphs captured without LoRA; on an H200 within 1 % of an engine with no LoRA slots)
  1 adapter    every request on the first adapter
  N adapters   the adapters spread over the requests round-robin (when there are two or more)
After an untimed warm-up run of each workload, a run adds `conc` random prompts of `prompt_len` tokens
(fresh ones each run, so the prefix cache serves none of them), steps until each has its first token
(the prefill), takes one more step, then times `steps` back-to-back decode steps with one device sync at
the end (so overlapped scheduling overlaps, as in serving). Each timed step must give every request one
token: a preempted or finished request would make the number a lie, so the run raises `CapacityError`.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from moelora.engine.engine import LLMEngine
from moelora.engine.request import SamplingParams
from moelora.errors import CapacityError, ConfigError

_SLACK = 4  # room a request needs beyond the timed steps (its first token, the warm-up step, one in flight)


@dataclass(frozen=True)
class DecodeRun:
    """One workload at one concurrency: medians over the rounds, in seconds."""

    workload: str
    conc: int
    step_s: float  # a decode step
    prefill_s: float  # from adding the requests until every one has its first token

    @property
    def tokens_per_s(self) -> float:
        return self.conc / self.step_s


def workloads(adapters: list[str]) -> list[tuple[str, list[str | None]]]:
    """(label, the adapters requests take in turn) of each workload for these registered adapters."""
    out: list[tuple[str, list[str | None]]] = [("base", [None])]
    if adapters:
        out.append(("1 adapter", adapters[:1]))
    if len(adapters) > 1:
        out.append((f"{len(adapters)} adapters", list(adapters)))
    return out


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=g).tolist()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_decode(eng: LLMEngine, prompts: list[list[int]], names: list[str | None], steps: int) -> tuple[float, float]:
    """(prefill seconds, seconds a decode step) of `prompts` on adapters `names` (taken in turn), see the
    module docstring; the engine is left with no request. Requests may generate up to max_model_len (they
    are aborted after the timed steps): a chunked prefill admits them over several steps, and the first
    ones decode meanwhile, so a budget of `steps` tokens would finish them inside the timed window."""
    longest = max(map(len, prompts))
    room = eng.cfg.max_model_len - longest
    if steps < 1 or room < steps + _SLACK:
        raise ConfigError(f"steps must be >= 1 and prompt + steps + {_SLACK} tokens within max_model_len "
                          f"{eng.cfg.max_model_len}; got {steps} steps after {longest} prompt tokens")
    params = SamplingParams(max_tokens=room, temperature=0.0, ignore_eos=True)
    reqs = []

    def refuse(what: str) -> CapacityError:
        return CapacityError(
            f"{len(prompts)} requests of up to {longest} prompt tokens did not all decode together ({what}; "
            f"preemptions {sum(r.num_preemptions for r in reqs)}): lower the concurrency or the prompt length, or "
            "give the KV cache more room (max_num_seqs, gpu_memory_utilization, num_kv_blocks)")

    try:
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            reqs.append(eng.add_request(p, params, names[i % len(names)]))
        while any(not r.output_ids for r in reqs):
            if any(r.num_preemptions or r.finished for r in reqs):
                raise refuse("a request was preempted or finished before the last one was admitted")
            eng.step()
        _sync(eng.device)
        prefill = time.perf_counter() - t0
        eng.step()
        _sync(eng.device)
        before = [len(r.output_ids) for r in reqs]
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        _sync(eng.device)
        per_step = (time.perf_counter() - t0) / steps
        gained = [len(r.output_ids) - b for r, b in zip(reqs, before, strict=True)]
        if any(g != steps for g in gained) or any(r.num_preemptions for r in reqs):
            raise refuse(f"tokens a request got in the {steps} timed steps: {min(gained)}..{max(gained)}")
        return prefill, per_step
    finally:  # an overlapped step still in flight holds only aborted requests: the next step() drops it
        for r in reqs:
            eng.abort(r.request_id)


def time_prefill(eng: LLMEngine, prompts: list[list[int]], names: list[str | None]) -> tuple[float, int]:
    """(seconds, steps) from adding `prompts` (on adapters `names`, taken in turn; one greedy token each) until
    every one has its token: the engine's prefill of them, chunked as its scheduler chunks, with one device sync
    at the end (so overlapped scheduling overlaps). No request decodes, so every step is prefill; a preempted
    request would count its prompt twice, so the run raises `CapacityError`. The engine is left with no request."""
    longest = max(map(len, prompts))
    if longest >= eng.cfg.max_model_len:
        raise ConfigError(f"a prompt of {longest} tokens leaves no room for its token in max_model_len "
                          f"{eng.cfg.max_model_len}")
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    reqs, steps = [], 0
    try:
        _sync(eng.device)
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            reqs.append(eng.add_request(p, params, names[i % len(names)]))
        while not all(r.finished for r in reqs):
            if any(r.num_preemptions for r in reqs):
                raise CapacityError(f"{len(prompts)} prompts of up to {longest} tokens: a request was preempted; "
                                    "give the KV cache more room (num_kv_blocks, gpu_memory_utilization)")
            eng.step()
            steps += 1
        _sync(eng.device)
        return time.perf_counter() - t0, steps
    finally:
        for r in reqs:
            if not r.finished:
                eng.abort(r.request_id)


def bench(eng: LLMEngine, concs: list[int], prompt_len: int, steps: int, repeats: int = 3) -> list[DecodeRun]:
    """Every workload of the engine's registered adapters at every concurrency, in turns per round."""
    if repeats < 1 or prompt_len < 1 or not concs or min(concs) < 1:
        raise ConfigError("repeats, prompt_len and every concurrency must be >= 1")
    if max(concs) > eng.cfg.max_num_seqs:
        raise ConfigError(f"concurrency {max(concs)} is above max_num_seqs {eng.cfg.max_num_seqs}")
    vocab = eng.model_config.vocab_size
    loads = workloads(eng.pool.names)
    runs = []
    for conc in concs:
        for k, (_, names) in enumerate(loads):  # warm-up: lazy compiles, first-use buffers
            time_decode(eng, random_prompts(conc, prompt_len, vocab, seed=-1 - conc * 10 - k), names, min(steps, 2))
        times: dict[str, list[tuple[float, float]]] = {}
        for rnd in range(repeats):
            for k, (label, names) in enumerate(loads):
                prompts = random_prompts(conc, prompt_len, vocab, seed=(conc * 1000 + rnd) * 10 + k)
                times.setdefault(label, []).append(time_decode(eng, prompts, names, steps))
        for label, ts in times.items():
            runs.append(DecodeRun(label, conc, statistics.median(t[1] for t in ts),
                                  statistics.median(t[0] for t in ts)))
    return runs


def format_runs(runs: list[DecodeRun]) -> str:
    """A table: per concurrency and workload, step time, tokens/s, ratio to the base workload, prefill."""
    base = {r.conc: r for r in runs if r.workload == "base"}
    lines = [f"{'conc':>5} {'workload':<12} {'step ms':>9} {'tokens/s':>10} {'vs base':>8} {'prefill ms':>11}"]
    for r in runs:
        ratio = r.tokens_per_s / base[r.conc].tokens_per_s if r.conc in base else float("nan")
        lines.append(f"{r.conc:>5} {r.workload:<12} {r.step_s * 1e3:>9.2f} {r.tokens_per_s:>10.1f} {ratio:>8.3f} "
                     f"{r.prefill_s * 1e3:>11.1f}")
    return "\n".join(lines)
