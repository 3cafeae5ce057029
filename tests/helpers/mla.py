"""One MLA layer (DeepSeek-V3-like, awkward widths) with LoRA slots of different ranks, and one decode
step's random inputs over scattered cache blocks: shared by the torch MLA tests and the MLA kernel tests."""

from __future__ import annotations

import dataclasses

import torch

from moelora.layers.attention import AttnMetadata, SeqSlice
from moelora.layers.mla import MLAttention
from moelora.layers.options import DEFAULT_OPTIONS, LayerOptions, adopt_tensors
from moelora.layers.rotary import RotaryEmbedding
from moelora.lora.adapter import LoRAWeights
from moelora.lora.batch import LoRABatch
from tests.helpers.attention_cases import scattered_tables

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


def decode_step(layer: MLAttention, cached: list[int], slots: list[int], bs: int = 4, seed: int = 0,
                device: str = "cpu"):
    """Inputs of one decode step: sequence i has cached[i] tokens (random cache entries) plus one new token."""
    return extend_step(layer, cached, [1] * len(cached), slots, bs, seed, device)


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


def extend_step(layer: MLAttention, cached: list[int], q_lens: list[int], slots: list[int], bs: int = 4,
                seed: int = 0, device: str = "cpu"):
    """Inputs of one prefill / extend step: sequence i has cached[i] tokens (random cache entries) and q_lens[i] new
    ones on adapter slot slots[i] (-1: none); the step's rows sequence after sequence."""
    g = torch.Generator().manual_seed(seed)
    tables, NB, pad = scattered_tables([c + n for c, n in zip(cached, q_lens, strict=True)], bs, 2, g)
    mb = max(len(t) for t in tables)
    seqs, positions, slot_map, starts = [], [], [], [0]
    for i, (c, n) in enumerate(zip(cached, q_lens, strict=True)):
        seqs.append(SeqSlice(starts[-1], n, c + n, i))
        positions += list(range(c, c + n))
        slot_map += [tables[i][p // bs] * bs + p % bs for p in range(c, c + n)]
        starts.append(starts[-1] + n)
    i32 = dict(dtype=torch.int32, device=device)
    meta = AttnMetadata(slot_mapping=torch.tensor(slot_map, device=device),
                        block_tables=torch.tensor([t + [pad] * (mb - len(t)) for t in tables], **i32),
                        seq_lens=torch.tensor([c + n for c, n in zip(cached, q_lens, strict=True)], **i32),
                        query_start=torch.tensor(starts, **i32), seqs=tuple(seqs),
                        max_seq_len=max(s.seq_len for s in seqs), max_query_len=max(q_lens))
    cache = torch.randn(NB, bs, layer.kv_lora_rank + layer.rope, generator=g)
    x = torch.randn(starts[-1], SIZES["hidden"], generator=g)
    cos, sin = RotaryEmbedding(layer.rope, 10000.0)(torch.tensor(positions))
    lora = LoRABatch.build([s for s, n in zip(slots, q_lens, strict=True) for _ in range(n)], [8, 3, 5, 0], device)
    return x.to(device), cos.to(device), sin.to(device), meta, cache.to(device), lora
