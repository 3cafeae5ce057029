"""Sliced adapter loading, in one process (no group): each rank's adapter, read slice by slice
(`parallel.adapters.load_adapter_shard`), equals bit for bit the whole adapter (`load_adapter`) cut by the rules
(contract 9: B's rows at a column-parallel site, A's columns at a row-parallel one, an expert's LoRA on its rank),
in every PEFT layout; the rank reads only its slices; refusals are the one-process loader's."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

import moelora.parallel.adapters as pa
from moelora.errors import AdapterError
from moelora.lora.loader import load_adapter
from moelora.parallel.rules import ShardPlan
from moelora.parallel.shard import apply_cut
from tests.helpers import oracle_lora as ol
from tests.helpers.oracle import tiny_hf_model

pytestmark = pytest.mark.filterwarnings("ignore:The following (rank|alpha)_pattern keys did not match")
TP2, EP2, TP4 = (2, False), (2, True), (4, False)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """(family, layout) -> (adapter dir, ModelConfig), built once."""
    cache, models = {}, {}

    def get(family: str, layout: str):
        if (family, layout) not in cache:
            if family not in models:
                models[family] = tiny_hf_model(family, seed=4)
            hf, out = models[family], tmp_path_factory.mktemp(f"{family}_{layout}")
            if layout == "peft":  # (b) target_parameters, the router too, per-site ranks and alphas
                path = ol.build_peft_adapter(hf, out, router=True, r=3, rank_pattern={"q_proj": 2,
                                             "experts.down_proj": 2}, alpha_pattern={"experts.gate_up_proj": 7})
            elif layout == "peft_old":  # (b) as PEFT < 0.19 saved it
                path = ol.old_peft_orientation(ol.build_peft_adapter(hf, out / "new", r=2), hf, out / "old", "0.18")
            elif layout.startswith("packed"):  # (c), gate_up fused or gate and up apart
                raw = ol.per_expert_lora(hf, seed=2, r=3, use_rslora=True)
                path = ol.write_packed(raw, out, fuse_gate_up=layout == "packed")
            else:  # (a) per-expert keys (Mixtral: Hub names), one expert of a lower rank (zero-padded)
                pattern = {r"model\.layers\.0\.(mlp|block_sparse_moe)\.experts\.1\.(up_proj|w3)": 2}
                raw = ol.per_expert_lora(hf, seed=1, r=3, hub_names=family == "mixtral", rank_pattern=pattern)
                path = ol.write_per_expert(raw, out)
            cache[(family, layout)] = (path, ol.moelora_config(hf))
        return cache[(family, layout)]
    return get


def cut_whole(adapter, plan: ShardPlan, cfg) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The oracle: every site of the whole adapter cut as its base weight is (A loses the output cut, B the input
    cut, both keep the expert cut)."""
    out = {}
    for site, w in adapter.sites.items():
        cut = plan.cut(pa.weight_name(site), cfg) or ()
        out_dim, in_dim = w.a.dim() - 2, w.a.dim() - 1
        out[site] = (apply_cut(w.a, tuple(c for c in cut if c[0] != out_dim)),
                     apply_cut(w.b, tuple(c for c in cut if c[0] != in_dim)))
    return out


def load_rank(path, cfg, plan):
    return pa.load_adapter_shard(path, cfg, name="t", max_rank=16, plan=plan)


CASES = [("qwen3_moe", lay, p) for lay in ("per_expert", "peft", "peft_old", "packed", "packed_apart")
         for p in (TP2, EP2)] + [
    ("qwen3_moe", "peft", TP4), ("qwen3_moe", "per_expert", TP4),  # KV heads replicated (2 over 4 ranks)
    ("deepseek_v3", "per_expert", TP2), ("deepseek_v3", "peft", EP2), ("deepseek_v3", "packed", TP2),
    ("qwen2_moe", "peft", TP2), ("mixtral", "per_expert", EP2), ("mixtral", "per_expert", TP2),
    ("glm4_moe", "packed_apart", EP2)]


@pytest.mark.parametrize("family,layout,parallel", CASES,
                         ids=[f"{f}-{lay}-{'ep' if p[1] else 'tp'}{p[0]}" for f, lay, p in CASES])
def test_rank_adapter_equals_the_whole_adapter_cut(adapters, family, layout, parallel):
    path, cfg = adapters(family, layout)
    whole = load_adapter(path, cfg, name="t", max_rank=16)
    for rank in range(parallel[0]):
        plan = ShardPlan(rank, *parallel)
        want, got = cut_whole(whole, plan, cfg), load_rank(path, cfg, plan).sites
        assert set(got) == set(want)
        for site, (a, b) in want.items():
            assert got[site].a.shape == a.shape and got[site].b.shape == b.shape, (site, rank)
            assert torch.equal(got[site].a, a) and torch.equal(got[site].b, b), (site, rank)
        assert any(got[s].a.shape != whole.sites[s].a.shape or got[s].b.shape != whole.sites[s].b.shape
                   for s in got), "a split model cuts some site"


