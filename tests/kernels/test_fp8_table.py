"""The fused-MoE table's FP8 entries: W8A16 and W8A8 keys apart, their fallbacks, and the tuner's FP8 search space
(benchmarks/tune_fp8.py)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("triton")  # the tuner's modules import the kernels

from moelora.kernels.fp8_moe import fp8_moe_config, fp8_table_key, fp8_tiles  # noqa: E402
from moelora.kernels.moe_config import CONFIG_DIR, FusedMoEConfig, GemmTile, shape_key  # noqa: E402
from moelora.kernels.moe_lora import BlockConfig, RouteConfig, StackedConfig  # noqa: E402
from tests.helpers.scripts import load_script  # noqa: E402

BF16 = FusedMoEConfig(32, GemmTile(64, 64, 4, 3), GemmTile(32, 64, 4, 3), use_tma=True, lora=BlockConfig(block_n=128))
W8A16 = FusedMoEConfig(16, GemmTile(64, 128, 4, 4), GemmTile(128, 128, 8, 3))
W8A8 = FusedMoEConfig(64, GemmTile(128, 128, 8, 4), GemmTile(64, 128, 8, 3), lora=RouteConfig(order="plan"))


def write_table(tmp_path, name: str, entries: dict) -> str:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"device": "x", "configs": {k: {"64": v.to_dict()} for k, v in entries.items()}}))
    return str(path)


def pick(table: str, act: bool) -> FusedMoEConfig:
    return fp8_moe_config(8, 256, 128, 40, 2, torch.bfloat16, "x", table, act)


def test_the_two_fp8_modes_have_their_own_keys():
    assert fp8_table_key(128, 2048, 768, False) == shape_key(128, 2048, 768, torch.float8_e4m3fn)
    assert fp8_table_key(128, 2048, 768, True) == "E=128,H=2048,I=768,dtype=float8_e4m3fn,act=float8_e4m3fn"


def test_w8a8_takes_its_entry_then_w8a16s_then_bf16s_on_fp8_tiles(tmp_path):
    bf16_key = shape_key(8, 256, 128, torch.bfloat16)
    a16_key, a8_key = fp8_table_key(8, 256, 128, False), fp8_table_key(8, 256, 128, True)
    every = write_table(tmp_path, "every", {bf16_key: BF16, a16_key: W8A16, a8_key: W8A8})
    assert (pick(every, True), pick(every, False)) == (W8A8, W8A16)
    no_a8 = write_table(tmp_path, "no_a8", {bf16_key: BF16, a16_key: W8A16})
    assert (pick(no_a8, True), pick(no_a8, False)) == (W8A16, W8A16)
    only_a8 = write_table(tmp_path, "only_a8", {bf16_key: BF16, a8_key: W8A8})
    assert (pick(only_a8, True), pick(only_a8, False)) == (W8A8, fp8_tiles(BF16))


def test_the_packaged_fp8_entries_run_on_the_fp8_grid():
    """Every FP8 entry of the shipped tables: K steps of one scale block, no TMA (check_fp8 would refuse)."""
    for path in CONFIG_DIR.glob("fused_moe_*.json"):
        for key, per_m in json.loads(path.read_text())["configs"].items():
            if "float8" not in key:
                continue
            for m, d in per_m.items():
                cfg = FusedMoEConfig.from_dict(d)
                assert (cfg.gate_up.block_k, cfg.down.block_k, cfg.use_tma) == (128, 128, False), (path.name, key, m)


def test_fp8_search_space():
    fp8_candidates = load_script("benchmarks/tune_fp8.py").fp8_candidates

    qwen3, dsv2 = dict(E=128, K=8), dict(E=64, K=6)
    for shape in (qwen3, dsv2):
        for M in (1, 8, 64, 512, 4096):
            cfgs = fp8_candidates(M, shape)
            assert cfgs and len(set(cfgs)) == len(cfgs)
            assert all(c.gate_up == c.down and c.gate_up.block_k == 128 and not c.use_tma for c in cfgs)
    assert {c.block_m for c in fp8_candidates(8, qwen3)} == {16}  # decode: one route an expert, the least padding
    assert {c.block_m for c in fp8_candidates(512, qwen3)} >= {32, 64, 128}  # 32 routes an expert
    assert all(c.gate_up.num_warps == 8 for c in fp8_candidates(512, qwen3)
               if c.block_m * c.gate_up.block_n >= 64 * 128)  # W8A8's gate_up spills these at 4 warps


def test_split_refinements_swap_one_gemms_tile_within_the_block_m():
    split_refinements = load_script("benchmarks/tune_fp8.py").split_refinements

    t = [GemmTile(n, 128, w, 3) for n, w in ((64, 4), (128, 8), (256, 8))]
    tried = [FusedMoEConfig(32, t[0], t[0]), FusedMoEConfig(32, t[1], t[1]), FusedMoEConfig(64, t[2], t[2])]
    best = tried[0]
    assert split_refinements(best, tried, "down") == [FusedMoEConfig(32, t[0], t[1])]
    assert split_refinements(best, tried, "gate_up") == [FusedMoEConfig(32, t[1], t[0])]


def test_tiles_only_entries_take_the_bf16_entrys_lora_fields():
    lora_fields_from = load_script("benchmarks/tune_fp8.py").lora_fields_from

    src = FusedMoEConfig(lora=StackedConfig(stack_n=64), lora_wide=RouteConfig(order="plan"))
    assert lora_fields_from(src.to_dict()) == dict(lora=src.lora, lora_wide=src.lora_wide)
    assert lora_fields_from({}) == {}
