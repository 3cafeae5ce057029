"""benchmarks/serve.py on the bundled demo, on the CPU: a few streamed requests over the base and two
adapters, at a Poisson rate and all at once; the report has vLLM's serving-benchmark fields, the counts
add up (ignore_eos: every request gets its output length), and the launcher serves a model directory with
`moelora serve` arguments passed through. benchmarks/serve_model.py's assets load as adapters of their
model shape."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")  # the server's packages: a GPU image may lack them

from moelora.demo import ADAPTER_NAMES, adapter_dir, model_dir
from moelora.engine.config import EngineConfig
from moelora.server.launch import build_server
from tests.helpers.scripts import load_script
from tests.helpers.server import serving

serve_bench = load_script("benchmarks/serve.py")
serve_model = load_script("benchmarks/serve_model.py")

VLLM_KEYS = ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens", "request_throughput",
             "output_throughput", "total_token_throughput", *(f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el")
                                                              for s in ("mean", "median", "std", "p99")))


@pytest.fixture(scope="module")
def demo_server():
    if not (model_dir() / "model.safetensors").is_file():
        pytest.skip("the bundled demo model is not built yet")
    cfg = EngineConfig(device="cpu", max_num_seqs=16, async_scheduling=True)
    app = build_server(model_dir(), {n: str(adapter_dir(n)) for n in ADAPTER_NAMES}, cfg, ["moelora-demo"])
    with serving(app) as url:
        yield url, app


def test_a_rate_sweep_over_mixed_models_reports_vllm_metrics(demo_server, tmp_path, capsys):
    url, app = demo_server
    models = ["moelora-demo", *ADAPTER_NAMES[:2]]
    out = tmp_path / "bench.json"
    got = serve_bench.main(["--base-url", url, "--models", ",".join(models), "--models", models[0],
                            "--num-prompts", "6", "--request-rate", "40,inf", "--input-len", "12", "--output-len", "5",
                            "--vocab-size", "256", "--json", str(out)])
    printed = capsys.readouterr().out
    for line in ("Serving Benchmark Result", "Successful requests:", "Request throughput (req/s):",
                 "Output token throughput (tok/s):", "Total Token throughput (tok/s):", "Mean TTFT (ms):",
                 "Median TPOT (ms):", "P99 ITL (ms):", "first request after ready: TTFT", "probe request: TTFT"):
        assert line in printed, line
    assert json.loads(out.read_text()) == json.loads(json.dumps(got))
    assert [w["models"] for w in got["workloads"]] == [models, models[:1]] and got["first_request_ttft_ms"] > 0
    assert [r["request_rate"] for r in got["workloads"][0]["runs"]] == [40.0, "inf"]
    for run in got["workloads"][0]["runs"]:
        assert all(k in run for k in VLLM_KEYS)
        assert run["completed"] == 6 and run["failed"] == 0 and not run["errors"]
        assert run["total_input_tokens"] == 6 * 12 and run["total_output_tokens"] == 6 * 5
        assert run["output_throughput"] == pytest.approx(30 / run["duration"])
        assert 0 < run["median_ttft_ms"] <= run["p99_ttft_ms"] and run["mean_tpot_ms"] > 0
        assert run["mean_e2el_ms"] >= run["mean_ttft_ms"]
        assert {m: r["completed"] for m, r in run["per_model"].items()} == {m: 2 for m in models}  # round robin
    assert [r["completed"] for r in got["workloads"][1]["runs"]] == [6, 6]
    assert app.state.engine.stats.kv_used == 0


def test_score_mode_sends_loglikelihood_requests(demo_server):
    """`--score`: echo + logprobs 1 + max_tokens 1, every prompt token scored (its echo the first chunk)."""
    url, _ = demo_server
    got = serve_bench.main(["--base-url", url, "--models", "moelora-demo", "--num-prompts", "5", "--request-rate",
                            "inf", "--input-len", "9", "--vocab-size", "256", "--score"])
    run = got["workloads"][0]["runs"][0]
    assert got["score"] and run["completed"] == 5 and run["failed"] == 0
    assert run["total_input_tokens"] == 5 * 9 and run["total_output_tokens"] == 5
    plan = serve_bench.make_plan(["m"], 2, 9, 7, 256, 0, score=True)
    assert plan.score and plan.output_lens == [1, 1]


def test_structured_fraction_holds_that_share_of_requests(demo_server, monkeypatch):
    """`--structured-fraction`: that share of the requests held to `output_len - 1` letters then EOS (the same token
    count as the free ones); the prompts and models are the run's without formats."""
    from moelora.engine.engine import LLMEngine

    url, _ = demo_server
    formats, real = [], LLMEngine.add_request

    def add_request(self, prompt, params, *args, **kw):
        formats.append(params.structured and (params.structured.kind, params.structured.spec))
        return real(self, prompt, params, *args, **kw)
    monkeypatch.setattr(LLMEngine, "add_request", add_request)
    got = serve_bench.main(["--base-url", url, "--models", "moelora-demo", "--num-prompts", "8", "--request-rate",
                            "inf", "--input-len", "6", "--output-len", "5", "--vocab-size", "256",
                            "--structured-fraction", "0.5"])
    run = got["workloads"][0]["runs"][0]
    plan = serve_bench.make_plan(["moelora-demo"], 8, 6, 5, 256, 0, structured=0.5)
    assert run["structured_requests"] == sum(plan.held) and 0 < sum(plan.held) < 8
    assert run["completed"] == 8 and run["failed"] == 0 and run["total_output_tokens"] == 8 * 5
    free = serve_bench.make_plan(["moelora-demo"], 8, 6, 5, 256, 0)
    assert free.prompts == plan.prompts and free.held == () and plan.request(0)[:4] == free.request(0)[:4]
    assert len(formats) == 1 + 8 and formats[0] == ("regex", "[a-z ]{4}")  # the probe, then the run (any order)
    assert sum(f is not None for f in formats[1:]) == sum(plan.held)
    assert {f for f in formats if f is not None} == {("regex", "[a-z ]{4}")}


