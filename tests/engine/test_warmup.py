"""Start-up warm-up (engine/warmup.py): it runs the shapes a step can have (every token-count class, LoRA
widths, extends, eager decodes, the sampler's paths), leaves no trace (blocks, free-list order, prefix
cache, adapter pool, RNG), changes no later output; the server reports ready only after it."""

from __future__ import annotations

import random
import threading

import pytest
import torch

httpx = pytest.importorskip("httpx")  # the server's test helpers need the server's packages

import moelora.server.async_engine as async_engine  # noqa: E402
from moelora.engine.request import SamplingParams  # noqa: E402
from moelora.engine.warmup import _step, _untouched, lora_widths, token_counts, warm_up  # noqa: E402
from tests.helpers.models import build, build_from_architecture, engine, random_adapter  # noqa: E402
from tests.helpers.oracle import tiny_hf_model  # noqa: E402
from tests.helpers.server import ADAPTERS, TIMEOUT, make_assets, make_client, running_server  # noqa: E402
from tests.helpers.specialization import recording_launches  # noqa: E402


def test_token_counts_take_every_divisibility_class_of_every_range():
    # ranges (0,1] (1,2] (2,4] (4,8] (8,16] (16,20]; per range the largest odd, 2, 4, 8 mod 16 and 0 mod 16 count
    assert token_counts(20) == [1, 2, 3, 4, 6, 7, 8, 12, 14, 15, 16, 18, 19, 20]
    counts = token_counts(300)
    for t in range(1, 301):  # every count shares its range and class with a warmed one
        rng, cls = (t - 1).bit_length(), min(4, (t & -t).bit_length() - 1)
        assert any((c - 1).bit_length() == rng and min(4, (c & -c).bit_length() - 1) == cls for c in counts), t
    assert token_counts(1) == [1]


@pytest.fixture(scope="module")
def setup():
    model = build(tiny_hf_model("qwen3_moe", seed=7), max_loras=2, max_rank=32)
    adapters = {"x": random_adapter(model, 20, 6), "y": random_adapter(model, 21, 24, frac=0.6)}
    return model, adapters


def test_warm_up_runs_every_shape_and_leaves_no_trace(setup):
    model, adapters = setup
    kw = dict(max_loras=2, max_lora_rank=32, async_scheduling=True, max_num_batched_tokens=40, max_num_seqs=5,
              num_kv_blocks=200, max_model_len=96)
    eng = engine(model, adapters, **kw)
    assert lora_widths(eng) == [16, 32]  # ranks 6 and 24: tiles of 16 and 32 columns
    seen = []
    run = eng.runner.run

    def recording(inputs, **k):
        meta = inputs.meta
        width = inputs.lora.max_rank if inputs.lora is not None else None
        seen.append((inputs.input_ids.shape[0], meta.max_query_len, meta.block_tables.shape[1], width))
        return run(inputs, **k)

    eng.runner.run = recording
    alloc, pool = eng.cache.allocator, eng.pool
    free_before, rng_before = list(alloc._free), torch.get_rng_state()
    pool_before = (pool.loads, pool.evictions, dict(pool._slot_of), list(pool._slot_lru), list(pool._cpu))
    done = warm_up(eng, small=False)
    assert done["forwards"] == len(seen) - 9  # and 9 sampler batches (each path alone, then all together)
    for width in (None, 16, 32):
        tokens = {t for t, _, _, w in seen if w == width}
        assert set(token_counts(40)) <= tokens, width  # every prefill class
        assert {b for t, q, b, w in seen if w == width and q == 1} >= {1, 3, 16}  # eager decodes over 1..16 blocks
        for q in (16, 32):  # extends: each attention query class over block tables of each stride class
            strides = {b for t, qq, b, w in seen if w == width and qq == q}
            assert any(b % 16 == 0 for b in strides) and any(b % 16 and b > 1 for b in strides), (q, strides)
        assert set(token_counts(5)) <= {t for t, q, b, w in seen if w == width and q == 1}
    eng.check_blocks()
    assert alloc._free == free_before and not alloc._cached and torch.equal(torch.get_rng_state(), rng_before)
    assert (pool.loads, pool.evictions, dict(pool._slot_of), list(pool._slot_lru), list(pool._cpu)) == pool_before
    assert not eng.requests and not eng.has_unfinished() and eng.scheduler.served == {}
    # what the engine computes afterwards is what a fresh engine computes
    eng.runner.run = run
    fresh = engine(model, adapters, **kw)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [7] * 20]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
    outs = []
    for e in (eng, fresh):
        reqs = [e.add_request(p, params, a) for p, a in zip(prompts, ["x", None, "y"], strict=True)]
        while e.has_unfinished():
            e.step()
        outs.append([(r.output_ids, [lp[0] for lp in r.logprobs]) for r in reqs])
    for (ids, lps), (want_ids, want_lps) in zip(outs[0], outs[1], strict=True):
        assert ids == want_ids and lps == pytest.approx(want_lps, abs=1e-5)


