"""GPU engine equivalences (contract 6): CUDA graphs vs eager, two streams vs one, the stream
sanitizer, no host sync in the forward, and a planted in-place race that the test must catch.

Each model test runs on a tiny Qwen2-MoE (gated shared expert) and a tiny DeepSeek-V3 (MLA attention
with its absorbed decode under CUDA graphs, grouped noaux_tc router, dense first layer, shared and
routed experts), with LoRA on every site of the DeepSeek model (every MLA projection included)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from moelora.engine.request import SamplingParams
from moelora.kernels.dense_policy import DenseLoRAPolicy
from moelora.layers.mla import MLAttention
from moelora.lora.adapter import LoRAAdapter
from tests.helpers.gpu_engine import (
    DSV3_SIZES,
    FAMILIES,
    decode_step_without_host_sync,
    forced_logprob_diff,
    generate,
    gpu_engine,
    logprob_diff,
    racy_and_safe,
    staggered,
    tiny_adapters,
    tiny_model,
    without_host_sync,
    workload,
)
from tests.helpers.kernel_env import planned_everywhere, record_planned_sites
from tests.helpers.models import build_from_architecture, random_adapter
from tests.helpers.oracle import tiny_hf_model
from tests.helpers.scripts import ROOT

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]



@pytest.fixture(scope="module", params=FAMILIES)
def model_and_adapters(request):
    model = tiny_model(request.param)
    return model, tiny_adapters(model, request.param)


def test_cuda_graph_decode_matches_eager(model_and_adapters):
    model, adapters = model_and_adapters
    prompts, names = workload()
    graphed = gpu_engine(model, adapters)
    assert graphed.graphs is not None
    reqs = generate(graphed, prompts, names, 256)
    assert all(len(r.output_ids) == 256 for r in reqs)
    assert forced_logprob_diff(gpu_engine(model, adapters, enforce_eager=True), reqs) <= 0.05


def test_piecewise_graphs_match_eager(model_and_adapters):
    """Steps with prompt rows replay the piecewise graphs (`EngineConfig.piecewise_graph_tokens`): prompts arriving
    two at a time while others decode, chunked at 96 tokens a step (buckets 16..96: padded steps and exact ones),
    on every adapter and on none; the same greedy tokens as the engine with the pieces off (decode graphs in both,
    the same steps), logprobs within 0.05."""
    model, adapters = model_and_adapters
    prompts, names = workload()
    eng = gpu_engine(model, adapters, max_num_batched_tokens=96)
    assert eng.pieces is not None and eng.pieces.buckets == [16, 32, 64, 96]
    reqs = staggered(eng, prompts, names, 32)
    assert eng.pieces.replays >= len(prompts) // 2  # every arrival's prefill at least
    off = gpu_engine(model, adapters, max_num_batched_tokens=96, piecewise_graph_tokens=0)
    assert off.pieces is None
    assert logprob_diff(reqs, staggered(off, prompts, names, 32)) <= 0.05


def test_scoring_beside_graphed_decodes(model_and_adapters):
    """Prompt scoring (`engine/scoring.py`: eager forwards of 64 tokens, logits 7 rows at a time, one sequence over
    several forwards) between the steps of graphed decodes over 4 adapters on 2 slots: the decodes' tokens as an
    engine's that never scored and the scores as an engine's that never decoded (logprobs within 0.05), and within
    0.1 of each sequence's logits from a forward of its own. That forward takes other kernels: its piecewise graph
    pads a short sequence to 16 tokens, the dense LoRA's rows path, where the 64-token forwards take the lanes. Two
    bf16 paths each about 0.05 from the fp32 engine (measured, H100, 54th session, `scripts/gpu_diag_scoring.py`:
    MiniMax-M2's 4-token sequence, the lanes 0.052 from fp32 and the rows path 0.008) may differ by twice that."""
    from tests.helpers.runs import scoring_beside_decodes

    model, adapters = model_and_adapters

    def make(**kw):
        eng = gpu_engine(model, adapters, max_loras=2, **{"max_num_batched_tokens": 64, **kw})
        eng.runner.logit_rows = 7
        return eng

    prompts, names = workload(n=10)
    seqs = workload(n=5, seed=1)[0] + [list(range(3, 203))]
    same, own = scoring_beside_decodes(make, prompts, names, seqs, ["a3", None, "a2", "a1", "a0", "a2"], 32)
    assert same <= 0.05 and own <= 0.1


def test_piecewise_step_has_no_host_sync(model_and_adapters):
    """Contract 5 for a step replaying the pieces: two prompts prefilled, then a step of their decodes beside two new
    prompts, prepared by hand and run (a second time: the first may re-capture for the adapters' sites) under
    `torch.cuda.set_sync_debug_mode("error")`, the eager attention between the pieces included."""
    model, adapters = model_and_adapters
    eng = gpu_engine(model, adapters, max_num_batched_tokens=96, async_scheduling=False)
    prompts, names = workload(n=4)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for p, a in zip(prompts[:2], names[:2], strict=True):
        eng.add_request(p, params, a)
    eng.step()
    for p, a in zip(prompts[2:], ["a0", "a2"], strict=True):
        eng.add_request(p, params, a)
    step = eng.scheduler.schedule()
    assert step.num_tokens > len(step.requests) > 2 and eng.pieces.can_run(step.num_tokens)
    inputs = eng.runner.prepare(step, eng.pool.acquire(r.adapter for r in step.requests), eng.pool.slot_ranks)
    eng.pieces.run(inputs)
    without_host_sync(lambda: eng.pieces.run(inputs))


def test_base_only_steps_replay_graphs_without_lora(model_and_adapters, request):
    """`base_decode_graphs`: a mixed wave of requests (its first step re-captures the graphs: this helper
    registers the adapters after the first capture, with every site idle), then a wave on no adapter. The
    base wave's steps replay the graphs captured without LoRA, the mixed wave's the LoRA graphs; every
    request matches the eager engine (whose base-only steps run the plain path too) token for token.
    Off: no base graphs, every step replays the LoRA graphs, the same tokens; their logprobs in fp32, where the
    LoRA graphs' and the plain path's rounding apart vanishes (H100, 54th session: 0.0 every family). In bf16 the
    two paths (other kernels for the same values) round apart: the tiny GLM-4-MoE's base wave reached 0.198 over
    31 greedy steps (`scripts/gpu_diag_base.py`; DeepSeek-V3 0.03), with the same tokens."""
    model, adapters = model_and_adapters
    prompts, names = workload(n=16, seed=5)

    def waves(eng):
        return generate(eng, prompts[8:], names[8:], 48) + generate(eng, prompts[:8], [None] * 8, 48)

    graphed = gpu_engine(model, adapters)
    reqs = waves(graphed)
    g = graphed.graphs
    assert len(g.base) == len(g.buckets) and 0 < g.base_replays < g.replays
    eager = waves(gpu_engine(model, adapters, enforce_eager=True))
    assert logprob_diff(reqs, eager) <= 0.05
    off = gpu_engine(model, adapters, base_decode_graphs=False)
    logprob_diff(waves(off), eager)  # the tokens
    assert not off.graphs.base and off.graphs.base_replays == 0 and off.graphs.replays == g.replays
    family = request.node.callspec.params["model_and_adapters"]
    model32 = tiny_model(family, dtype=torch.float32)
    adapters32 = tiny_adapters(model32, family)
    eager32 = waves(gpu_engine(model32, adapters32, dtype="float32", enforce_eager=True))
    off32 = gpu_engine(model32, adapters32, dtype="float32", base_decode_graphs=False)
    assert logprob_diff(waves(off32), eager32) <= 0.005
    idle = gpu_engine(model, adapters, registered=())  # every LoRA site idle: the LoRA graphs launch no LoRA
    assert not idle.graphs.base


def test_graphs_recaptured_as_lora_sites_turn_on(model_and_adapters):
    """Graphs are captured with every LoRA site idle; the first adapter (attention only) turns its
    sites on and the graphs are re-captured at the next decode step; a second adapter with LoRA
    elsewhere, arriving while the first wave decodes, re-captures them again (with requests in
    flight: their KV must survive the warm-up). The same two waves, step for step, on the eager
    engine: every request matches token for token."""
    model, adapters = model_and_adapters
    attn = LoRAAdapter("attn", "", {k: w for k, w in adapters["a0"].sites.items() if ".self_attn." in k})
    waves = {"attn": attn, "a1": adapters["a1"]}
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True, logprobs=2)
    prompts, _ = workload(n=16, seed=9)

    def two_waves(eng):
        first = [eng.add_request(p, params, name) for p, name in zip(prompts[:8], ["attn", None] * 4, strict=True)]
        for _ in range(8):
            eng.step()
        captures = eng.graphs.captures if eng.graphs is not None else None
        eng.pool.add("a1", "a1")  # registered mid-run: its sites turn on
        second = [eng.add_request(p, params, name) for p, name in zip(prompts[8:], ["a1", "attn"] * 4, strict=True)]
        while eng.has_unfinished():
            eng.step()
        return first + second, captures

    graphed = gpu_engine(model, waves, registered=("attn",))
    assert graphed.graphs.captures == 1
    reqs, after_first = two_waves(graphed)
    assert (after_first, graphed.graphs.captures) == (2, 3)
    ref, _ = two_waves(gpu_engine(model, waves, registered=("attn",), enforce_eager=True))
    assert logprob_diff(reqs, ref) <= 0.05


