"""Adapter loading: every PEFT layout -> canonical sites, against PEFT's own deltas and a manual merge,
plus every refusal of `load_adapter` (contract 7)."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from moelora.errors import AdapterError
from moelora.lora.loader import load_adapter
from tests.helpers import oracle_lora as ol
from tests.helpers.oracle import FAMILIES, tiny_model_cache

PFX = "base_model.model."
pytestmark = pytest.mark.filterwarnings("ignore:The following (rank|alpha)_pattern keys did not match")


@pytest.fixture(scope="module")
def models():
    return tiny_model_cache(3)


@pytest.fixture(scope="module")
def peft_adapters(models, tmp_path_factory):
    """One real PEFT (layout (b)) adapter per family, with rank/alpha patterns, and PEFT's deltas."""
    cache = {}

    def get(family: str):
        if family not in cache:
            m = models(family)
            d = ol.build_peft_adapter(m, tmp_path_factory.mktemp(f"peft_{family}"), router=True,
                                      rank_pattern={"q_proj": 2, "experts.down_proj": 3},
                                      alpha_pattern={"k_proj": 5, "experts.gate_up_proj": 12})
            cache[family] = (d, ol.peft_deltas(m, d))
        return cache[family]

    return get


def load(path, model, max_rank: int = 64):
    return load_adapter(path, ol.moelora_config(model), name="t", max_rank=max_rank)


def delta(w) -> torch.Tensor:
    return w.b.double() @ w.a.double()


def assert_deltas(adapter, expected: dict[str, torch.Tensor]) -> None:
    """The adapter's sites are exactly the non-zero expected deltas, and each b @ a equals it."""
    nonzero = {k for k, v in expected.items() if v.abs().max() > 0}
    assert set(adapter.sites) == nonzero
    for site, w in adapter.sites.items():
        assert w.a.dtype == torch.float32 and w.b.dtype == torch.float32
        torch.testing.assert_close(delta(w), expected[site], atol=1e-5, rtol=1e-5, msg=site)


def assert_contract_shapes(adapter, model) -> None:
    c = ol.moelora_config(model)
    e, h, i = c.num_experts, c.hidden_size, c.moe_intermediate_size
    for site, w in adapter.sites.items():
        r = w.rank
        if site.endswith(".experts.gate_up"):
            assert (w.a.shape, w.b.shape) == ((e, r, h), (e, 2 * i, r)), site
        elif site.endswith(".experts.down"):
            assert (w.a.shape, w.b.shape) == ((e, r, i), (e, h, r)), site
        else:
            assert w.a.dim() == 2 and w.b.shape[1] == r, site


# ---------------------------------------------------------------- layouts against the oracles


@pytest.mark.parametrize("family", FAMILIES)
def test_peft_target_parameters_equals_peft_deltas(family, models, peft_adapters):
    """(b): real PEFT, nested ParamWrappers + attention/shared/dense/router LoRA, patterns honoured."""
    model = models(family)
    path, deltas = peft_adapters(family)
    adapter = load(path, model)
    assert_deltas(adapter, deltas)
    assert_contract_shapes(adapter, model)
    assert adapter.sites["model.layers.0.self_attn.q_proj"].rank == 2
    assert adapter.sites["model.layers.0.mlp.experts.down"].rank == 3
    assert adapter.sites["model.layers.0.mlp.experts.gate_up"].rank == 4
    if family == "qwen2_moe":  # the target rewrite is off: shared expert and its gate keep their LoRA
        assert {"model.layers.0.mlp.shared_expert.up_proj", "model.layers.0.mlp.shared_expert_gate",
                "model.layers.2.mlp.down_proj"} <= set(adapter.sites)
    if family == "qwen3_moe":
        assert "model.layers.1.mlp.gate_proj" in adapter.sites


