"""MLA decode in the absorbed form (weights folded into the query and the output) equals the expanded
torch path: one layer with LoRA on kv_b_proj in slots of different ranks, and the whole engine.

The layer cases draw every weight, LoRA slot and cache entry at random (fp32, CPU): sequences of
different lengths across block boundaries on shuffled blocks, rows on no adapter, an empty slot, and
a slot rewritten in place between steps (what a captured graph must see)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from oracle import tiny_hf_model
from test_deepseek_glm import build
from test_engine import prompts
from test_forward import engine, random_adapter

from moelora.engine.request import SamplingParams
from moelora.layers.attention import AttnMetadata, SeqSlice
from moelora.layers.mla import MLAttention
from moelora.layers.options import DEFAULT_OPTIONS, LayerOptions, adopt_tensors
from moelora.layers.rotary import RotaryEmbedding
from moelora.lora.adapter import LoRAWeights
from moelora.lora.batch import LoRABatch

# DeepSeek-V3-like but awkward: 5 heads, Dv != Dn, q_lora, biases, interleaved rotary.
SIZES = dict(hidden=48, num_heads=5, q_lora_rank=24, kv_lora_rank=20, qk_nope_head_dim=12, qk_rope_head_dim=8,
             v_head_dim=10)
SLOTS, RANK = 4, 8


def new_mla(options: LayerOptions = DEFAULT_OPTIONS, **overrides) -> MLAttention:
    sizes = dict(SIZES, **overrides)
    scale = (sizes["qk_nope_head_dim"] + sizes["qk_rope_head_dim"]) ** -0.5
    return MLAttention(**sizes, bias=True, interleave=True, softmax_scale=scale, max_loras=SLOTS, max_rank=RANK,
                       dtype=torch.float32, options=options)


def twin(layer: MLAttention, **options) -> MLAttention:
    """`layer` (one of `new_mla`'s, default sizes) built again with other layer options, holding its tensors."""
    with torch.device("meta"):
        return adopt_tensors(new_mla(dataclasses.replace(layer.options, **options)), layer)


def mla_layer(seed: int, **overrides) -> MLAttention:
    layer = new_mla(**overrides)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g) if "norm" in name
                    else 0.15 * torch.randn(p.shape, generator=g))
    for slot, rank in enumerate((8, 3, 5)):  # slot 3 stays empty
        set_slot(layer, slot, rank, seed=seed * 10 + slot)
    return layer.eval()


def set_slot(layer: MLAttention, slot: int, rank: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mod in (layer.q_a_proj, layer.q_b_proj, layer.kv_a_proj_with_mqa, layer.kv_b_proj, layer.o_proj):
            a = 0.3 * torch.randn(rank, mod.in_features, generator=g)
            mod.set_lora_slot(slot, LoRAWeights(a, 0.3 * torch.randn(mod.out_features, rank, generator=g)))


def scattered_tables(cached: list[int], bs: int, spare: int, g: torch.Generator) -> tuple[list[list[int]], int, int]:
    """Block tables for sequences of cached[i] + 1 tokens over a randomly permuted pool with `spare`
    unused blocks: (tables, pool size, the last permuted block id)."""
    nblk = [-(-(n + 1) // bs) for n in cached]
    NB = sum(nblk) + spare
    perm = torch.randperm(NB, generator=g).tolist()
    tables, off = [], 0
    for n in nblk:
        tables.append(perm[off:off + n])
        off += n
    return tables, NB, perm[-1]


def decode_step(layer: MLAttention, cached: list[int], slots: list[int], bs: int = 4, seed: int = 0,
                device: str = "cpu"):
    """Inputs of one decode step: sequence i has cached[i] tokens (random cache entries) plus one new token."""
    g = torch.Generator().manual_seed(seed)
    tables, NB, pad = scattered_tables(cached, bs, 2, g)
    mb = max(len(t) for t in tables)
    B = len(cached)
    meta = AttnMetadata(
        slot_mapping=torch.tensor([t[n // bs] * bs + n % bs for t, n in zip(tables, cached, strict=True)]),
        block_tables=torch.tensor([t + [pad] * (mb - len(t)) for t in tables], dtype=torch.int32),
        seq_lens=torch.tensor([n + 1 for n in cached], dtype=torch.int32),
        query_start=torch.arange(B + 1, dtype=torch.int32),
        seqs=tuple(SeqSlice(i, 1, n + 1, i) for i, n in enumerate(cached)), max_seq_len=max(cached) + 1,
        max_query_len=1)
    width = layer.kv_lora_rank + layer.rope
    cache = torch.randn(NB, bs, width, generator=g)
    x = torch.randn(B, SIZES["hidden"], generator=g)
    cos, sin = RotaryEmbedding(layer.rope, 10000.0)(torch.tensor(cached))
    lora = LoRABatch.build(slots, [8, 3, 5, 0], device)
    meta = AttnMetadata(*(t.to(device) for t in (meta.slot_mapping, meta.block_tables, meta.seq_lens,
                                                 meta.query_start)), meta.seqs, meta.max_seq_len, 1)
    return x.to(device), cos.to(device), sin.to(device), meta, cache.to(device), lora


def run(layer: MLAttention, step, absorbed: bool, lora=True):
    """`layer`'s output and cache after `step`, in the absorbed form or expanded (by a twin of `layer` built
    with the off switch, `LayerOptions.mla_absorbed_decode`)."""
    x, cos, sin, meta, cache, batch = step
    if layer.options.mla_absorbed_decode != absorbed:
        layer = twin(layer, mla_absorbed_decode=absorbed)
    cache = cache.clone()
    with torch.no_grad():
        out = layer(x, cos, sin, meta, (cache,), batch if lora else None)
    return out, cache


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
    model = build(hf, max_loras=4, max_rank=8)
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
