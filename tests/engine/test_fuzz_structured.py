"""Differential fuzz of constrained requests: random engine settings (block size, a KV cache small enough to force
preemption, chunked prefill budgets, prefix caching, overlapped scheduling, one adapter slot for two adapters) and
random workloads of greedy requests held to regexes / choices beside free ones (penalties, logit_bias, stop tokens,
aborts), on the tiny byte-level model. Each finished request equals its own greedy recomputation under the same
format (one fresh matcher fed its tokens one by one, the logits of whole-sequence forwards), and a completed one's
text matches the format by Python's `re`. The overlapped engine samples a constrained step after reading the
previous step back (engine.py `_step_overlapped`); this checks that path against preemption, chunking and aborts."""

from __future__ import annotations

import random
import re

import pytest
import torch

from moelora.engine.config import EngineConfig
from moelora.engine.engine import LLMEngine
from moelora.engine.request import SamplingParams
from moelora.engine.structured import StructuredOutput
from moelora.engine.tokenizer import Tokenizer
from tests.helpers.models import build_from_architecture, random_adapter
from tests.helpers.runs import reference_row, step_with_aborts
from tests.helpers.server import write_model

FORMATS = [  # (kind, value, the Python pattern of a completed output)
    ("regex", "[a-c]{2,5};", r"[a-c]{2,5};"),
    ("regex", "(x|yz)+!", r"(x|yz)+!"),
    ("choice", ["yes", "no", "maybe"], r"yes|no|maybe"),
    ("regex", "[0-9]{3}", r"[0-9]{3}"),
]


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory):
    model_dir, hf = write_model(tmp_path_factory.mktemp("fuzz_structured"))
    model = build_from_architecture(hf, max_loras=1, max_rank=8)
    adapters = {"x": random_adapter(model, 41, 6), "y": random_adapter(model, 42, 8, frac=0.6)}
    return model, Tokenizer(model_dir), adapters


def make_engine(model, tokenizer, adapters, rng: random.Random) -> LLMEngine:
    block = rng.choice([2, 4, 8])
    cfg = EngineConfig(device="cpu", dtype="float32", max_loras=1, max_lora_rank=8, block_size=block,
                       num_kv_blocks=rng.choice([28, 40, 512]) // block, max_model_len=128,
                       max_num_batched_tokens=rng.choice([5, 16, 64]), enable_prefix_caching=rng.random() < 0.7,
                       async_scheduling=rng.random() < 0.7, max_num_seqs=rng.choice([3, 8])).resolve(model.config)
    eng = LLMEngine(model.with_options(cfg.layer_options(model.options)), tokenizer, cfg,
                    lambda name, path: adapters[name])
    for name in adapters:
        eng.pool.add(name, name)
    return eng


def recompute(eng: LLMEngine, prompt: list[int], adapter, p: SamplingParams) -> tuple[list[int], str]:
    """Greedy, one whole-sequence forward a token: bias, penalties, then the format's mask (a fresh matcher)."""
    grammars = eng.grammars()
    matcher = grammars.matcher(p.structured) if p.structured is not None else None
    outs: list[int] = []
    while len(outs) < p.max_tokens:
        last = eng.prompt_logits([prompt + outs], [adapter])[0][-1].float().clone()
        for t, b in p.logit_bias:
            last[t] += b
        last = reference_row(last, prompt, outs, p)
        if matcher is not None:
            last[~grammars.allowed([matcher], torch.device("cpu"))[0]] = float("-inf")
        tok = int(last.argmax())
        outs.append(tok)
        if matcher is not None:
            assert matcher.accept_token(tok)
        if (tok in eng.eos and not p.ignore_eos) or tok in p.stop_token_ids:
            return outs, "stop"
    return outs, "length"


def fuzz_case(model, tokenizer, adapters, seed: int) -> tuple[int, int, bool, int]:
    """One random engine and workload, checked; (preemptions, aborts, overlapped, completed formats)."""
    rng = random.Random(seed)
    eng = make_engine(model, tokenizer, adapters, rng)
    shared = [rng.randrange(32, 127) for _ in range(rng.randrange(2, 9))]
    reqs, patterns, abort_after = [], {}, {}
    for _ in range(9):
        prompt = (shared if rng.random() < 0.5 else []) + [rng.randrange(32, 127) for _ in range(rng.randrange(1, 9))]
        if rng.random() < 0.6:
            kind, value, pattern = rng.choice(FORMATS)
            params = SamplingParams(max_tokens=rng.randrange(4, 14), temperature=0,
                                    structured=StructuredOutput.of(kind, value),
                                    repetition_penalty=rng.choice([1.0, 1.3]))
        else:
            pattern = None
            kw = dict(max_tokens=rng.randrange(1, 9), temperature=0, ignore_eos=True)
            if rng.random() < 0.3:
                kw["stop_token_ids"] = (rng.randrange(97, 123),)
            if rng.random() < 0.3:
                kw.update(frequency_penalty=1.0, repetition_penalty=1.3)
            if rng.random() < 0.3:
                kw["logit_bias"] = {rng.randrange(32, 127): rng.choice([-100.0, 3.0])}
            params = SamplingParams(**kw)
        r = eng.add_request(prompt, params, rng.choice([None, "x", "y"]))
        reqs.append(r)
        patterns[r.request_id] = pattern
        if rng.random() < 0.12:
            abort_after[r.request_id] = rng.randrange(0, 5)
    step_with_aborts(eng, abort_after)
    completed = 0
    for r in reqs:
        if r.finish_reason == "abort":
            continue
        want, reason = recompute(eng, r.prompt_ids, r.adapter, r.params)
        assert (r.output_ids, r.finish_reason) == (want, reason), (seed, r.request_id, r.text)
        pattern = patterns[r.request_id]
        if pattern is not None and r.finish_reason == "stop":
            assert re.fullmatch(pattern, r.text), (seed, r.text)
            completed += 1
    assert eng.cache.allocator.num_used == 0
    aborted = sum(r.finish_reason == "abort" for r in reqs)
    return sum(r.num_preemptions for r in reqs), aborted, eng.cfg.async_scheduling, completed


SEEDS = range(10)


@pytest.fixture(scope="module")
def fuzz_stats(byte_model):
    return {seed: fuzz_case(*byte_model, seed) for seed in SEEDS}


@pytest.mark.parametrize("seed", SEEDS)
def test_constrained_workloads_equal_recomputation(fuzz_stats, seed):
    assert seed in fuzz_stats  # each case asserted its own outputs while the fixture ran it


def test_the_fuzz_reaches_preemption_aborts_overlap_and_completed_formats(fuzz_stats):
    stats = list(fuzz_stats.values())
    assert any(p > 0 for p, _, _, _ in stats) and any(a > 0 for _, a, _, _ in stats)
    assert any(o for _, _, o, _ in stats) and not all(o for _, _, o, _ in stats)
    assert sum(c for _, _, _, c in stats) >= 10
