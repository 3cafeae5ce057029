"""Differential fuzz of the CPU engine: random engine settings (block size, a KV cache small enough to
force preemption, chunked prefill budgets, prefix caching, overlapped scheduling, 2 adapter slots for
3 adapters) and random workloads (shared prefixes, mixed adapters, stop tokens, penalties, logit_bias,
min_tokens, aborts)
must give every request exactly the tokens of its own greedy recomputation, and free every block.
Qwen3-MoE (GQA cache) and DeepSeek-V3 / GLM-4-MoE (MLA latent cache; partial rotary, q/k norm)."""

from __future__ import annotations

import random

import pytest

from moelora.engine.request import SamplingParams
from tests.helpers.models import build_from_architecture, engine, random_adapter
from tests.helpers.oracle import tiny_hf_model
from tests.helpers.runs import reference_row, step_with_aborts


def recompute(eng, prompt: list[int], adapter, p: SamplingParams) -> tuple[list[int], str]:
    outs: list[int] = []
    while len(outs) < p.max_tokens:
        last = eng.prompt_logits([prompt + outs], [adapter])[0][-1].float().clone()
        for t, b in p.logit_bias:
            last[t] += b
        if len(outs) < p.min_tokens:
            last[list(p.stop_token_ids)] = float("-inf")
        tok = int(reference_row(last, prompt, outs, p).argmax())
        outs.append(tok)  # the stop token is an output token (vLLM's)
        if tok in p.stop_token_ids:
            return outs, "stop"
    return outs, "length"


def fuzz_case(model, seed: int) -> tuple[int, int, bool]:
    """One random engine and workload, checked; returns (preemptions, aborts, overlapped)."""
    adapters = {"x": random_adapter(model, 20, 6), "y": random_adapter(model, 21, 8, frac=0.6),
                "z": random_adapter(model, 30 + seed, 4)}
    rng = random.Random(seed)
    V = model.config.vocab_size
    block = rng.choice([2, 4, 8])
    eng = engine(model, adapters, max_loras=2, block_size=block, num_kv_blocks=rng.choice([40, 64, 512]) // block,
                 max_num_batched_tokens=rng.choice([5, 16, 64]), enable_prefix_caching=rng.random() < 0.7,
                 async_scheduling=rng.random() < 0.5, max_num_seqs=rng.choice([3, 8]))
    shared = [rng.randrange(3, V) for _ in range(rng.randrange(2, 9))]
    reqs, abort_after = [], {}
    for _ in range(10):
        prompt = (shared if rng.random() < 0.5 else []) + [rng.randrange(3, V) for _ in range(rng.randrange(1, 9))]
        kw = dict(max_tokens=rng.randrange(1, 9), temperature=0, ignore_eos=True)
        if rng.random() < 0.3:
            kw["stop_token_ids"] = (rng.randrange(3, V),)
        if rng.random() < 0.3:
            kw.update(frequency_penalty=1.0, repetition_penalty=1.3)
        if rng.random() < 0.2:
            kw["logit_bias"] = {rng.randrange(3, V): rng.choice([-100.0, 3.0])}
        if "stop_token_ids" in kw and rng.random() < 0.5:
            kw["min_tokens"] = rng.randrange(0, kw["max_tokens"] + 1)
        r = eng.add_request(prompt, SamplingParams(**kw), rng.choice([None, "x", "y", "z"]))
        reqs.append(r)
        if rng.random() < 0.15:
            abort_after[r.request_id] = rng.randrange(0, 4)
    step_with_aborts(eng, abort_after)
    aborted = {r.request_id for r in reqs if r.finish_reason == "abort"}
    for r in reqs:
        if r.request_id in aborted:
            continue
        want, reason = recompute(eng, r.prompt_ids, r.adapter, r.params)
        assert (r.output_ids, r.finish_reason) == (want, reason), (seed, r.request_id)
    assert eng.cache.allocator.num_used == 0
    return sum(r.num_preemptions for r in reqs), len(aborted), eng.cfg.async_scheduling


SEEDS = {"qwen3_moe": range(8), "deepseek_v3": range(4), "glm4_moe": range(4)}
CASES = [(family, seed) for family, seeds in SEEDS.items() for seed in seeds]


@pytest.fixture(scope="module")
def fuzz_stats():
    stats = {}
    for family, seeds in SEEDS.items():
        model = build_from_architecture(tiny_hf_model(family, seed=7), max_loras=2, max_rank=8)
        for seed in seeds:
            stats[family, seed] = fuzz_case(model, seed)
    return stats


@pytest.mark.parametrize("family,seed", CASES)
def test_random_engines_and_workloads_equal_recomputation(fuzz_stats, family, seed):
    assert (family, seed) in fuzz_stats  # each case asserted its own outputs while the fixture ran it


def test_the_fuzz_reaches_preemption_aborts_and_overlap(fuzz_stats):
    stats = list(fuzz_stats.values())
    assert any(p > 0 for p, _, _ in stats) and any(a > 0 for _, a, _ in stats)
    assert any(o for _, _, o in stats) and not all(o for _, _, o in stats)