def test_plan_arrivals_and_percentiles():
    plan = serve_bench.make_plan(["a", "b"], 5, 10, 4, vocab=50, seed=3, range_ratio=0.5, order="random")
    assert len(plan.prompts) == 5 and all(5 <= len(p) <= 15 and max(p) < 50 for p in plan.prompts)
    assert set(plan.models) <= {"a", "b"} and all(2 <= n <= 6 for n in plan.output_lens)
    assert plan == serve_bench.make_plan(["a", "b"], 5, 10, 4, vocab=50, seed=3, range_ratio=0.5, order="random")
    gaps = serve_bench.arrival_gaps(4000, rate=20.0, burstiness=1.0, seed=1)
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 20, rel=0.1)
    assert serve_bench.arrival_gaps(3, float("inf"), 1.0, 0) == [0.0] * 3
    assert serve_bench._percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5  # numpy.percentile's linear rule
    assert serve_bench._percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)


def test_the_launcher_serves_a_model_dir_with_serve_args_passed_through(tmp_path):
    if not (model_dir() / "model.safetensors").is_file():
        pytest.skip("the bundled demo model is not built yet")
    name = ADAPTER_NAMES[0]
    got = serve_bench.main(["--model", str(model_dir()), "--lora-modules", f"{name}={adapter_dir(name)}",
                            "--num-prompts", "2", "--input-len", "4", "--output-len", "3",
                            "--", "--device", "cpu", "--skip-warmup", "--served-model-name", "demo"])
    assert got["workloads"][0]["models"] == ["demo", name] and got["workloads"][0]["runs"][0]["completed"] == 2
    assert got["serve_args"] == ["--device", "cpu", "--skip-warmup", "--served-model-name", "demo"]


def test_serve_model_assets_are_valid_adapters_of_their_shape(tmp_path):
    from moelora.config import ModelConfig
    from moelora.engine.tokenizer import Tokenizer
    from moelora.lora.loader import load_adapter

    model, adapters = serve_model.write_assets(tmp_path, "qwen3_30b", 1, 2, 16)
    cfg = ModelConfig.from_hf(model)
    assert (cfg.hidden_size, cfg.num_experts, cfg.top_k, cfg.vocab_size, cfg.num_layers) == (2048, 128, 8, 151936, 1)
    tok = Tokenizer(model)
    assert tok.vocab_size == 151936 and tok.decode([151935, 104, 105]) == "<t151935>hi"
    for name, path in adapters.items():
        a = load_adapter(path, cfg, name=name, max_rank=16)
        assert a.max_rank == 16 and len(a.sites) == 6  # q, k, v, o and the experts' gate_up and down
    serve_model.write_adapter(tmp_path / "light", json.loads((model / "config.json").read_text()), 8, 0, experts=False)
    assert len(load_adapter(tmp_path / "light", cfg, name="a0", max_rank=16).sites) == 4
