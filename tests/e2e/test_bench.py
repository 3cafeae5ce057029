"""`moelora bench` (moelora/bench.py) on the bundled demo model, on the CPU: every workload at every
concurrency is timed, a run that could not decode all its requests together is refused, and the engine
is left empty after every run (so the next workload starts from a clean cache)."""

from __future__ import annotations

import json

import pytest
import torch

from moelora import LLM
from moelora.bench import bench, format_runs, time_decode, time_prefill, workloads
from moelora.cli import main
from moelora.demo import ADAPTER_NAMES, adapter_dir, model_dir
from moelora.errors import CapacityError, ConfigError


def demo_llm(device: str = "cpu", **kw) -> LLM:
    return LLM(str(model_dir()), {n: str(adapter_dir(n)) for n in ADAPTER_NAMES}, device=device, **kw)


def assert_empty(eng) -> None:
    assert not eng.requests and not eng.has_unfinished()
    assert eng.cache.allocator.num_free == eng.cache.allocator.num_blocks


def test_workloads_of_the_registered_adapters():
    assert workloads([]) == [("base", [None])]
    assert workloads(["a"]) == [("base", [None]), ("1 adapter", ["a"])]
    assert workloads(["a", "b", "c"])[2] == ("3 adapters", ["a", "b", "c"])


def test_cli_times_every_workload_at_every_concurrency(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "--device", "cpu", "--conc", "1,3", "--steps", "3", "--repeats", "1", "--prompt-len", "8",
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "vs base" in printed and "3 adapters" in printed
    got = json.loads(out.read_text())
    assert got["device"] == "cpu" and got["adapters"] == sorted(ADAPTER_NAMES) and got["steps"] == 3
    runs = {(r["conc"], r["workload"]): r for r in got["runs"]}
    assert set(runs) == {(c, w) for c in (1, 3) for w in ("base", "1 adapter", "3 adapters")}
    for (conc, _), r in runs.items():
        assert r["step_ms"] > 0 and r["prefill_ms"] > 0
        assert r["tokens_per_s"] == pytest.approx(conc / (r["step_ms"] / 1e3))


@pytest.mark.parametrize("overlapped", [False, True], ids=["sync", "overlapped"])
def test_time_decode_leaves_the_engine_empty(overlapped):
    llm = demo_llm(max_num_seqs=4, async_scheduling=overlapped)
    eng = llm.engine
    prefill, step = time_decode(eng, [[5, 6, 7, 8]] * 3 + [[9, 10]], ["upper", None], 4)
    assert prefill > 0 and step > 0
    assert_empty(eng)
    runs = bench(eng, [2, 4], prompt_len=6, steps=2, repeats=2)
    assert [(r.conc, r.workload) for r in runs][:3] == [(2, "base"), (2, "1 adapter"), (2, "3 adapters")]
    assert len(runs) == 6 and "vs base" in format_runs(runs)
    assert_empty(eng)


def test_a_run_that_preempts_is_refused_not_timed():
    """4 requests of 16 + 24 tokens need 12 blocks of 16; the cache has 8: the scheduler preempts during the
    timed steps, so the per-step time would not be that of 4 requests decoding together."""
    llm = demo_llm(max_num_seqs=4, num_kv_blocks=8, block_size=16, max_model_len=128)
    eng = llm.engine
    with pytest.raises(CapacityError, match="did not all decode together"):
        time_decode(eng, [[3] * 16, [4] * 16, [5] * 16, [6] * 16], [None], 20)
    assert_empty(eng)
    time_decode(eng, [[3] * 16, [4] * 16], [None], 8)  # two of 16 + 12 tokens fit (2 x 2 blocks)


def test_limits_are_config_errors():
    eng = demo_llm(max_num_seqs=2).engine
    with pytest.raises(ConfigError, match="max_num_seqs"):
        bench(eng, [4], prompt_len=4, steps=2)
    with pytest.raises(ConfigError, match="steps"):
        time_decode(eng, [[1, 2]], [None], 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bench_replays_base_graphs_for_the_base_workload():
    """On CUDA (Triton kernels, decode graphs, overlapped scheduling): the base workload replays the graphs
    captured without LoRA, the adapter workloads the LoRA ones, and every run decodes all its requests."""
    eng = demo_llm("cuda", max_num_seqs=8).engine
    assert eng.graphs is not None and eng.cfg.async_scheduling
    runs = bench(eng, [1, 8], prompt_len=16, steps=8, repeats=1)
    assert len(runs) == 6 and all(r.step_s > 0 for r in runs)
    assert 0 < eng.graphs.base_replays < eng.graphs.replays
    assert_empty(eng)


def test_a_chunked_prefill_is_timed_once_every_request_decodes():
    """8 prompts of 32 tokens with a 64-token step budget: the prefill admits them over 4+ steps while the
    first ones already decode, so they hold more tokens than the timed steps when the timing starts; none may
    run out of its token budget inside the timed window (the bench gave them `steps` + 4 at first)."""
    eng = demo_llm(max_num_seqs=8, max_num_batched_tokens=64).engine
    prompts = [[10 + i] * 32 for i in range(8)]
    prefill, step = time_decode(eng, prompts, ["upper", None], 2)
    assert prefill > 0 and step > 0
    assert_empty(eng)
    with pytest.raises(ConfigError, match="max_model_len"):
        time_decode(eng, [[1] * 500], [None], 20)


@pytest.mark.parametrize("overlapped", [False, True], ids=["sync", "overlapped"])
def test_time_prefill_runs_every_prompt_to_its_token_and_leaves_the_engine_empty(overlapped):
    """5 prompts of 7 tokens, 8 tokens a step: the scheduler needs at least 5 steps (35 / 8), and each request
    gets exactly its one token (max_tokens 1: no decode step is timed)."""
    llm = demo_llm(max_num_seqs=4, max_num_batched_tokens=8, async_scheduling=overlapped)
    eng = llm.engine
    seen = []
    add = eng.add_request

    def spy(*a, **kw):
        seen.append(add(*a, **kw))
        return seen[-1]

    eng.add_request = spy
    secs, steps = time_prefill(eng, [[3, 4, 5, 6, 7, 8, 9]] * 5, ["upper", None])
    assert secs > 0 and steps >= 5
    assert [len(r.output_ids) for r in seen] == [1] * 5 and [r.adapter for r in seen[:2]] == ["upper", None]
    assert_empty(eng)


def test_time_prefill_refuses_a_prompt_with_no_room_for_its_token():
    eng = demo_llm(max_model_len=16).engine
    with pytest.raises(ConfigError, match="max_model_len"):
        time_prefill(eng, [[1] * 16], [None])
    assert_empty(eng)