@pytest.mark.parametrize("family", FAMILIES)
def test_layouts_give_same_deltas(family, models, peft_adapters, tmp_path):
    """The same weights as (b), (a) per expert and (c) packed (fused and separate gate/up) agree."""
    model = models(family)
    path, deltas = peft_adapters(family)
    raw = ol.peft_to_raw(path, model)
    for layout, write in (("a", ol.write_per_expert), ("c", ol.write_packed),
                          ("c_sep", lambda r, d: ol.write_packed(r, d, fuse_gate_up=False))):
        adapter = load(write(raw, tmp_path / layout), model)
        assert_deltas(adapter, deltas)
        assert_contract_shapes(adapter, model)
    # the manual merge of those per-expert factors is PEFT's forward too
    ids = torch.randint(3, 97, (2, 5), generator=torch.Generator().manual_seed(1))
    merged = ol.oracle_logits(model, ids, raw=raw)
    torch.testing.assert_close(merged, ol.oracle_logits(model, ids, adapter_dir=path), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_per_expert_equals_manual_merge(family, models, tmp_path):
    """(a) with a per-expert rank override (zero-padded) and an alpha override; Mixtral and MiniMax-M2 in Hub names
    (`block_sparse_moe.experts.{e}.w1` / `w3` / `w2`, as their Hub code names the experts)."""
    model = models(family)
    hub = family in ("mixtral", "minimax_m2")
    raw = ol.per_expert_lora(model, seed=5, r=3, lora_alpha=7, hub_names=hub,
                             rank_pattern={"experts.2.w3" if hub else "experts.2.up_proj": 5},
                             alpha_pattern={"o_proj": 2.5})
    adapter = load(ol.write_per_expert(raw, tmp_path), model)
    assert_deltas(adapter, ol.weight_deltas(model, ol.merged_model(model, raw)))
    assert_contract_shapes(adapter, model)
    assert adapter.sites["model.layers.0.mlp.experts.gate_up"].rank == 5 + 3


@pytest.mark.parametrize("family", ["qwen2_moe", "olmoe"])
def test_packed_rslora_equals_manual_merge(family, models, tmp_path):
    model = models(family)
    raw = ol.per_expert_lora(model, seed=6, r=4, lora_alpha=3, use_rslora=True)
    adapter = load(ol.write_packed(raw, tmp_path), model)
    assert_deltas(adapter, ol.weight_deltas(model, ol.merged_model(model, raw)))


def test_gate_only_experts(models, tmp_path):
    """Experts with LoRA on gate_proj only: gate_up's up rows carry no delta."""
    model = models("qwen3_moe")
    raw = ol.per_expert_lora(model, seed=7)
    raw.factors = {k: v for k, v in raw.factors.items() if ".experts." not in k or k.endswith("gate_proj")}
    adapter = load(ol.write_per_expert(raw, tmp_path), model)
    assert_deltas(adapter, ol.weight_deltas(model, ol.merged_model(model, raw)))
    assert not any(s.endswith("experts.down") for s in adapter.sites)


def test_mixtral_hub_names_agree_with_peft_conversion(models, tmp_path):
    """PEFT's own v4 -> v5 conversion of a Hub-style Mixtral adapter (w1/w3/w2, block_sparse_moe) is
    an independent oracle for the naming; the rewrite is what loads it here, so it stays on."""
    from peft import PeftModel

    model = models("mixtral")
    raw = ol.per_expert_lora(model, seed=8, r=3, hub_names=True)
    path = ol.write_per_expert(raw, tmp_path)
    ids = torch.randint(3, 97, (2, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        peft_logits = PeftModel.from_pretrained(copy.deepcopy(model), str(path)).eval()(ids).logits
    torch.testing.assert_close(ol.oracle_logits(model, ids, raw=raw), peft_logits, atol=1e-4, rtol=1e-4)
    assert_deltas(load(path, model), ol.weight_deltas(model, ol.merged_model(model, raw)))


def test_peft_rslora_layers_to_transform(models, tmp_path):
    """PEFT applies layers_to_transform to target_modules only; the expert wrappers stay everywhere."""
    model = models("qwen3_moe")
    path = ol.build_peft_adapter(model, tmp_path, use_rslora=True, lora_alpha=5, layers_to_transform=[1, 2],
                                 router=True)
    adapter = load(path, model)
    assert_deltas(adapter, ol.peft_deltas(model, path))
    assert not any(s.startswith("model.layers.0.self_attn") for s in adapter.sites)
    assert {"model.layers.0.mlp.experts.gate_up", "model.layers.0.mlp.gate"} <= set(adapter.sites)


def test_peft_rewritten_config(models, tmp_path):
    """What PEFT 0.21 saves by default for OLMoE: bare target_parameters, gate_up at rank 2r / alpha 2a."""
    model = models("olmoe")
    path = ol.build_peft_adapter(model, tmp_path, target_parameters=(), peft_rewrite=True, r=3)
    saved = json.loads((path / "adapter_config.json").read_text())
    assert "gate_up_proj" in saved["target_parameters"] and saved["rank_pattern"]
    adapter = load(path, model)
    assert_deltas(adapter, ol.peft_deltas(model, path))
    assert adapter.sites["model.layers.0.mlp.experts.gate_up"].rank == 6


def test_refuse_same_site_twice(models, tmp_path):
    """Mixtral's Hub and in-memory names of one module must not both appear."""
    model = models("mixtral")
    raw = ol.per_expert_lora(model, seed=10, r=2, hub_names=True)
    a, b, s = raw.factors["model.layers.0.block_sparse_moe.gate"]
    raw.factors["model.layers.0.mlp.gate"] = (a, b, s)
    with pytest.raises(AdapterError, match=r"adapts model\.layers\.0\.mlp\.gate"):
        load(ol.write_per_expert(raw, tmp_path / "r"), model)
    raw = ol.per_expert_lora(model, seed=10, r=2, hub_names=True)
    hub = raw.factors["model.layers.1.block_sparse_moe.experts.2.w1"]
    raw.factors["model.layers.1.mlp.experts.2.gate_proj"] = hub
    with pytest.raises(AdapterError, match="same expert projection"):
        load(ol.write_per_expert(raw, tmp_path / "e"), model)


def test_layers_pattern(models, tmp_path):
    model = models("olmoe")
    raw = ol.per_expert_lora(model, seed=9, layers_to_transform=[2])
    raw.config["layers_pattern"] = "layers"
    adapter = load(ol.write_per_expert(raw, tmp_path / "ok"), model)
    assert_deltas(adapter, ol.weight_deltas(model, ol.merged_model(model, raw)))
    assert {s.split(".")[2] for s in adapter.sites} == {"2"}
    raw.config["layers_pattern"] = ["h"]  # PEFT would not have targeted these keys
    with pytest.raises(AdapterError, match="layers_to_transform"):
        load(ol.write_per_expert(raw, tmp_path / "bad"), model)


@pytest.mark.parametrize("square", [False, True])
def test_old_peft_expert_orientation(square, models, tmp_path):
    """Orientation comes from the shapes; with H == 2I (gate_up square) only peft_version can tell."""
    model = models("olmoe", intermediate_size=24) if square else models("olmoe")
    path = ol.build_peft_adapter(model, tmp_path / "new")
    deltas = ol.peft_deltas(model, path)
    assert_deltas(load(ol.old_peft_orientation(path, model, tmp_path / "old", "0.18.1"), model), deltas)
    if square:  # the same file claimed by a new PEFT reads differently: the version is what decided
        wrong = load(ol.old_peft_orientation(path, model, tmp_path / "lie", "0.21.0"), model)
        gate_up = "model.layers.0.mlp.experts.gate_up"
        assert (delta(wrong.sites[gate_up]) - deltas[gate_up]).abs().max() > 1e-2


# ---------------------------------------------------------------- refusals


@pytest.fixture(scope="module")
def valid_adapter(models, tmp_path_factory):
    """A valid per-expert qwen2_moe adapter (every site kind) to break one way per refusal test."""
    model = models("qwen2_moe")
    raw = ol.per_expert_lora(model, seed=11, r=4)
    return model, ol.write_per_expert(raw, tmp_path_factory.mktemp("valid"))


def _edit(src, dst, *, config=None, tensors=None):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    sd = load_file(str(dst / "adapter_model.safetensors"))
    if config:
        config(cfg)
    if tensors:
        tensors(sd)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    save_file(sd, str(dst / "adapter_model.safetensors"))
    return dst


Q0 = f"{PFX}model.layers.0.self_attn.q_proj"
G0 = f"{PFX}model.layers.0.mlp.experts.{{e}}.gate_proj"


def _set(key, value):
    return lambda d: d.__setitem__(key, value)


def _pop(*keys):
    return lambda d: [d.pop(k) for k in keys]


def _poison(key, value):
    def f(sd):
        sd[key] = sd[key].clone()
        sd[key][0, 0] = value
    return f


def _add(module: str, a: torch.Tensor, b: torch.Tensor):
    return lambda sd: sd.update({f"{PFX}{module}.lora_A.weight": a, f"{PFX}{module}.lora_B.weight": b})


G3 = G0.format(e=3)
REFUSALS = {  # case: (edits of the valid adapter, substrings the error must contain)
    "dora": (dict(config=_set("use_dora", True)), ["use_dora"]),
    "bias": (dict(config=_set("bias", "lora_only")), ["bias", "lora_only"]),
    "modules_to_save": (dict(config=_set("modules_to_save", ["lm_head"])), ["modules_to_save"]),
    "trainable_tokens": (dict(config=_set("trainable_token_indices", [5, 6])), ["trainable_token_indices"]),
    "target_embed": (dict(config=_set("target_modules", ["q_proj", "embed_tokens"])), ["embed_tokens"]),
    "resized_embedding": (dict(tensors=_set(f"{PFX}model.embed_tokens.weight", torch.randn(99, 48))),
                          ["embed_tokens", "not supported"]),
    "lm_head_lora": (dict(tensors=_add("lm_head", torch.randn(4, 48), torch.randn(97, 4))), ["lm_head"]),
    "not_lora": (dict(config=_set("peft_type", "IA3")), ["peft_type", "IA3"]),
    "shape": (dict(tensors=_set(f"{Q0}.lora_A.weight", torch.randn(4, 40))),
              [f"{Q0}.lora_A.weight", "(4, 40)", "(4, 48)"]),
    "rank_vs_config": (dict(config=_set("r", 3)), ["shape mismatch", "r=3"]),
    "expert_count": (dict(tensors=_add(G0.format(e=5)[len(PFX):], torch.randn(4, 48), torch.randn(40, 4))),
                     ["expert count mismatch", "expert 5", "5 experts"]),
    "missing_expert": (dict(tensors=_pop(G3 + ".lora_A.weight", G3 + ".lora_B.weight")),
                       ["model.layers.0.mlp.experts", "[3]", "missing"]),
    "nan": (dict(tensors=_poison(f"{Q0}.lora_B.weight", float("nan"))), [f"{Q0}.lora_B.weight", "NaN"]),
    "inf": (dict(tensors=_poison(G0.format(e=1) + ".lora_A.weight", float("inf"))),
            [G0.format(e=1) + ".lora_A.weight", "Inf"]),
    "unknown_module": (dict(tensors=_add("model.layers.0.mlp.foo", torch.ones(1), torch.ones(1))),
                       ["model.layers.0.mlp.foo.lora_A.weight"]),
    "unknown_key": (dict(tensors=_set(f"{PFX}model.norm.weight", torch.ones(48))),
                    [f"{PFX}model.norm.weight"]),
    "a_without_b": (dict(tensors=_pop(f"{Q0}.lora_B.weight")), [f"{Q0}.lora_A.weight", "lora_B"]),
    "b_without_a": (dict(tensors=_pop(f"{Q0}.lora_A.weight")), [f"{Q0}.lora_B.weight", "lora_A"]),
    "dense_mlp_in_moe_layer": (dict(tensors=_add("model.layers.0.mlp.gate_proj", torch.randn(4, 48),
                                                 torch.randn(72, 4))), ["layers.0.mlp.gate_proj", "MoE"]),
    "layer_outside_transform": (dict(config=_set("layers_to_transform", [1, 2])),
                                ["model.layers.0", "layers_to_transform"]),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_refusal(case, valid_adapter, tmp_path):
    model, src = valid_adapter
    edits, needles = REFUSALS[case]
    path = _edit(src, tmp_path / "a", **edits)
    with pytest.raises(AdapterError) as err:
        load(path, model)
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))


def test_valid_adapter_loads(valid_adapter):
    """The refusal tests' starting point is itself accepted (so each refusal is due to its one edit)."""
    model, src = valid_adapter
    assert len(load(src, model).sites) > 0


def test_refuse_bin_and_missing_files(valid_adapter, tmp_path):
    model, src = valid_adapter
    shutil.copytree(src, tmp_path / "bin")
    (tmp_path / "bin" / "adapter_model.safetensors").rename(tmp_path / "bin" / "adapter_model.bin")
    with pytest.raises(AdapterError, match=r"adapter_model\.bin.*convert.*safetensors"):
        load(tmp_path / "bin", model)
    shutil.copytree(src, tmp_path / "nocfg")
    (tmp_path / "nocfg" / "adapter_config.json").unlink()
    with pytest.raises(AdapterError, match="adapter_config.json"):
        load(tmp_path / "nocfg", model)


def test_refuse_added_tokens(valid_adapter, tmp_path):
    model, src = valid_adapter
    shutil.copytree(src, tmp_path / "a")
    (tmp_path / "a" / "added_tokens.json").write_text(json.dumps({"<think>": 50, "<tool>": 97}))
    with pytest.raises(AdapterError, match=r"<tool>.*added tokens"):
        load(tmp_path / "a", model)


def test_refuse_rank_above_max(valid_adapter):
    """The stacked expert gate_up site has rank r_gate + r_up = 8 > 6; dense sites (4) fit."""
    model, src = valid_adapter
    with pytest.raises(AdapterError) as err:
        load(src, model, max_rank=6)
    assert all(s in str(err.value) for s in ("experts.gate_up", "rank 8", "max_rank=6"))
    assert load(src, model, max_rank=8).max_rank == 8


def test_refuse_wrapper_expert_count_and_missing_target_parameters(models, peft_adapters, tmp_path):
    model = models("olmoe")
    path, _ = peft_adapters("olmoe")
    outer = f"{PFX}model.layers.0.mlp.experts.lora_A.weight"

    def five_experts(sd):  # olmoe has 6 experts; down is rank 3
        sd[outer] = sd[outer][:15].clone()
        sd[outer.replace("lora_A", "lora_B")] = sd[outer.replace("lora_A", "lora_B")][:, :15].clone()

    with pytest.raises(AdapterError, match=r"expert count mismatch.*5 experts.*has 6"):
        load(_edit(path, tmp_path / "e", tensors=five_experts), model)
    with pytest.raises(AdapterError, match=r"target_parameters"):
        load(_edit(path, tmp_path / "t", config=_set("target_parameters", ["mlp.experts.down_proj"])), model)