@pytest.mark.parametrize("layout,parallel", [("peft", TP2), ("peft", EP2), ("packed", TP2), ("packed", EP2),
                                             ("per_expert", EP2)])
def test_rank_reads_only_its_slices(adapters, monkeypatch, layout, parallel):
    """Layouts whose canonical tensors hold exactly the file's elements ((b), fused (c)): a rank reads as many
    elements as its cut holds; (a) under EP: no key of another rank's experts is read."""
    path, cfg = adapters("qwen3_moe", layout)
    file_elems = sum(t.numel() for t in load_file(str(path / "adapter_model.safetensors")).values())
    for rank in range(parallel[0]):
        reads = []
        real = pa._read_slice

        def recording(f, key, cut, reads=reads, real=real):
            out = real(f, key, cut)
            reads.append((key, out.numel()))
            return out
        monkeypatch.setattr(pa, "_read_slice", recording)
        sites = load_rank(path, cfg, ShardPlan(rank, *parallel)).sites
        monkeypatch.undo()
        read = sum(n for _, n in reads)
        assert read < file_elems
        if layout == "per_expert":
            first = rank * 3  # 6 experts, 3 a rank
            experts = {int(m[1]) for k, _ in reads if (m := re.search(r"\.experts\.(\d+)\.", k))}
            assert experts == set(range(first, first + 3))
        else:
            assert read == sum(w.a.numel() + w.b.numel() for w in sites.values())
        if layout == "peft" and parallel[1]:  # down's B [H, E*r] (r=2): its 3 experts' r column blocks
            assert [n for k, n in reads if k.endswith("experts.lora_B.weight")] == [48 * 3 * 2] * 2  # 2 MoE layers


def _edit(path, out, edit_tensors=None, edit_config=None):
    sd, cfg = load_file(str(path / "adapter_model.safetensors")), json.loads((path / "adapter_config.json").read_text())
    if edit_tensors:
        edit_tensors(sd)
    if edit_config:
        edit_config(cfg)
    out.mkdir()
    save_file({k: v.contiguous() for k, v in sd.items()}, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    return out


def _wrapper_b(sd):
    return next(k for k in sd if k.endswith("experts.lora_B.weight"))


@pytest.mark.parametrize("layout,edit", [
    ("per_expert", lambda sd: sd.update({"base_model.model.model.layers.0.mlp.foo.lora_A.weight": torch.ones(2)})),
    ("per_expert", lambda sd: sd.pop("base_model.model.model.layers.2.mlp.experts.4.down_proj.lora_A.weight")),
    ("packed", lambda sd: sd.update({k: v[:, :-1] for k, v in sd.items() if k.endswith("down_proj.lora_A.weight")})),
    ("peft", lambda sd: sd.update({_wrapper_b(sd): sd[_wrapper_b(sd)][:, :-3]})),
    ("peft", lambda sd: sd.update({"base_model.model.model.embed_tokens.lora_A.weight": torch.ones(2, 2)})),
])
def test_refusals_name_what_the_one_process_loader_names(adapters, tmp_path, layout, edit):
    path, cfg = adapters("qwen3_moe", layout)
    bad = _edit(path, tmp_path / "bad", edit)
    with pytest.raises(AdapterError) as whole:
        load_adapter(bad, cfg, name="t", max_rank=16)
    for plan in (ShardPlan(1, *TP2), ShardPlan(0, *EP2)):
        with pytest.raises(AdapterError) as sliced:
            load_rank(bad, cfg, plan)
        assert str(sliced.value) == str(whole.value)


def test_non_finite_values_are_refused_by_the_rank_that_reads_them(adapters, tmp_path):
    path, cfg = adapters("qwen3_moe", "packed")
    key = "base_model.model.model.layers.0.mlp.experts.down_proj.lora_A.weight"  # [E, r, I]: expert 5's column 39

    def poison(sd):
        sd[key][5, 0, 39] = float("nan")
    bad = _edit(path, tmp_path / "nan", poison)
    with pytest.raises(AdapterError, match=re.escape(f"adapter tensor {key} contains NaN or Inf")):
        load_adapter(bad, cfg, name="t", max_rank=16)
    for rank, parallel in ((1, TP2), (1, EP2)):  # the rank that holds it refuses, with the same words
        with pytest.raises(AdapterError, match=re.escape(f"adapter tensor {key} contains NaN or Inf")):
            load_rank(bad, cfg, ShardPlan(rank, *parallel))
    for rank, parallel in ((0, TP2), (0, EP2)):  # its peer reads none of it (the group fails the load on both)
        load_rank(bad, cfg, ShardPlan(rank, *parallel))