def test_capture_survives_a_collected_cycle_holding_old_graphs():
    """A dropped engine in a reference cycle is freed whenever the cyclic collector runs, its CUDA graphs
    with it; destroying a graph while a stream captures is not permitted and invalidates the capture
    (seen on the H200: CUDAGraph::reset "operation not permitted when stream is capturing", then
    cudaErrorStreamCaptureInvalidated at capture_end, mid-suite). The capture collects first and holds the
    collector off. The hook below runs a collection inside every capture the collector is allowed into,
    as an automatic one may at any allocation; the threshold keeps automatic ones from running earlier."""
    import gc
    import weakref

    model = tiny_model("qwen2_moe")
    adapters = tiny_adapters(model, "qwen2_moe")
    old = gpu_engine(model, adapters)
    old.cycle = old  # only the cyclic collector frees it
    gone = weakref.ref(old.graphs)
    del old

    def collect_inside_captures(module, args):
        if torch.cuda.is_current_stream_capturing() and gc.isenabled():
            gc.collect()

    thresholds = gc.get_threshold()
    gc.set_threshold(10**9)
    hook = model.register_forward_pre_hook(collect_inside_captures)
    try:
        assert gone() is not None
        eng = gpu_engine(model, adapters)
    finally:
        hook.remove()
        gc.set_threshold(*thresholds)
    assert gone() is None  # the old engine was collected (before the capture)
    prompts, names = workload(n=8, seed=13)
    reqs = generate(eng, prompts, names, 16)
    assert forced_logprob_diff(gpu_engine(model, adapters, enforce_eager=True), reqs) <= 0.05


