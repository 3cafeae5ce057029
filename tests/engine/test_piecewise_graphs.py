"""Piecewise graphs (`engine/piecewise_graphs.py`): the buckets, when they are on, and, under Triton's interpreter
on the CPU, a whole engine whose steps with prompt rows replay the pieces equal the eager engine.

The CPU has no CUDA graphs: the interpreter tests capture each piece with `ReplayByCall`, which runs the piece
once when captured and again at every replay. What it checks is what a graph's replay depends on: every input
of a step reaches the pieces through the static buffers (ids, positions, slot mapping, adapter slots: a step
whose values did not would replay the capture's), padding rows change nothing, the eager attention between
pieces reads the state the piece before left and hands its output to the next one, and the LoRA plan is the
step's own. What it cannot check -- a host branch frozen at capture, an allocation or sync inside one -- the GPU
tests (`test_gpu_engine.py`) check with real graphs.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from moelora.engine.config import EngineConfig
from moelora.engine.piecewise_graphs import PiecewiseGraphs, piecewise_tokens, token_buckets
from moelora.errors import ConfigError
from tests.helpers.gpu_engine import staggered
from tests.helpers.kernel_env import interp_only
from tests.helpers.models import build, build_from_architecture, config_of, engine, random_adapter
from tests.helpers.oracle import randomize_, tiny_hf_model


def test_buckets():
    assert token_buckets(512) == [16, 32, 64, 128, 256, 512]
    assert token_buckets(1000) == [16, 32, 64, 128, 256, 512, 768, 1000]
    assert token_buckets(96) == [16, 32, 64, 96]
    assert token_buckets(16) == [16]
    assert token_buckets(5) == [5]


def test_piecewise_tokens_follow_the_config():
    on = dict(use_cuda_graphs=True, tensor_parallel_size=1, piecewise_graph_tokens=512, max_num_batched_tokens=300)
    assert piecewise_tokens(SimpleNamespace(**on)) == 300  # within the step budget
    assert piecewise_tokens(SimpleNamespace(**{**on, "max_num_batched_tokens": 8192})) == 512
    for off in (dict(use_cuda_graphs=False), dict(piecewise_graph_tokens=0), dict(tensor_parallel_size=2)):
        assert piecewise_tokens(SimpleNamespace(**{**on, **off})) == 0, off


def test_negative_piecewise_tokens_are_refused():
    cfg = config_of(tiny_hf_model("qwen3_moe", seed=1))
    with pytest.raises(ConfigError, match="piecewise_graph_tokens must be >= 0"):
        EngineConfig(device="cpu", piecewise_graph_tokens=-1).resolve(cfg)
    assert piecewise_tokens(EngineConfig(device="cpu").resolve(cfg)) == 0  # the CPU has no CUDA graphs


class ReplayByCall:
    """A capturer standing in for CUDA graphs on the CPU: `capturer(fn)` runs fn once and returns (a graph whose
    `replay()` runs fn again, fn's outputs)."""

    def __call__(self, fn):
        class Graph:
            def replay(self):
                fn()
        return Graph(), fn()


@pytest.mark.interp
@interp_only
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_pieces_equal_the_eager_engine(family, monkeypatch):
    """Prompts arriving two at a time while others decode (chunked at 24 tokens a step), on two adapters of
    different ranks and on none: every step with prompt rows replays the pieces (buckets 16 and 24: padded
    and exact), with the same greedy tokens as the eager engine and logprobs within 1e-4 (fp32)."""
    if family == "qwen3_moe":
        model = build(tiny_hf_model(family, seed=51), max_loras=2, max_rank=8)
    else:
        hf = tiny_hf_model(family, seed=51)
        randomize_(hf, seed=51)
        model = build_from_architecture(hf, 2, 8, torch.float32)
    adapters = {"a": random_adapter(model, seed=52, rank=8), "b": random_adapter(model, seed=53, rank=4, frac=0.6)}
    g = torch.Generator().manual_seed(54)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (11, 7, 17, 6, 9, 2)]
    names = ["a", None, "b", "a", None, "b"]
    kw = dict(kernel_backend="triton", max_num_batched_tokens=24, async_scheduling=False)
    eager = engine(model, adapters, max_loras=2, **kw)
    pieced = engine(model, adapters, max_loras=2, **kw)
    assert_pieces_equal_eager(pieced, eager, prompts, names, monkeypatch)