def test_warm_up_replays_each_piecewise_bucket_once_a_width(setup):
    """With piecewise graphs (a stand-in recording its runs: the CPU has no graphs), each bucket runs one prefill
    of its size through them on no adapter and at the widest width they hold; their replay count is put back."""
    model, adapters = setup
    eng = engine(model, adapters, max_loras=2, max_lora_rank=32, max_num_batched_tokens=40, max_model_len=96,
                 num_kv_blocks=200)

    class Pieces:
        buckets, replays, seen = [16, 40], 7, []

        def holds(self, width):
            return width <= 16

        def run(self, inputs):
            self.seen.append((inputs.input_ids.shape[0], inputs.lora.max_rank if inputs.lora is not None else None))
            self.replays += 1
            return eng.runner.run(inputs)

    eng.pieces = Pieces()
    warm_up(eng, small=True)
    assert eng.pieces.seen == [(16, None), (40, None), (16, 16), (40, 16)] and eng.pieces.replays == 7
    eng.check_blocks()


def test_warm_up_refuses_a_busy_engine(setup):
    model, adapters = setup
    eng = engine(model, adapters)
    eng.add_request([5, 6, 7], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="idle"):
        warm_up(eng)


def test_server_reports_ready_only_after_the_warm_up(tmp_path, monkeypatch):
    """/health is 503 while the warm-up runs (a request sent meanwhile waits, then is served), 200 after;
    the warm-up runs by default and `warmup=False` skips it."""
    gate, calls = threading.Event(), []

    def gated(eng, *a, **k):
        calls.append(eng)
        assert gate.wait(TIMEOUT)
        return warm_up(eng, *a, **k)

    monkeypatch.setattr(async_engine, "warm_up", gated)
    model_dir, adapters = make_assets(tmp_path)
    app_seen = {}
    monkeypatch.setattr("tests.helpers.server.serving", _serving_without_waiting(app_seen))
    with running_server(model_dir, {n: adapters[n] for n in ADAPTERS[:1]}) as (url, app):
        health = httpx.get(url + "/health", timeout=TIMEOUT)
        assert health.status_code == 503 and "warming up" in health.json()["error"]["message"]
        assert health.headers["retry-after"] == "1"
        result = {}
        early = threading.Thread(target=lambda: result.update(r=make_client(url).completions.create(
            model=ADAPTERS[0], prompt="abc", max_tokens=3, temperature=0)))
        early.start()
        early.join(0.5)
        assert early.is_alive()  # queued behind the warm-up
        gate.set()
        early.join(TIMEOUT)
        assert result["r"].usage.completion_tokens >= 1
        assert httpx.get(url + "/health", timeout=TIMEOUT).status_code == 200
        assert len(calls) == 1 and app.state.engine.stats.kv_used == 0 and app.state.engine.warmup["forwards"] > 0
    calls.clear()
    with running_server(model_dir, {}, warmup=False) as (url, _):
        assert httpx.get(url + "/health", timeout=TIMEOUT).status_code == 200 and not calls


def _serving_without_waiting(seen):
    """test_server.serving without its wait for /health 200 (this test looks at the 503 itself)."""
    import socket
    import time
    from contextlib import contextmanager

    import uvicorn

    @contextmanager
    def serving(app):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=2))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline
            time.sleep(0.02)
        host, port = sock.getsockname()
        try:
            yield f"http://{host}:{port}"
        finally:
            server.should_exit = True
            thread.join(15)
            sock.close()
    return serving


def test_serve_skip_warmup_flag():
    from moelora.cli import build_parser, serve_engine_config

    assert serve_engine_config(build_parser().parse_args(["serve"])).warmup is True
    assert serve_engine_config(build_parser().parse_args(["serve", "--skip-warmup"])).warmup is False