def test_graphs_at_the_registered_adapters_width():
    """`lora_width_by_batch`: in a rank-64 pool, adapters of rank <= 16 get decode graphs at 16 rank
    columns; a rank-40 adapter registered afterwards has them re-captured at 64 before its first replay.
    Token for token equal to the eager engine, whose steps run at their own rows' width (the same as the
    graphs' in both waves: every decode step of the second one has rows on the wide adapter).
    (Against an engine at the pool's width throughout, greedy tokens may part at near-ties: other tile
    widths round differently; H200, this workload: with the tokens forced through one eager forward,
    every generated token's logprob is within 0.135 of it for both widths alike, and of the pool-width
    engine's own run.)"""
    model = tiny_model("qwen2_moe", max_rank=64)
    adapters = {**tiny_adapters(model, "qwen2_moe"), "wide": random_adapter(model, 50, 40, frac=0.8)}
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True, logprobs=2)
    prompts, names = workload(n=16, seed=11)

    def two_waves(eng):
        first = [eng.add_request(p, params, name) for p, name in zip(prompts[:8], names[:8], strict=True)]
        while eng.has_unfinished():
            eng.step()
        width = eng.graphs.lora_width if eng.graphs is not None else None
        eng.pool.add("wide", "wide")
        second = [eng.add_request(p, params, name) for p, name in zip(prompts[8:], ["wide", None] * 4, strict=True)]
        while eng.has_unfinished():
            eng.step()
        return first + second, width

    narrow = ("a0", "a1", "a2", "a3")
    graphed = gpu_engine(model, adapters, registered=narrow, max_lora_rank=64)
    reqs, first_width = two_waves(graphed)
    assert (first_width, graphed.graphs.lora_width) == (16, 64)
    eager, _ = two_waves(gpu_engine(model, adapters, registered=narrow, max_lora_rank=64, enforce_eager=True))
    assert logprob_diff(reqs, eager) <= 0.05


class SplitKTo64(DenseLoRAPolicy):
    """splitk on every LoRA call of up to 64 rows, whatever the shape."""

    def prefers_splitk(self, num_tokens: int, n_in: int, n_out: int, has_lora: bool) -> bool:
        return has_lora and num_tokens <= 64