@pytest.mark.interp
@interp_only
def test_scoring_through_the_pieces_equals_eager_scoring():
    """Prompt scoring (`engine/scoring.py`) runs its forwards through the pieces, as a prefill step would: every
    position's logprob, rank and top ids as the eager engine's (1e-4, fp32), forwards padded and exact, two
    adapters and none, a prompt longer than a forward chunked over its own KV."""
    model = build(tiny_hf_model("qwen3_moe", seed=51), max_loras=2, max_rank=8)
    adapters = {"a": random_adapter(model, seed=52, rank=8), "b": random_adapter(model, seed=53, rank=4, frac=0.6)}
    g = torch.Generator().manual_seed(55)
    items = [(torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist(), name, 3)
             for n, name in ((30, "a"), (7, None), (11, "b"), (5, "a"))]  # forwards of 24, 24, 5 rows
    kw = dict(kernel_backend="triton", max_num_batched_tokens=24, async_scheduling=False)
    want = engine(model, adapters, max_loras=2, **kw).prompt_logprobs_batch(items)
    eng = engine(model, adapters, max_loras=2, **kw)
    eng.pieces = PiecewiseGraphs(eng.model, eng.cache, 24, eng.cache.allocator.reserve(), eng.runner.needs,
                                 capture=ReplayByCall)
    eng.pieces.capture(eng.lora_idle, eng._graph_width)
    got = eng.prompt_logprobs_batch(items)
    assert eng.pieces.replays == 3
    for rows, ref in zip(got, want, strict=True):
        assert rows[0] == ref[0] == (None, None, ())
        for (lp, rank, top), (lp_ref, rank_ref, top_ref) in zip(rows[1:], ref[1:], strict=True):
            assert lp == pytest.approx(lp_ref, abs=1e-4) and rank == rank_ref
            assert [t for t, _ in top] == [t for t, _ in top_ref]
    eng.check_blocks()


def assert_pieces_equal_eager(eng, eager, prompts, names, monkeypatch):
    """`eng` given piecewise graphs of up to 24 tokens (`ReplayByCall`) runs the staggered requests with the same
    greedy tokens as `eager` and logprobs within 1e-4, through buckets padded and exact."""
    want = staggered(eager, prompts, names, 4)
    pad = eng.cache.allocator.reserve()
    eng.pieces = PiecewiseGraphs(eng.model, eng.cache, 24, pad, eng.runner.needs, capture=ReplayByCall)
    assert eng.pieces.buckets == [16, 24]
    eng.pieces.capture(eng.lora_idle, eng._graph_width)
    sizes = []
    run = eng.pieces.run

    def recorded(inputs):
        sizes.append(inputs.input_ids.shape[0])
        return run(inputs)

    monkeypatch.setattr(eng.pieces, "run", recorded)
    got = staggered(eng, prompts, names, 4)

    assert eng.pieces.replays == len(sizes) and any(n < 16 for n in sizes) and 24 in sizes
    assert any(16 < n < 24 for n in sizes), sizes  # a step padded to 24
    for a, b in zip(got, want, strict=True):
        assert a.output_ids == b.output_ids, (a.request_id, a.adapter)
        assert max(abs(x[0] - y[0]) for x, y in zip(a.logprobs, b.logprobs, strict=True)) <= 1e-4
    eng.check_blocks()


@pytest.mark.interp
@interp_only
def test_pieces_equal_the_eager_engine_on_w8a8_fp8(tmp_path, monkeypatch):
    """A block-FP8 Qwen3-MoE checkpoint under W8A8 with 128-wide heads: the norms inside the pieces write the
    quantized rows the projections read, the o projection (captured) quantizes the eager attention's output
    itself; the same tokens and logprobs as the eager engine."""
    from moelora import LLM
    from tests.helpers.fp8_models import QWEN_SIZES, SITES
    from tests.helpers.fp8_oracle import write_fp8_checkpoint
    from tests.helpers.oracle_lora import MLP, build_peft_adapter

    hf = tiny_hf_model("qwen3_moe", seed=8, **dict(QWEN_SIZES, head_dim=128))
    write_fp8_checkpoint(hf, tmp_path / "model", "block", "per_expert")
    peft = build_peft_adapter(hf, tmp_path / "peft", seed=2, target_modules=SITES["qwen3_moe"] + MLP)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, hf.config.vocab_size, (n,), generator=g).tolist() for n in (11, 7, 17, 6)]
    names = ["b", None, "b", None]

    def make():
        return LLM(tmp_path / "model", {"b": peft}, device="cpu", dtype="float32", max_lora_rank=8, max_loras=1,
                   kernel_backend="triton", fp8_activation_quant=True, max_num_batched_tokens=24,
                   async_scheduling=False).engine

    eng = make()
    assert eng.model.model.layers[0].fp8_inputs and eng.model.model.layers[0].self_attn.fp8_out
    assert_pieces_equal_eager(eng, make(), prompts, names, monkeypatch)