def _new_specializations(eng, budget: int, trials: int, widths: tuple) -> dict:
    """{kernel: first step} of the launches whose specialization (`tests/helpers/specialization.py`, the kernels
    skipped) no launch of the warm-up had, over `trials` random steps of up to `budget` tokens (prompts of random
    lengths, fresh or over a cached context, beside 0-8 decodes) at each LoRA width of `widths`."""
    seen: dict = {}
    phase = ["warm-up"]
    with recording_launches(lambda key: seen.setdefault(key, phase[0])):
        warm_up(eng, small=False)
        rng = random.Random(0)
        with _untouched(eng) as scratch:
            for _ in range(trials):
                t = rng.randint(1, budget)
                decodes = rng.randint(0, min(8, t - 1))
                seqs, left = [], t - decodes
                while left:
                    n = min(left, rng.choice([rng.randint(1, 64), rng.randint(1, budget)]))
                    seqs.append((rng.choice([0, 0, rng.randint(1, budget // 2)]), n))
                    left -= n
                seqs += [(rng.randint(1, budget), 1) for _ in range(decodes)]
                for width in widths:
                    phase[0] = f"{t} tokens {seqs[:3]}... ({decodes} decodes), LoRA width {width}"
                    assert _step(scratch, seqs, width) is not None, phase[0]  # the cache holds every trial
    return {key[0]: step for key, step in seen.items() if step != "warm-up"}


@pytest.mark.interp
@pytest.mark.parametrize("family,experts,top_k,budget,trials", [
    ("qwen3_moe", 128, 8, 8192, 40), ("deepseek_v3", 64, 6, 2048, 30)])
def test_after_the_warm_up_no_step_compiles_a_kernel(family, experts, top_k, budget, trials):
    """No step after the warm-up needs a kernel variant it did not compile: on a GPU each costs every request in
    flight 0.1-1.5 s (the H100's first burst of 24 prompts beside 2 decodes waited 1.0 s on `_plan_scan_kernel`,
    whose chunk count's divisibility by 16 is not T's). DeepSeek-V3's MLA with LoRA expands every cached row of a
    step through kv_b_proj at once: row counts past the budget (the contexts' sum), which its warm-up's long
    extends cover."""
    sizes = dict(num_experts=experts) if family == "qwen3_moe" else dict(n_routed_experts=experts)
    hf = tiny_hf_model(family, seed=7, num_experts_per_tok=top_k, max_position_embeddings=4 * budget, **sizes)
    model = build_from_architecture(hf, max_loras=2, max_rank=16)
    eng = engine(model, {"x": random_adapter(model, 20, 8)}, max_loras=2, max_lora_rank=16, kernel_backend="triton",
                 max_num_batched_tokens=budget, max_num_seqs=64, block_size=16, num_kv_blocks=2 * budget,
                 max_model_len=2 * budget)
    new = _new_specializations(eng, budget, trials, (None, 16))
    assert not new, f"compiled after the warm-up (kernel: first step): {new}"


@pytest.mark.interp
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_after_the_warm_up_no_fp8_step_compiles_a_kernel(tmp_path, family):
    """The same on FP8 W8A8 projections (a bf16 engine quantizing a checkpoint of 128-wide blocks on load)."""
    from moelora.engine.config import EngineConfig
    from moelora.engine.loader import build_engine

    sizes = dict(hidden_size=256, moe_intermediate_size=256, intermediate_size=256)
    sizes.update(dict(head_dim=128, num_experts=128, num_experts_per_tok=8) if family == "qwen3_moe" else
                 dict(qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64, n_routed_experts=64,
                      num_experts_per_tok=6))
    tiny_hf_model(family, seed=7, num_hidden_layers=2, max_position_embeddings=8192, **sizes).save_pretrained(tmp_path)
    eng = build_engine(tmp_path, EngineConfig(device="cpu", dtype="bfloat16", kernel_backend="triton",
                                              quantization="fp8", max_num_batched_tokens=2048, max_num_seqs=64,
                                              block_size=16, num_kv_blocks=4096, max_model_len=4096, warmup=False))
    new = _new_specializations(eng, 2048, 20, (None,))
    assert not new, f"compiled after the warm-up (kernel: first step): {new}"