def test_dense_splitk_decode_graph_matches_eager(model_and_adapters, monkeypatch):
    """The dense splitk path (split-K GEMM with the LoRA shrink in its launch, expand in its reduce) on
    every decode projection: the default keeps it for >= 1024-wide shapes, which the tiny models lack,
    so the rule is widened here (an injected policy). Graph decode (padding rows on no slot) equals eager
    decode."""
    import moelora.kernels.dense_lora.splitk as splitk

    calls = []
    real = splitk.splitk_linear
    monkeypatch.setattr(splitk, "splitk_linear", lambda *a: calls.append(a[4].shape[0]) or real(*a))
    model, adapters = model_and_adapters
    model = model.with_options(dataclasses.replace(model.options, dense_lora_policy=SplitKTo64()))
    prompts, names = workload(n=24, seed=7)
    reqs = generate(gpu_engine(model, adapters), prompts, names, 64)
    assert calls, "splitk never ran"
    assert forced_logprob_diff(gpu_engine(model, adapters, enforce_eager=True), reqs) <= 0.05


def test_dense_planned_decode_graph_matches_eager(model_and_adapters, monkeypatch):
    """The dense "planned" path (rows grouped by slot, built once per step by the runners) on every
    projection past 16 rows (the default keeps it for >= 1024-wide shapes, which the tiny models
    lack). The grouping is rebuilt inside each graph replay as requests come and go (a stale one would
    give rows another adapter's delta): graph decode equals eager decode, the same kernels. (Against
    the split path the tokens may part at near-ties: other roundings; that equivalence is the kernel
    tests' and the CPU model test's.)"""
    shared = record_planned_sites(monkeypatch)
    model, adapters = model_and_adapters
    model = planned_everywhere(model)
    prompts, names = workload(n=28, seed=8)
    reqs = generate(gpu_engine(model, adapters), prompts, names, 64)
    assert shared and all(shared), "planned never ran, or built its own grouping"
    assert forced_logprob_diff(gpu_engine(model, adapters, enforce_eager=True), reqs) <= 0.05


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_two_streams_match_one(model_and_adapters, eager):
    """Shared experts, LoRA work and MLA's absorb on their side streams vs everything on one stream, under graphs
    (decode graphs and the prefill pieces) and eager: the same launches in another order, so the same tokens and
    logprobs bit for bit (a read before its join shows as drift). Graphs against eager is the other tests': their bf16
    roundings differ (this workload on the tiny MiniMax: the prefill pieces moved a request's logprobs up to 1.04 from
    eager's and split a 0.23 greedy gap, where fp32 pieces and eager stay within 0.0014; 44th session)."""
    model, adapters = model_and_adapters
    prompts, names = workload(seed=1)
    on = dict(overlap_shared_experts=True, overlap_lora=True, overlap_mla_absorb=True)
    two = generate(gpu_engine(model, adapters, enforce_eager=eager, **on), prompts, names, 64)
    one = generate(gpu_engine(model, adapters, enforce_eager=eager, **{k: False for k in on}), prompts, names, 64)
    for a, b in zip(two, one, strict=True):
        assert a.output_ids == b.output_ids, a.request_id
        assert a.logprobs == b.logprobs, a.request_id


def test_no_layer_forks_onto_the_stream_it_forks_from(monkeypatch):
    """A fork onto the current stream is a silent no-op: the side work runs in series. A DeepSeek model of 20 layers
    (19 with shared experts, 20 with MLA's absorb: more side-stream users than torch's 32 pool streams a priority,
    which per-layer streams wrapped onto the capture stream) captures its decode graphs and prefill pieces and
    decodes, and no stream ever waits on itself."""
    self_waits = []
    wait_stream = torch.cuda.Stream.wait_stream

    def spy(stream, other):
        if stream.cuda_stream == other.cuda_stream:
            self_waits.append(stream.cuda_stream)
        return wait_stream(stream, other)

    monkeypatch.setattr(torch.cuda.Stream, "wait_stream", spy)
    hf = tiny_hf_model("deepseek_v3", seed=3, **{**DSV3_SIZES, "num_hidden_layers": 20})
    eng = gpu_engine(build_from_architecture(hf, 4, 16, torch.bfloat16).to("cuda"), {}, max_num_seqs=4,
                     max_num_batched_tokens=64)
    assert eng.graphs is not None and eng.pieces is not None
    prompts, _ = workload(n=4)
    reqs = generate(eng, prompts, [None] * 4, 8)
    assert eng.pieces.replays and all(len(r.output_ids) == 8 for r in reqs)
    assert not self_waits


