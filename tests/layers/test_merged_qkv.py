"""q/k/v as one merged projection (`MergedLinear` in `Attention.qkv_proj`), with each of q_proj / k_proj /
v_proj still a checkpoint name and a LoRA site of its own (`LinearSegment`, views into the merged tensors).

Checkpoint names and the strict loader (names, shapes, errors) are unchanged; `state_dict()` /
`load_state_dict()` speak transformers' names; the views follow the model through `.to()`; adapters write
the segments' rows of the merged LoRA buffers; an adapter covering only q_proj leaves k and v exactly the
base; the off switch (`merge_qkv=False`) gives the merged path's logits. CPU, torch backend, fp32.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from moelora.errors import CheckpointError
from moelora.layers.linear import LinearSegment, MergedLinear
from moelora.layers.mlp import DenseMLP
from moelora.lora.adapter import LoRAAdapter, LoRAWeights
from moelora.lora.batch import LoRABatch
from moelora.models.decoder import MoECausalLM
from moelora.models.weights import load_checkpoint
from tests.helpers.models import build, engine, merged_hf
from tests.helpers.oracle import tiny_hf_model

SLOTS, RANK = 3, 4
QKV = ("q_proj", "k_proj", "v_proj")


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model("qwen2_moe", seed=41)  # q/k/v with bias


def attn(model: MoECausalLM, layer: int = 0):
    return model.model.layers[layer].self_attn


def fresh(hf, **kw) -> MoECausalLM:
    from moelora.config import ModelConfig

    return MoECausalLM(ModelConfig.from_dict(hf.config.to_dict()), **kw)


def test_names_are_transformers_and_views_alias_the_merged_weight(hf):
    model = build(hf, max_loras=SLOTS, max_rank=RANK)
    params = model.weight_params()
    assert set(params) == set(model.state_dict()) == set(hf.state_dict())
    assert not any("qkv_proj" in k for k in params)
    a = attn(model)
    merged = a.qkv_proj
    assert isinstance(merged, MergedLinear) and all(isinstance(getattr(a, n), LinearSegment) for n in QKV)
    sizes = merged.out_sizes
    assert sizes == (a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.num_kv_heads * a.head_dim)
    start = 0
    for name, n in zip(QKV, sizes, strict=True):
        for kind, full in (("weight", merged.weight), ("bias", merged.bias)):
            view = params[f"model.layers.0.self_attn.{name}.{kind}"]
            assert view.shape[0] == n and view.data_ptr() == full[start].data_ptr()
            assert torch.equal(view, hf.state_dict()[f"model.layers.0.self_attn.{name}.{kind}"])
        start += n
    assert [k for k, _ in model.named_parameters() if "layers.0.self_attn" in k] == [
        "model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.self_attn.qkv_proj.bias",
        "model.layers.0.self_attn.o_proj.weight"]


def test_load_checkpoint_fills_the_merged_weight_after_a_move(hf, tmp_path):
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(tmp_path / "model.safetensors"))
    model = fresh(hf, max_loras=SLOTS, max_rank=RANK).to(torch.float64)  # views are taken after the move
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    load_checkpoint(tmp_path, model.weight_params(), progress=False)
    sd = hf.state_dict()
    for layer in range(hf.config.num_hidden_layers):
        merged = attn(model, layer).qkv_proj
        pre = f"model.layers.{layer}.self_attn."
        assert merged.weight.dtype == torch.float64
        assert torch.equal(merged.weight, torch.cat([sd[pre + n + ".weight"] for n in QKV]).double())
        assert torch.equal(merged.bias, torch.cat([sd[pre + n + ".bias"] for n in QKV]).double())
    assert not any(torch.isnan(p).any() for p in model.parameters())


@pytest.mark.parametrize("key", ["model.layers.1.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.bias"])
def test_checkpoint_errors_name_the_segment(hf, tmp_path, key):
    tensors = {k: v.clone().contiguous() for k, v in hf.state_dict().items()}
    good = tuple(tensors[key].shape)
    bad = (good[0] + 1,) + good[1:]
    tensors[key] = torch.randn(bad)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(tmp_path, fresh(hf).weight_params(), progress=False)
    assert key in str(info.value) and str(list(bad)) in str(info.value) and str(list(good)) in str(info.value)
    del tensors[key]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=key.replace(".", r"\.")):
        load_checkpoint(tmp_path, fresh(hf).weight_params(), progress=False)


def test_load_state_dict_is_strict_per_segment(hf):
    model = fresh(hf)
    sd = dict(hf.state_dict())
    key = "model.layers.2.self_attn.q_proj.weight"
    missing = {k: v for k, v in sd.items() if k != key}
    with pytest.raises(RuntimeError, match="Missing key.*" + key.replace(".", r"\.")):
        model.load_state_dict(missing, strict=True)
    with pytest.raises(RuntimeError, match="Unexpected key.*qkv_proj"):
        model.load_state_dict(dict(sd, **{"model.layers.0.self_attn.qkv_proj.weight": torch.zeros(1)}))
    with pytest.raises(RuntimeError, match="size mismatch for " + key.replace(".", r"\.")):
        model.load_state_dict(dict(sd, **{key: sd[key][:-1]}))
    assert model.load_state_dict(missing, strict=False).missing_keys == [key]


def site_weights(site, rank: int, seed: int) -> LoRAWeights:
    g = torch.Generator().manual_seed(seed)
    return LoRAWeights(0.3 * torch.randn(rank, site.in_features, generator=g),
                       0.3 * torch.randn(site.out_features, rank, generator=g))


def test_sites_write_their_rows_of_the_merged_buffers(hf):
    model = build(hf, max_loras=SLOTS, max_rank=RANK)
    a = attn(model)
    merged = a.qkv_proj
    wq, wv = site_weights(a.q_proj, 3, 1), site_weights(a.v_proj, 2, 2)
    a.q_proj.set_lora_slot(1, wq)
    a.v_proj.set_lora_slot(1, wv)
    a.k_proj.set_lora_slot(1, None)
    nq, nk = merged.out_sizes[:2]
    assert torch.equal(merged.lora_a[1, :3], wq.a) and not merged.lora_a[1, 3:2 * RANK].any()
    assert torch.equal(merged.lora_a[1, 2 * RANK:2 * RANK + 2], wv.a) and not merged.lora_a[1, 2 * RANK + 2:].any()
    assert torch.equal(merged.lora_b[1, :nq, :3], wq.b) and not merged.lora_b[1, :nq, 3:].any()
    assert not merged.lora_b[1, nq:nq + nk].any()
    assert torch.equal(merged.lora_b[1, nq + nk:, :2], wv.b)
    assert merged.lora_ranks.tolist() == [[0, 3, 0], [0, 0, 0], [0, 2, 0]]
    assert [getattr(a, n).lora_ranks.tolist() for n in QKV] == [[0, 3, 0], [0, 0, 0], [0, 2, 0]]
    a.q_proj.set_lora_slot(1, None)
    assert not merged.lora_a[1, :RANK].any() and merged.lora_ranks[0].tolist() == [0, 0, 0]
    assert torch.equal(merged.lora_a[1, 2 * RANK:2 * RANK + 2], wv.a)  # v untouched


def test_q_only_adapter_leaves_k_and_v_exact(hf):
    model = build(hf, max_loras=SLOTS, max_rank=RANK)
    sites = {f"model.layers.{i}.self_attn.q_proj": site_weights(attn(model, i).q_proj, RANK, 10 + i)
             for i in range(hf.config.num_hidden_layers)}
    adapter = LoRAAdapter("q_only", "", sites)
    model.set_lora_slot(2, adapter)
    merged = attn(model).qkv_proj
    assert merged.lora_ranks[:, 2].tolist() == [RANK, 0, 0]
    x = torch.randn(5, merged.in_features, generator=torch.Generator().manual_seed(3))
    batch = LoRABatch.build([2, -1, 2, 2, -1], [0, 0, RANK], "cpu")
    with torch.no_grad():
        got, base = merged(x, batch), merged(x)
    nq = merged.out_sizes[0]
    assert torch.equal(got[:, nq:], base[:, nq:])  # k and v: exactly the base projection
    assert torch.equal(got[[1, 4]], base[[1, 4]])  # rows on no adapter
    assert (got[[0, 2, 3], :nq] - base[[0, 2, 3], :nq]).abs().min() > 0
    want = x @ (merged.weight[:nq] + sites["model.layers.0.self_attn.q_proj"].b
                @ sites["model.layers.0.self_attn.q_proj"].a).t() + merged.bias[:nq]
    assert (got[[0, 2, 3], :nq] - want[[0, 2, 3]]).abs().max() < 1e-5
    # the whole model with it equals transformers with the delta merged into q_proj
    seq = [3, 14, 15, 92, 65, 35]
    eng = engine(model, {"q_only": adapter}, max_loras=SLOTS)
    with torch.no_grad():
        ref = merged_hf(hf, adapter)(torch.tensor([seq])).logits[0]
    assert (eng.prompt_logits([seq], ["q_only"])[0] - ref).abs().max() < 1e-4


def test_unmerged_switch_equals_merged(hf):
    model = build(hf, max_loras=SLOTS, max_rank=RANK)
    a = {f"model.layers.{i}.self_attn.{n}": site_weights(getattr(attn(model, i), n), r, 20 + 3 * i + j)
         for i in range(hf.config.num_hidden_layers) for j, (n, r) in enumerate(zip(QKV, (4, 2, 3), strict=True))}
    adapters = {"a": LoRAAdapter("a", "", a)}
    seqs, names = [[5, 6, 7, 8], [9, 10], [11, 12, 13]], ["a", None, "a"]
    merged = engine(model, adapters, max_loras=SLOTS).prompt_logits(seqs, names)
    split_eng = engine(model, adapters, max_loras=SLOTS, merge_qkv=False)
    assert not attn(split_eng.model).options.merge_qkv and attn(model).options.merge_qkv
    split = split_eng.prompt_logits(seqs, names)
    for m, s in zip(merged, split, strict=True):
        assert (m - s).abs().max() < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_triton_merged_and_unmerged_equal_torch(hf):
    """On CUDA, fp32: the Triton backend with q/k/v merged and unmerged equals the torch backend, for a mixed batch
    with a q-only adapter next to a q/k/v one (the model moved to the GPU after loading: the views follow)."""
    model = build(hf, max_loras=SLOTS, max_rank=RANK)
    qkv = {f"model.layers.{i}.self_attn.{n}": site_weights(getattr(attn(model, i), n), r, 50 + 3 * i + j)
           for i in range(hf.config.num_hidden_layers) for j, (n, r) in enumerate(zip(QKV, (4, 2, 3), strict=True))}
    q_only = {k: w for k, w in qkv.items() if k.endswith("q_proj")}
    adapters = {"qkv": LoRAAdapter("qkv", "", qkv), "q": LoRAAdapter("q", "", q_only)}
    model = model.to("cuda")
    seqs, names = [[5, 6, 7, 8], [9, 10], [11, 12, 13], [1]], ["qkv", None, "q", "qkv"]
    want = engine(model, adapters, max_loras=SLOTS, device="cuda", kernel_backend="torch").prompt_logits(seqs, names)
    for merge in (True, False):
        got = engine(model, adapters, max_loras=SLOTS, device="cuda", kernel_backend="triton",
                     merge_qkv=merge).prompt_logits(seqs, names)
        for g, w in zip(got, want, strict=True):
            # Triton's fp32 dots (attention, LoRA) run in TF32
            assert (g - w).abs().max() <= 5e-3 * max(1.0, w.abs().max().item()), merge


def test_unmerged_gate_up_equals_merged(hf):
    """A dense MLP's (and Qwen2-MoE's shared expert's) gate / up: one `MergedLinear` by default, two projections
    with `merge_gate_up=False`; the same logits for a batch mixing an adapter on gate and up (different ranks),
    one on gate alone, and no adapter; the gate-only adapter equals transformers with its delta merged."""
    model = build(hf, max_loras=SLOTS, max_rank=RANK)
    mlps = {name: m for name, m in model.named_modules() if isinstance(m, DenseMLP)}
    assert len(mlps) >= hf.config.num_hidden_layers and all(isinstance(m.gate_up_proj, MergedLinear)
                                                            for m in mlps.values())
    both = {f"{name}.{proj}": site_weights(getattr(m, proj), r, 60 + 2 * i + j) for i, (name, m) in
            enumerate(mlps.items()) for j, (proj, r) in enumerate((("gate_proj", 4), ("up_proj", 2)))}
    gate = {k: w for k, w in both.items() if k.endswith("gate_proj")}
    adapters = {"both": LoRAAdapter("both", "", both), "gate": LoRAAdapter("gate", "", gate)}
    seqs, names = [[5, 6, 7, 8], [9, 10], [11, 12, 13]], ["both", None, "gate"]
    merged = engine(model, adapters, max_loras=SLOTS).prompt_logits(seqs, names)
    split_eng = engine(model, adapters, max_loras=SLOTS, merge_gate_up=False)
    assert all(not m.options.merge_gate_up for m in split_eng.model.modules() if isinstance(m, DenseMLP))
    split = split_eng.prompt_logits(seqs, names)
    for m, s in zip(merged, split, strict=True):
        assert (m - s).abs().max() < 1e-5
    assert (merged[0] - engine(model, {}, max_loras=SLOTS).prompt_logits(seqs[:1], [None])[0]).abs().max() > 1e-3
    with torch.no_grad():
        ref = merged_hf(hf, adapters["gate"])(torch.tensor([seqs[2]])).logits[0]
    assert (merged[2] - ref).abs().max() < 1e-4
