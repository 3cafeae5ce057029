"""MLA decode in the absorbed form (weights folded into the query and the output) equals the expanded
torch path: one layer with LoRA on kv_b_proj in slots of different ranks, and the whole engine.

The layer cases draw every weight, LoRA slot and cache entry at random (fp32, CPU): sequences of
different lengths across block boundaries on shuffled blocks, rows on no adapter, an empty slot, and
a slot rewritten in place between steps (what a captured graph must see)."""

from __future__ import annotations

import pytest
import torch

from moelora.engine.request import SamplingParams
from moelora.layers.mla import MLAttention
from moelora.layers.options import LayerOptions, adopt_tensors
from tests.helpers.mla import SIZES, decode_step, mla_layer, new_mla, run, set_slot
from tests.helpers.models import build_from_architecture, engine, random_adapter
from tests.helpers.oracle import tiny_hf_model
from tests.helpers.runs import prompts

CASES = [  # (cached lengths, token slots): 3 sequences cross block boundaries, one has an empty context
    ([0, 3, 4, 7, 12, 5], [0, -1, 1, 2, -1, 0]),
    ([9], [1]),
    ([0], [-1]),
    ([15, 2, 8, 3], [3, 2, 2, -1]),  # slot 3 is empty (rank 0)
]


@pytest.mark.parametrize("cached,slots", CASES)
def test_absorbed_decode_equals_expanded(cached, slots):
    layer = mla_layer(seed=1)
    step = decode_step(layer, cached, slots, seed=len(cached))
    want, cache_want = run(layer, step, absorbed=False)
    got, cache_got = run(layer, step, absorbed=True)
    assert torch.equal(cache_got, cache_want)  # both wrote the same new entries
    assert (got - want).abs().max() <= 1e-4
    if any(s in (0, 1, 2) for s in slots):  # the adapters really move the output
        base, _ = run(layer, step, absorbed=True, lora=False)
        assert (got - base).abs().max() > 1e-2


def test_no_kv_b_lora_and_no_lora_batch():
    layer = mla_layer(seed=2)
    step = decode_step(layer, [5, 1, 8], [0, 1, -1], seed=3)
    for lora in (True, False):
        want, _ = run(layer, step, absorbed=False, lora=lora)
        got, _ = run(layer, step, absorbed=True, lora=lora)
        assert (got - want).abs().max() <= 1e-4
    bare = {absorb: MLAttention(**SIZES, bias=False, interleave=False, softmax_scale=0.3, dtype=torch.float32,
                                options=LayerOptions(mla_absorbed_decode=absorb)) for absorb in (True, False)}
    with torch.no_grad():
        for p in bare[True].parameters():
            p.normal_(0, 0.2)
    adopt_tensors(bare[False], bare[True])
    step = decode_step(bare[True], [6, 2], [-1, -1], seed=4)
    assert (run(bare[True], step, True)[0] - run(bare[False], step, False)[0]).abs().max() <= 1e-4


def test_slot_rewritten_in_place_is_seen():
    """The absorbed form precomputes nothing from the slot buffers: a slot reloaded (other rank) between
    steps changes the result exactly as in the expanded path."""
    layer = mla_layer(seed=3)
    step = decode_step(layer, [4, 10, 2], [1, 0, 1], seed=5)
    before, _ = run(layer, step, absorbed=True)
    set_slot(layer, 1, 7, seed=99)
    after, _ = run(layer, step, absorbed=True)
    want, _ = run(layer, step, absorbed=False)
    assert (after - want).abs().max() <= 1e-4 and (after - before).abs().max() > 1e-2


def test_engine_decode_absorbed_equals_expanded(monkeypatch):
    """Greedy decode through the engine: absorbed MLA gives the same tokens and the same logits (every step,
    prefill and decode) as the expanded path, with LoRA on every MLA projection in three slots of different
    ranks and requests on no adapter."""
    hf = tiny_hf_model("deepseek_v3", seed=17)
    model = build_from_architecture(hf, max_loras=4, max_rank=8)
    adapters = {"x": random_adapter(model, 30, 8), "y": random_adapter(model, 31, 3), "z": random_adapter(model, 32, 6)}
    assert all(k in adapters["y"].sites for k in ("model.layers.1.self_attn.kv_b_proj",
                                                  "model.layers.2.self_attn.q_b_proj"))
    ps = prompts(6, model.config.vocab_size, seed=8)
    names = ["x", None, "y", "z", None, "x"]
    params = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)
    calls = {"absorbed": 0}
    absorbed = MLAttention._decode_absorbed

    def counting(self, *args):
        calls["absorbed"] += 1
        return absorbed(self, *args)

    monkeypatch.setattr(MLAttention, "_decode_absorbed", counting)

    def generate(absorb: bool):
        eng = engine(model, adapters, block_size=4, mla_absorbed_decode=absorb)  # the engine's off switch
        mla = [m for m in eng.model.modules() if isinstance(m, MLAttention)]
        assert mla and all(m.options.mla_absorbed_decode == absorb for m in mla)
        logits, run_step = [], eng.runner.run
        eng.runner.run = lambda inputs, all_logits=False: logits.append(run_step(inputs, all_logits)) or logits[-1]
        reqs = [eng.add_request(p, params, a) for p, a in zip(ps, names, strict=True)]
        while eng.has_unfinished():
            eng.step()
        return [r.output_ids for r in reqs], logits

    tokens, logits = generate(absorb=True)
    assert calls["absorbed"] > 0
    n_absorbed, calls["absorbed"] = calls["absorbed"], 0
    ref_tokens, ref_logits = generate(absorb=False)
    assert calls["absorbed"] == 0 and n_absorbed >= 8 * 3  # 8 decode-only steps, 3 MLA layers
    assert tokens == ref_tokens
    assert len(logits) == len(ref_logits)
    assert max((a - b).abs().max().item() for a, b in zip(logits, ref_logits, strict=True)) <= 1e-4