def test_lora_side_stream_is_bit_exact(model_and_adapters):
    """The LoRA side stream runs the same kernels: graph decode with and without it gives the same tokens
    and logprobs, bit for bit."""
    model, adapters = model_and_adapters
    prompts, names = workload(n=16, seed=6)
    on = generate(gpu_engine(model, adapters, overlap_lora=True), prompts, names, 48)
    off = generate(gpu_engine(model, adapters, overlap_lora=False), prompts, names, 48)
    for a, b in zip(on, off, strict=True):
        assert a.output_ids == b.output_ids, a.request_id
        assert a.logprobs == b.logprobs, a.request_id


def test_mla_absorb_stream_is_bit_exact(model_and_adapters):
    """`overlap_mla_absorb`: MLA decode's absorb GEMM and LoRA term on a second stream run the same launches, so
    graph decode with and without it gives the same tokens and logprobs, bit for bit (a race between the absorb
    and the rope kernel or the attention after the join shows as drift)."""
    model, adapters = model_and_adapters
    if not any(isinstance(m, MLAttention) for m in model.modules()):
        pytest.skip("no MLA layer in this family")
    prompts, names = workload(n=16, seed=8)
    on_engine = gpu_engine(model, adapters, overlap_mla_absorb=True)
    assert on_engine.model.options.overlap_mla_absorb
    on = generate(on_engine, prompts, names, 48)
    off = generate(gpu_engine(model, adapters, overlap_mla_absorb=False), prompts, names, 48)
    for a, b in zip(on, off, strict=True):
        assert a.output_ids == b.output_ids, a.request_id
        assert a.logprobs == b.logprobs, a.request_id


def test_programmatic_dependent_launch_is_bit_exact(model_and_adapters):
    """`pdl` (kernels/pdl.py): every Triton kernel waits for its inputs before its first access, so decode under
    graphs with and without programmatic dependent launch gives the same tokens and logprobs, bit for bit (a
    kernel reading before its wait reads its predecessor's half-written output: a race this catches as drift)."""
    model, adapters = model_and_adapters
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs compute capability >= 9.0")
    prompts, names = workload(n=24, seed=7)
    on_engine = gpu_engine(model, adapters, pdl=True)
    assert on_engine.model.options.pdl and on_engine.graphs is not None
    on = generate(on_engine, prompts, names, 64)
    off = generate(gpu_engine(model, adapters, pdl=False), prompts, names, 64)
    for a, b in zip(on, off, strict=True):
        assert a.output_ids == b.output_ids, a.request_id
        assert a.logprobs == b.logprobs, a.request_id


def test_overlapped_scheduling_matches_synchronous(model_and_adapters):
    """Step n+1 launched (graphs) before step n is read back, input ids gathered on the device."""
    model, adapters = model_and_adapters
    prompts, names = workload(n=24, seed=5)
    reqs = generate(gpu_engine(model, adapters, async_scheduling=True), prompts, names, 48)
    assert forced_logprob_diff(gpu_engine(model, adapters), reqs) <= 0.05


def test_penalized_greedy_decode_graphs_match_eager(model_and_adapters):
    """Penalty state lives on the device and is updated after each draw, outside the graph."""
    model, adapters = model_and_adapters
    prompts, names = workload(n=12, seed=6)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=0, frequency_penalty=1.0,
                            presence_penalty=0.5, repetition_penalty=1.2)

    def run(eng):
        reqs = [eng.add_request(p, params, a) for p, a in zip(prompts, names, strict=True)]
        while eng.has_unfinished():
            eng.step()
        return reqs

    graphed, eager = run(gpu_engine(model, adapters)), run(gpu_engine(model, adapters, enforce_eager=True))
    for g, e in zip(graphed, eager, strict=True):
        assert g.output_ids == e.output_ids, g.request_id
        assert max(abs(a[0] - b[0]) for a, b in zip(g.logprobs, e.logprobs, strict=True)) <= 0.05


def test_async_adapter_loading_matches_synchronous(model_and_adapters):
    """2 slots for 4 adapters: slots are rewritten (on the side stream) while other requests decode."""
    model, adapters = model_and_adapters
    prompts, names = workload(n=16, seed=4)
    eng = gpu_engine(model, adapters, max_loras=2, async_adapter_loading=True)
    reqs = generate(eng, prompts, names, 32)
    assert eng.pool.evictions > 0
    assert forced_logprob_diff(gpu_engine(model, adapters, max_loras=2, async_adapter_loading=False), reqs) <= 0.05


