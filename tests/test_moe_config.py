"""Launch configs of the fused MoE: which LoRA path a pool takes, validation, the tuned tables."""

from __future__ import annotations

import json

import pytest
import torch

from moelora.kernels.moe_config import (
    CONFIG_DIR,
    FusedMoEConfig,
    check_table_file,
    default_fused_moe_config,
    tuned_fused_moe_config,
)


def test_wide_pools_take_their_own_mode():
    assert FusedMoEConfig(lora_shrink="route").shrink_mode(16) == "route"
    assert FusedMoEConfig(lora_shrink="route").shrink_mode(64) == "route"
    # "inline" computes every column of the pool: only rank-16 pools keep it
    assert FusedMoEConfig(lora_shrink="inline").shrink_mode(16) == "inline"
    assert FusedMoEConfig(lora_shrink="inline").shrink_mode(32) == "separate"
    wide = FusedMoEConfig(lora_shrink="separate", lora_shrink_wide="block")
    assert (wide.shrink_mode(16), wide.shrink_mode(32), wide.shrink_mode(64)) == ("separate", "block", "block")


@pytest.mark.parametrize("bad", ["inline", "gather"])
def test_wide_mode_is_validated(bad):
    with pytest.raises(ValueError, match="lora_shrink_wide"):
        FusedMoEConfig(lora_shrink_wide=bad)


def test_every_tuned_entry_parses_and_round_trips():
    for path in CONFIG_DIR.glob("fused_moe_*.json"):
        for shape, per_m in json.loads(path.read_text())["configs"].items():
            for m, d in per_m.items():
                cfg = FusedMoEConfig.from_dict(d)  # validates block sizes and modes
                assert FusedMoEConfig.from_dict(cfg.to_dict()) == cfg, (path.name, shape, m)


def test_h200_table_lookup_picks_the_smallest_tuned_m_at_or_above():
    # Qwen3-30B-A3B routed experts; 300 tokens use the M=512 entry, whose wide pools go "block"
    cfg = tuned_fused_moe_config(128, 2048, 768, 300, 8, torch.bfloat16, "NVIDIA H200")
    want = json.loads((CONFIG_DIR / "fused_moe_nvidia_h200.json").read_text())["configs"][
        "E=128,H=2048,I=768,dtype=bfloat16"]["512"]
    assert cfg == FusedMoEConfig.from_dict(want)
    # an unknown GPU falls back to the heuristic default
    assert tuned_fused_moe_config(128, 2048, 768, 300, 8, torch.bfloat16, "Some GPU") != cfg


def test_a_table_file_replaces_the_packages(tmp_path):
    # a deployment's own table (e.g. a tuner's output) for one call; the package's otherwise
    key = "E=128,H=2048,I=768,dtype=bfloat16"
    mine = FusedMoEConfig(32, lora_shrink="block", lora_block_m=16, lora_block_n=128)
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
