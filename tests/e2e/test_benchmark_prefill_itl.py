"""benchmarks/prefill.py --itl (benchmarks/prefill_itl.py): decodes keep running while long prompts arrive, on the
CPU with a tiny model in place of the GPU-sized one; and the percentile it reports."""

from __future__ import annotations

import csv
import sys

import torch

from tests.helpers.prefill_bench import cpu_engine, tiny_model
from tests.helpers.scripts import load_script

prefill = load_script("benchmarks/prefill.py", skip_missing=True)  # needs triton importable (the kernels' module)
decode = load_script("benchmarks/decode.py", skip_missing=True)
itl = load_script("benchmarks/prefill_itl.py", skip_missing=True)


def test_percentile_interpolates_between_ranks():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert itl.percentile(xs, 0) == 1.0 and itl.percentile(xs, 100) == 4.0
    assert itl.percentile(xs, 50) == 2.5
    assert itl.percentile(list(range(101)), 99) == 99.0


def test_an_itl_run_gives_every_decode_a_token_each_step_while_the_prompts_last(tmp_path, monkeypatch):
    monkeypatch.setattr(prefill, "model_with_adapters", tiny_model)
    monkeypatch.setattr(prefill, "no_lora_twin", lambda model, cfg, quant=None: decode.no_lora_twin(model, cfg, quant))
    monkeypatch.setattr(prefill, "engine", cpu_engine)
    monkeypatch.setattr(prefill, "matmul_tflops", lambda: 1.0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "cpu")
    built, runs = [], []
    real_build, real_time = prefill.build_engines, itl.time_itl
    monkeypatch.setattr(prefill, "build_engines", lambda *a, **kw: built.append(real_build(*a, **kw)) or built[-1])
    monkeypatch.setattr(itl, "time_itl", lambda *a, **kw: runs.append(real_time(*a, **kw)) or runs[-1])
    out = tmp_path / "prefill.csv"
    monkeypatch.setattr(sys, "argv", ["prefill.py", str(out), "--prompts", "20", "--tokens", "40", "--chunk", "32",
                                      "--repeats", "1", "--itl", "3", "--itl-chunk", "16,32", "--itl-len", "40",
                                      "--itl-prompts", "2", "--itl-decode-len", "4", "--itl-quiet", "3",
                                      "--profile", "--profile-len", "20", "--profile-tokens", "40",
                                      "--profile-workloads", "8 adapters"])
    prefill.main()
    rows = list(csv.DictReader((tmp_path / "prefill_itl.csv").open()))
    assert [(int(r["chunk"]), r["config"]) for r in rows] == [(c, w) for c in (16, 32) for w in itl.ITL_WORKLOADS]
    # 80 prompt tokens, 13 / 29 of them a step beside the 3 decodes, then a step that only reads back (overlapped)
    assert [int(r["steps"]) for r in rows] == [7 + 1, 7 + 1, 3 + 1, 3 + 1]
    for r in rows:
        assert 0 < float(r["itl_p50_ms"]) <= float(r["itl_p99_ms"]) <= float(r["itl_max_ms"])
        assert float(r["quiet_p50_ms"]) > 0 and float(r["prefill_tokens_per_s"]) > 0
    for run in runs[1::2]:  # the timed runs (each after its warm-up): 3 gaps a quiet step, 3 a mixed step
        assert len(run["quiet"]) == 3 * 3 and len(run["mixed"]) >= 3 * (run["steps"] - 1)
    text = (tmp_path / "prefill_profile.txt").read_text()  # the table, the ITL table, one workload's profile
    assert "ITL p50" in text and text.count("host ms a call") == 1 and "profile: 8 adapters: kernels" in text
    _, by_chunk = built[0]
    assert set(by_chunk) == {16, 32}  # --chunk's and --itl-chunk's
    for chunk, engines in by_chunk.items():
        for _, eng, _ in engines:
            assert not eng.requests and eng.cache.allocator.num_free == eng.cache.allocator.num_blocks
            assert eng.cfg.max_num_batched_tokens == chunk and eng.cfg.max_num_seqs >= 3 + 2