def test_fp8_kv_b_is_dequantized_once_and_again_when_rewritten(monkeypatch):
    """An FP8 kv_b_proj: the absorbed decode reads one dense copy across steps (not a dequantization a step),
    equal to the one the expanded path uses; writing the weight or its scale in place (a checkpoint load) makes
    the next step use the new values."""
    from moelora.layers.linear import Linear
    from moelora.quant.config import FP8Config
    from moelora.quant.fp8 import quantize_segments

    fp8 = FP8Config(method="fp8", weights="block", activations="group", block=(8, 8))
    layer = mla_layer(seed=4, quant=fp8)
    calls = []
    dense = Linear.dense_weight
    monkeypatch.setattr(Linear, "dense_weight", lambda self, dtype: calls.append(self) or dense(self, dtype))
    kv_b = layer.kv_b_proj
    step = decode_step(layer, [5, 1, 8], [0, 1, -1], seed=6)
    first, _ = run(layer, step, absorbed=True)
    again, _ = run(layer, step, absorbed=True)
    assert torch.equal(first, again) and sum(c is kv_b for c in calls) == 1
    with torch.device("meta"):  # the expanded twin (`twin` builds bf16 sites)
        expanded = adopt_tensors(new_mla(LayerOptions(mla_absorbed_decode=False), quant=fp8), layer)
    assert (first - run(expanded, step, absorbed=False)[0]).abs().max() <= 1e-4
    g = torch.Generator().manual_seed(7)
    q, s = quantize_segments(0.15 * torch.randn(kv_b.weight.shape, generator=g), kv_b.scale_segments, fp8.block)
    with torch.no_grad():
        kv_b.weight.copy_(q)
    new_weight, _ = run(layer, step, absorbed=True)
    with torch.no_grad():
        kv_b.weight_scale_inv.copy_(s * 2)
    new_scale, _ = run(layer, step, absorbed=True)
    assert sum(c is kv_b for c in calls) == 3
    for got in (new_weight, new_scale):
        assert (got - first).abs().max() > 1e-2
    assert (new_scale - run(expanded, step, absorbed=False)[0]).abs().max() <= 1e-4


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_merged_q_and_kv_a_projection_equals_two(family):
    """q_proj (DeepSeek-V2-Lite: no q_lora) or q_a_proj (V3), and kv_a_proj_with_mqa, all reading x: one
    `MergedLinear` (`q_kv_a_proj`, its segments the two sites and checkpoint names) by default; `merge_qkv=False`
    runs them as two projections: the same prompt logits with adapters on every MLA projection."""
    hf = tiny_hf_model(family, seed=19)
    model = build_from_architecture(hf, max_loras=2, max_rank=8)
    mla = [m for m in model.modules() if isinstance(m, MLAttention)]
    first = "q_a_proj" if family == "deepseek_v3" else "q_proj"
    assert mla and all(m.q_kv_a_proj is not None and m.q_kv_a_proj.segments == (getattr(m, first),
                                                                               m.kv_a_proj_with_mqa) for m in mla)
    adapters = {"x": random_adapter(model, 33, 8), "y": random_adapter(model, 34, 4)}
    assert all(f"model.layers.1.self_attn.{site}" in adapters["x"].sites for site in (first, "kv_a_proj_with_mqa"))
    seqs = prompts(3, model.config.vocab_size, seed=9)
    names = ["x", None, "y"]
    merged = engine(model, adapters).prompt_logits(seqs, names)
    split = engine(model, adapters, merge_qkv=False).prompt_logits(seqs, names)
    for m, s in zip(merged, split, strict=True):
        assert (m - s).abs().max() <= 1e-5


def test_expand_output_writes_rows_o_proj_reads_as_a_view():
    """The absorbed output bmm lands in [T, N, Dv] rows (no transposing copy before o_proj: its [T, N Dv] input is
    a view of them), each head's o_lat W_uv^T."""
    from moelora.layers.mla import expand_output

    g = torch.Generator().manual_seed(0)
    T, N, C, nope, dv = 5, 3, 16, 8, 6
    o_lat, w = torch.randn(T, N, C, generator=g), torch.randn(N * (nope + dv), C, generator=g)
    out = expand_output(o_lat, w, nope, None)
    assert out.shape == (T, N, dv) and out.is_contiguous()
    assert out.reshape(T, N * dv).data_ptr() == out.data_ptr()
    want = torch.stack([o_lat[:, n] @ w.view(N, -1, C)[n, nope:].T for n in range(N)], dim=1)
    assert torch.allclose(out, want, atol=1e-5)
