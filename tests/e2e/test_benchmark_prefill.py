"""benchmarks/prefill.py: the FLOPs it counts a prompt token, and a whole run (timing, table, CSV, the
--profile report) on the CPU with a tiny model in place of the GPU-sized one."""

from __future__ import annotations

import csv
import sys

import pytest
import torch

from moelora.config import ModelConfig
from tests.helpers.prefill_bench import cpu_engine, tiny_model
from tests.helpers.scripts import load_script

# both need triton importable (the kernels' module imports it)
prefill = load_script("benchmarks/prefill.py", skip_missing=True)
decode = load_script("benchmarks/decode.py", skip_missing=True)


def test_flops_of_a_qwen3_30b_prompt_token():
    """Qwen3-30B-A3B at 2048-token prompts, counted by hand: ~6.27 GFLOP a token (issue 32: ~6.3)."""
    cfg = ModelConfig(**decode.QWEN3_30B).resolve()
    H, P = 2048, 2048
    projections = 2 * (H * 32 * 128 + 2 * H * 4 * 128 + 32 * 128 * H)
    attention = 32 * 2 * 128 * (P + 1)  # scores + values, 2 FLOPs a MAC over (P + 1) / 2 keys on average
    experts = 2 * 3 * H * 768 * 8 + 2 * H * 128  # 8 routed experts of 768, the router
    want = 48 * (projections + attention + experts) + 2 * H * 151936 / P
    assert prefill.prefill_flops(cfg, P) == pytest.approx(want, rel=1e-12)
    assert 6.2e9 < want < 6.3e9
    # a longer prompt costs attention alone more: 48 layers x 32 heads x 256 x 6144 more keys
    assert prefill.prefill_flops(cfg, 8192) - prefill.prefill_flops(cfg, P) == pytest.approx(
        48 * 32 * 256 * (8192 - 2048) + 2 * H * 151936 * (1 / 8192 - 1 / P), rel=1e-9)


def test_flops_of_a_deepseek_v2_lite_prompt_token_count_mla_and_its_dense_layer():
    cfg = ModelConfig(**decode.DSV2_LITE).resolve()
    H, P, N = 2048, 512, 16
    projections = 2 * (H * N * 192 + H * 576 + 512 * N * (128 + 128) + N * 128 * H)
    attention = N * (192 + 128) * (P + 1)
    sparse = 2 * 3 * H * (6 * 1408 + 2 * 1408) + 2 * H * 64
    dense = 2 * 3 * H * 10944
    want = 27 * (projections + attention) + 26 * sparse + dense + 2 * H * 102400 / P
    assert prefill.prefill_flops(cfg, P) == pytest.approx(want, rel=1e-12)


def test_a_run_times_every_workload_and_profiles_them(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(prefill, "model_with_adapters", tiny_model)
    monkeypatch.setattr(prefill, "no_lora_twin", lambda model, cfg, quant=None: decode.no_lora_twin(model, cfg, quant))
    monkeypatch.setattr(prefill, "engine", cpu_engine)
    monkeypatch.setattr(prefill, "matmul_tflops", lambda: 1.0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "cpu")
    built = []
    real_build = prefill.build_engines
    monkeypatch.setattr(prefill, "build_engines", lambda *a, **kw: built.append(real_build(*a, **kw)) or built[-1])
    out = tmp_path / "prefill.csv"
    monkeypatch.setattr(sys, "argv", ["prefill.py", str(out), "--prompts", "20,40", "--tokens", "80",
                                      "--chunk", "32,64", "--repeats", "1", "--profile", "--profile-len", "24",
                                      "--profile-tokens", "72"])
    prefill.main()
    rows = list(csv.DictReader(out.open()))
    assert [(int(r["chunk"]), int(r["prompt_len"]), int(r["requests"]), r["config"]) for r in rows] == [
        (c, p, 80 // p, w) for c in (32, 64) for p in (20, 40) for w in prefill.WORKLOADS]
    for r in rows:  # 80 prompt tokens at most `chunk` a step, and a last step that only reads back
        assert float(r["tokens_per_s"]) > 0 and int(r["steps"]) >= -(-80 // int(r["chunk"])) + 1
        assert float(r["tflops"]) == pytest.approx(float(r["tokens_per_s"]) * float(r["gflop_per_token"]) / 1e3)
    text = (tmp_path / "prefill_profile.txt").read_text()
    for label in prefill.WORKLOADS:
        assert f"profile: {label}, 3 prompts of 24 tokens" in text and f"profile: {label}: kernels" in text
    assert text.count("host ms a call") == 3 and text.count("cProfile of 3 forwards") == 3
    _, by_chunk = built[0]
    for chunk, engines in by_chunk.items():
        for _, eng, _ in engines:
            assert not eng.requests and eng.cache.allocator.num_free == eng.cache.allocator.num_blocks
            assert not eng.cfg.enable_prefix_caching and eng.cfg.max_num_batched_tokens == chunk


@pytest.mark.parametrize("graphs,want", [("off", dict(enforce_eager=True)),
                                         ("decode", dict(enforce_eager=False, piecewise_graph_tokens=0)),
                                         ("piecewise", dict(enforce_eager=False, piecewise_graph_tokens=96))])
def test_cuda_graphs_choice_reaches_every_engine(graphs, want, monkeypatch):
    """--cuda-graphs: the engine configs it asks for (the CPU has no graphs to capture: the configs are checked)."""
    monkeypatch.setattr(prefill, "model_with_adapters", tiny_model)
    monkeypatch.setattr(prefill, "no_lora_twin", lambda model, cfg, quant=None: decode.no_lora_twin(model, cfg, quant))
    monkeypatch.setattr(prefill, "engine", cpu_engine)
    _, by_chunk = prefill.build_engines("qwen3_30b", None, {20: 2}, [32], **prefill.graphs_kw(graphs, 96))
    engines = [eng for _, eng, _ in by_chunk[32]]
    assert len(engines) == 3
    for eng in engines:
        assert {k: getattr(eng.cfg, k) for k in want} == want
