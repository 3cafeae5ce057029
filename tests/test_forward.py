"""The torch forward equals transformers on every family; LoRA deltas equal merged weights;
a mixed-adapter batch equals each row run alone."""

from __future__ import annotations

import copy

import pytest
import torch
from oracle import FAMILIES, tiny_hf_model

from moelora.config import ModelConfig
from moelora.engine.config import EngineConfig
from moelora.engine.engine import LLMEngine
from moelora.lora.adapter import LoRAAdapter, LoRAWeights
from moelora.models.decoder import MoECausalLM


def build(hf, max_loras=0, max_rank=0, dtype=torch.float32, **kw):
    """The moelora twin of `hf` (its weights); `kw`: more constructor arguments (`options`)."""
    cfg = ModelConfig.from_dict(hf.config.to_dict())
    model = MoECausalLM(cfg, max_loras=max_loras, max_rank=max_rank, dtype=dtype, **kw)
    model.load_state_dict(hf.state_dict(), strict=True)
    return model.eval()


def engine(model, adapters: dict[str, LoRAAdapter] | None = None, max_loras: int = 4, **kw) -> LLMEngine:
    """A CPU engine over `model` whose pool serves the given in-memory adapters by name; a config whose
    layer options differ from the model's gets the model's twin built with them (`with_options`: the same
    weights and LoRA slots), as `eng.model`."""
    adapters = adapters or {}
    kw = dict(dict(device="cpu", dtype="float32", max_loras=max_loras, max_lora_rank=8, block_size=4,
                   num_kv_blocks=256, max_model_len=128), **kw)
    cfg = EngineConfig(**kw).resolve(model.config)
    eng = LLMEngine(model.with_options(cfg.layer_options(model.options)), None, cfg, lambda name, path: adapters[name])
    for name in adapters:
        eng.pool.add(name, name)
    return eng


def random_adapter(model, seed: int, rank: int, frac: float = 1.0) -> LoRAAdapter:
    """Random non-zero LoRA on a random subset of the model's sites (scaling folded in)."""
    g = torch.Generator().manual_seed(seed)
    sites = {}
    for key, (mod, proj) in model.lora_sites().items():
        if torch.rand((), generator=g) > frac:
            continue
        if proj is None:
            shape_a, shape_b = (rank, mod.in_features), (mod.out_features, rank)
        else:
            a_buf, b_buf = getattr(mod, f"lora_{proj}_a"), getattr(mod, f"lora_{proj}_b")
            shape_a = (a_buf.shape[1], rank, a_buf.shape[3])
            shape_b = (b_buf.shape[1], b_buf.shape[2], rank)
        a, b = torch.randn(shape_a, generator=g), torch.randn(shape_b, generator=g)
        sites[key] = LoRAWeights(0.2 * a, 0.2 * b)
    return LoRAAdapter(f"rand{seed}", "", sites)


def merged_hf(hf, adapter: LoRAAdapter):
    """Oracle: a copy of the HF model with every delta merged into its weights."""
    merged = copy.deepcopy(hf)
    params = dict(merged.named_parameters())
    with torch.no_grad():
        for key, w in adapter.sites.items():
            if key.endswith(".experts.gate_up") or key.endswith(".experts.down"):
                name = key.rsplit(".", 1)[0] + (".gate_up_proj" if key.endswith("gate_up") else ".down_proj")
                params[name] += torch.einsum("eor,eri->eoi", w.b, w.a)
            else:
                params[key + ".weight"] += w.b @ w.a
    return merged


@pytest.mark.parametrize("family", FAMILIES)
def test_base_logits_equal_transformers(family):
    hf = tiny_hf_model(family, seed=1)
    model = build(hf)
    ids = torch.randint(0, hf.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
    ours = engine(model).prompt_logits(ids.tolist(), [None, None])
    for row in range(2):
        assert (ours[row] - ref[row]).abs().max() < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_equals_merged_weights(family):
    hf = tiny_hf_model(family, seed=2)
    model = build(hf, max_loras=2, max_rank=8)
    adapter = random_adapter(model, seed=3, rank=5)
    ids = torch.randint(0, hf.config.vocab_size, (1, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = merged_hf(hf, adapter)(ids).logits[0]
        base = hf(ids).logits[0]
    ours = engine(model, {"a": adapter}, max_loras=2).prompt_logits(ids.tolist(), ["a"])[0]
    assert (ref - base).abs().max() > 1e-2  # the adapter really changes the output
    assert (ours - ref).abs().max() < 1e-4


def test_mixed_batch_equals_each_row_alone():
    hf = tiny_hf_model("qwen2_moe", seed=4)
    model = build(hf, max_loras=4, max_rank=8)
    adapters = {f"a{seed}": random_adapter(model, seed, rank, frac=0.7) for seed, rank in [(10, 8), (11, 3), (12, 6)]}
    g = torch.Generator().manual_seed(5)
    lengths, names = [7, 12, 3, 9, 1, 5], ["a10", None, "a11", "a12", "a10", None]
    seqs = [torch.randint(0, hf.config.vocab_size, (n,), generator=g).tolist() for n in lengths]
    eng = engine(model, adapters)
    batched = eng.prompt_logits(seqs, names)
    for seq, name, got in zip(seqs, names, batched, strict=True):
        alone = eng.prompt_logits([seq], [name])[0]
        assert got.shape == alone.shape
        assert (got - alone).abs().max() < 1e-5
    # different adapters really give different logits on the same tokens
    same = [seqs[1]] * 4
    outs = eng.prompt_logits(same, ["a10", "a11", "a12", None])
    for i in range(3):
        assert (outs[i] - outs[3]).abs().max() > 1e-2