@pytest.mark.parametrize("family", FAMILIES)
def test_triton_backend_is_as_accurate_as_torch_backend(family):
    """Against an fp32 torch reference, the Triton backend in bf16 must be as accurate as the torch
    backend in bf16 (a random tiny model is ill-conditioned: both land near 0.13 relative error,
    measured on an H200 for Qwen2-MoE, so a fixed absolute tolerance would say nothing)."""
    prompts, names = workload(n=10, seed=2)
    ref_model = tiny_model(family, torch.float32)
    adapters = tiny_adapters(ref_model, family)
    ref = gpu_engine(ref_model, adapters, dtype="float32", kernel_backend="torch").prompt_logits(prompts, names)
    model = tiny_model(family)
    torch_bf16 = gpu_engine(model, adapters, kernel_backend="torch").prompt_logits(prompts, names)
    triton_bf16 = gpu_engine(model, adapters, enforce_eager=True).prompt_logits(prompts, names)

    def err(outs):
        return max(((a - b).norm() / b.norm()).item() for a, b in zip(outs, ref, strict=True))

    assert err(triton_bf16) <= 1.25 * err(torch_bf16) + 1e-3, (err(triton_bf16), err(torch_bf16))


def test_decode_forward_has_no_host_sync(model_and_adapters):
    model, adapters = model_and_adapters
    eng = gpu_engine(model, adapters, enforce_eager=True, async_scheduling=False)  # the step driven by hand
    prompts, names = workload(n=8, seed=3)
    for p, a in zip(prompts, names, strict=True):
        eng.add_request(p, SamplingParams(max_tokens=4, ignore_eos=True), a)
    decode_step_without_host_sync(eng)


SANITIZER_SCRIPT = """
from tests.helpers.gpu_engine import gpu_engine, workload, generate, tiny_model, tiny_adapters
model = tiny_model({family!r})
adapters = tiny_adapters(model, {family!r}, frac=1.0)
prompts, names = workload(n=8)
eng = gpu_engine(model, adapters, enforce_eager=True, overlap_shared_experts=True, overlap_lora=True)
generate(eng, prompts, names, 8)
# adapter slots written on the side stream while other requests decode (2 slots, 4 adapters: churn)
generate(gpu_engine(model, adapters, enforce_eager=True, max_loras=2, async_adapter_loading=True), prompts, names, 8)
generate(gpu_engine(model, adapters, enforce_eager=True, async_scheduling=True), prompts, names, 8)
print("SANITIZER-RUN-DONE")
"""


@pytest.mark.parametrize("family", FAMILIES)
def test_stream_sanitizer_reports_nothing(family):
    env = dict(os.environ, TORCH_CUDA_SANITIZER="1")
    script = SANITIZER_SCRIPT.format(family=family)  # run from the repository root: `tests` is importable
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert "SANITIZER-RUN-DONE" in proc.stdout, proc.stderr[-3000:]
    assert "CSAN" not in proc.stderr and "data race" not in proc.stderr.lower(), proc.stderr[-3000:]


def test_planted_inplace_race_is_caught():
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(256, 256, device="cuda", generator=g)
    w = torch.randn(256, 256, device="cuda", generator=g)
    expected = x * 3.0 + x @ w
    safe = racy_and_safe(x.clone(), w, inplace=False)
    racy = racy_and_safe(x.clone(), w, inplace=True)
    torch.cuda.synchronize()
    assert torch.allclose(safe, expected, rtol=1e-3, atol=1e-2)
    assert not torch.allclose(racy, expected, rtol=1e-3, atol=1e-2)  # the equivalence check sees the race


def test_stream_sanitizer_sees_the_planted_race():
    """The sanitizer check above can fail: on the planted race it does report."""
    script = ("import torch\nfrom tests.helpers.gpu_engine import racy_and_safe\n"
              "x = torch.randn(64, 64, device='cuda'); w = torch.randn(64, 64, device='cuda')\n"
              "racy_and_safe(x, w, inplace=True); torch.cuda.synchronize(); print('RAN')\n")
    env = dict(os.environ, TORCH_CUDA_SANITIZER="1")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert "CSAN" in proc.stderr or "data race" in proc.stderr.lower(), (proc.stdout[-2000:], proc.stderr[-2000:])
