"""A user's fused-MoE table is checked whole when the engine's config resolves: an entry that does not parse
is a ConfigError there naming the file, the entry (shape, M) and the key; the kernels raise ValueError."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("triton")  # the LoRA paths' configs live with their kernels

from moelora.config import ModelConfig  # noqa: E402
from moelora.demo import model_dir  # noqa: E402
from moelora.engine.config import EngineConfig  # noqa: E402
from moelora.errors import ConfigError  # noqa: E402
from moelora.kernels.moe_config import FusedMoEConfig, check_table_file  # noqa: E402

KEY = "E=128,H=2048,I=768,dtype=bfloat16"


def _table(tmp_path, entry) -> str:
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"device": "NVIDIA H200", "configs": {KEY: {"64": FusedMoEConfig().to_dict(),
                                                                           "256": entry}}}))
    return str(path)


def test_a_bad_entry_is_a_value_error_naming_the_entry_and_key(tmp_path):
    entry = FusedMoEConfig().to_dict()
    entry["lora"]["lora_expand_lanes"] = 4  # a removed knob
    with pytest.raises(ValueError, match=f"entry {KEY} M=256: .*lora_expand_lanes"):
        check_table_file(_table(tmp_path, entry))
    with pytest.raises(ValueError, match="must name a path"):
        check_table_file(_table(tmp_path, {"tiles": entry["tiles"], "lora": {"path": "inline"}}))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"device": "x"}))
    with pytest.raises(ValueError, match='"configs"'):
        check_table_file(bad)


def test_the_engine_reports_a_bad_table_as_a_config_error(tmp_path):
    model = ModelConfig.from_hf(model_dir())
    entry = FusedMoEConfig().to_dict()
    entry["tiles"]["group_m"] = 8
    with pytest.raises(ConfigError, match=r"fused_moe_table: .*table.json: entry .* M=256: .*group_m"):
        EngineConfig(device="cpu", fused_moe_table=_table(tmp_path, entry)).resolve(model)
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ConfigError, match="fused_moe_table: "):
        EngineConfig(device="cpu", fused_moe_table=str(tmp_path / "broken.json")).resolve(model)
    good = FusedMoEConfig().to_dict()
    assert EngineConfig(device="cpu", fused_moe_table=_table(tmp_path, good)).resolve(model).fused_moe_table
