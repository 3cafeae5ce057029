"""scripts/ab_compare.py: per-row medians of the A/B rounds, head over base."""

from __future__ import annotations

import csv
from pathlib import Path

from tests.helpers.scripts import load_script

ab_compare = load_script("scripts/ab_compare.py")


def _write(path: Path, rows: list[dict]) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def _layer(M, variant, chain_ms, graph_ms=0.5):
    return dict(shape="qwen3", M=M, variant=variant, graph_ms=graph_ms, chain_ms=chain_ms)


def test_medians_ratio_and_fallback_to_graph_time(tmp_path):
    _write(tmp_path / "moe_lora_layer_base_r1.csv", [_layer(8, "off", 0.100), _layer(8, "8ad_r16", "nan", 0.200)])
    _write(tmp_path / "moe_lora_layer_base_r2.csv", [_layer(8, "off", 0.104), _layer(8, "8ad_r16", "nan", 0.210)])
    _write(tmp_path / "moe_lora_layer_base_r3.csv", [_layer(8, "off", 0.300), _layer(8, "8ad_r16", "nan", 0.220)])
    _write(tmp_path / "moe_lora_layer_r1.csv", [_layer(8, "off", 0.102), _layer(8, "8ad_r16", "nan", 0.105)])
    lines = ab_compare.compare(tmp_path, "moe_lora_layer")
    assert len(lines) == 2
    off = next(ln for ln in lines if " off " in ln)
    assert "base     104.0 us" in off and "head     102.0 us" in off  # median of 100 / 104 / 300
    lora = next(ln for ln in lines if "8ad_r16" in ln)
    assert "base     210.0 us" in lora and "head/base  0.500" in lora  # chain "nan": graph_ms taken
    assert ab_compare.main([str(tmp_path / "missing")]) == 1
