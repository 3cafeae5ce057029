"""Launch configs of the fused MoE: which LoRA path a pool takes, validation, the tuned tables."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("triton")  # the LoRA paths' configs live with their kernels

from moelora.kernels.moe_config import (  # noqa: E402
    CONFIG_DIR,
    FusedMoEConfig,
    check_table_file,
    default_fused_moe_config,
    tuned_fused_moe_config,
)
from moelora.kernels.moe_lora import PATHS, BlockConfig, RouteConfig, SeparateConfig, StackedConfig  # noqa: E402


def test_wide_pools_take_their_own_path():
    route = FusedMoEConfig(lora=RouteConfig())
    assert route.lora_for(16) is route.lora and route.lora_for(64) is route.lora
    wide = FusedMoEConfig(lora=SeparateConfig(), lora_wide=BlockConfig())
    assert [wide.lora_for(r).path for r in (16, 32, 64)] == ["separate", "block", "block"]


@pytest.mark.parametrize("bad", ["inline", "gather"])  # "inline": tried and removed (docs/performance.md)
def test_a_path_outside_the_registry_is_refused(bad):
    entry = FusedMoEConfig().to_dict()
    entry["lora"]["path"] = bad
    with pytest.raises(ValueError, match="must name a path"):
        FusedMoEConfig.from_dict(entry)
    with pytest.raises(ValueError, match="lora_wide"):
        FusedMoEConfig(lora_wide={"path": "block"})


@pytest.mark.parametrize("where,key", [(("lora",), "lora_expand_lanes"), (("tiles",), "group_m"),
                                       (("lora",), "stages"), (("tiles", "gate_up"), "num_warps_x"),
                                       ((), "lora_shrink"), (("lora", "wide"), "order_x"),
                                       (("lora", "wide", "overflow"), "lanes")])
def test_a_table_entry_with_an_unknown_key_is_refused_by_name(where, key):
    """A removed knob (or a typo) anywhere in a table entry is a ValueError naming it, not a silent default."""
    d = FusedMoEConfig(lora=BlockConfig(), lora_wide=StackedConfig()).to_dict()
    node = d
    for k in where:
        node = node[k]
    node[key] = 1
    with pytest.raises(ValueError, match=key):
        FusedMoEConfig.from_dict(d)


def test_a_table_entry_missing_its_tiles_or_lora_is_refused():
    d = FusedMoEConfig().to_dict()
    for part in ("tiles", "lora"):
        with pytest.raises(ValueError, match=part):
            FusedMoEConfig.from_dict({k: v for k, v in d.items() if k != part})


def test_every_tuned_entry_parses_and_round_trips():
    picked = set()
    for path in CONFIG_DIR.glob("fused_moe_*.json"):
        for shape, per_m in json.loads(path.read_text())["configs"].items():
            for m, d in per_m.items():
                cfg = FusedMoEConfig.from_dict(d)  # validates block sizes and paths
                assert FusedMoEConfig.from_dict(cfg.to_dict()) == cfg, (path.name, shape, m)
                assert FusedMoEConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
                picked |= {c.path for c in (cfg.lora, cfg.lora_wide) if c is not None}
    assert picked == set(PATHS), "every registered path is picked by some entry (the pruning rule)"


def test_h200_table_lookup_picks_the_smallest_tuned_m_at_or_above():
    # Qwen3-30B-A3B routed experts; 300 tokens use the M=512 entry
    cfg = tuned_fused_moe_config(128, 2048, 768, 300, 8, torch.bfloat16, "NVIDIA H200")
    want = json.loads((CONFIG_DIR / "fused_moe_nvidia_h200.json").read_text())["configs"][
        "E=128,H=2048,I=768,dtype=bfloat16"]["512"]
    assert cfg == FusedMoEConfig.from_dict(want) and cfg.lora.path == "stacked"
    # an unknown GPU falls back to the heuristic default
    assert tuned_fused_moe_config(128, 2048, 768, 300, 8, torch.bfloat16, "Some GPU") != cfg


def test_an_h100_takes_its_own_table_not_the_h200s_or_the_heuristic():
    # the name torch gives an H100 SXM; its table was tuned on one (48th session), its picks differ from the H200's
    h100 = json.loads((CONFIG_DIR / "fused_moe_nvidia_h100_80gb_hbm3.json").read_text())["configs"]
    h200 = json.loads((CONFIG_DIR / "fused_moe_nvidia_h200.json").read_text())["configs"]
    qwen3 = "E=128,H=2048,I=768,dtype=bfloat16"
    for m in ("8", "64", "4096"):
        cfg = tuned_fused_moe_config(128, 2048, 768, int(m), 8, torch.bfloat16, "NVIDIA H100 80GB HBM3")
        assert cfg == FusedMoEConfig.from_dict(h100[qwen3][m]), m
    assert h100[qwen3]["8"] != h200[qwen3]["8"]
    assert (tuned_fused_moe_config(128, 2048, 768, 8, 8, torch.bfloat16, "NVIDIA H100 80GB HBM3")
            != default_fused_moe_config(128, 2048, 768, 8, 8))


def test_on_path_keeps_the_entrys_own_knobs_of_that_path():
    cfg = FusedMoEConfig(lora=BlockConfig(block_n=256), lora_wide=RouteConfig(order="plan"))
    assert cfg.on_path("route") == cfg.with_lora(RouteConfig(order="plan"))
    assert cfg.on_path("block", programs=264).lora == BlockConfig(block_n=256, programs=264)
    assert cfg.on_path("separate").lora == SeparateConfig() and cfg.on_path("separate").lora_wide is None


def test_a_table_file_replaces_the_packages(tmp_path):
    # a deployment's own table (e.g. a tuner's output) for one call; the package's otherwise
    key = "E=128,H=2048,I=768,dtype=bfloat16"
    mine = FusedMoEConfig(32, lora=BlockConfig(block_m=16, block_n=128))
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"device": "NVIDIA H200", "configs": {key: {"64": mine.to_dict()}}}))
    table = check_table_file(path)
    args = (128, 2048, 768, 40, 8, torch.bfloat16, "NVIDIA H200")
    dsv2 = (64, 2048, 1408, 40, 6, torch.bfloat16, "NVIDIA H200")
    package = tuned_fused_moe_config(*args)
    assert package != mine
    assert tuned_fused_moe_config(*args, table) == mine
    # a shape the file lacks takes the heuristic default, not the package's entry for it
    assert tuned_fused_moe_config(*dsv2, table) == default_fused_moe_config(*dsv2[:5])
    assert tuned_fused_moe_config(*dsv2) != default_fused_moe_config(*dsv2[:5])
    assert tuned_fused_moe_config(*args) == package
    with pytest.raises(FileNotFoundError, match="no fused-MoE table file"):
        check_table_file(tmp_path / "missing.json")


@pytest.mark.parametrize("tokens", [1, 256, 1024, 4096])  # every regime of routes per expert (128 experts, top 8)
def test_default_configs_fit_shared_memory_in_fp32_and_keep_bf16s_stages(tokens):
    """fp32 tiles take twice bf16's bytes: the default's 3 stages of its largest gate_up tile (x 64 x 64 and the
    gate and up weights 64 x 128 each) needed 240 KiB, over the H100 / H200's 227 (a Triton OutOfResources at
    an fp32 engine's graph capture)."""
    bf16 = default_fused_moe_config(128, 2048, 768, tokens, 8)
    fp32 = default_fused_moe_config(128, 2048, 768, tokens, 8, elem_bytes=4)
    for cfg, elem in ((bf16, 2), (fp32, 4)):
        t = cfg.gate_up
        assert elem * t.num_stages * (cfg.block_m * t.block_k + 2 * t.block_k * t.block_n) <= 227 * 1024
    assert (bf16.gate_up.num_stages, fp32.gate_up.num_stages) == ((4, 2) if tokens <= 256 else (3, 2))
    assert tuned_fused_moe_config(128, 2048, 768, tokens, 8, torch.float32, "cpu") == fp32  # no fp32 entries
