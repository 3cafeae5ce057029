"""The command line: `moelora verify` against transformers + PEFT, argument errors."""

from __future__ import annotations

import pytest
from oracle import tiny_hf_model
from oracle_lora import build_peft_adapter

from moelora.cli import main


def test_verify_reports_each_adapter(tmp_path, capsys):
    hf = tiny_hf_model("qwen3_moe", seed=5)
    hf.save_pretrained(str(tmp_path / "m"))
    adapter = build_peft_adapter(hf, tmp_path / "ad", seed=4, r=4)
    rc = main(["verify", str(tmp_path / "m"), "--lora", f"mine={adapter}", "--tolerance", "1e-4"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "base" in out and "mine" in out and out.count(" ok") == 2


def test_verify_catches_a_mismatch_and_a_broken_checkpoint(tmp_path, capsys, monkeypatch):
    from safetensors.torch import load_file, save_file

    from moelora.models.decoder import MoECausalLM

    hf = tiny_hf_model("qwen3_moe", seed=5)
    hf.save_pretrained(str(tmp_path / "m"))
    adapter = build_peft_adapter(hf, tmp_path / "ad", seed=4, r=4)
    original = MoECausalLM.set_lora_slot
    monkeypatch.setattr(MoECausalLM, "set_lora_slot", lambda self, slot, ad: original(self, slot, None))
    rc = main(["verify", str(tmp_path / "m"), "--lora", f"mine={adapter}"])
    out = capsys.readouterr().out
    assert rc == 1 and "MISMATCH" in out  # moelora silently dropping the adapter is reported
    monkeypatch.undo()
    weights = load_file(str(tmp_path / "m" / "model.safetensors"))
    del weights["model.layers.0.self_attn.k_proj.weight"]
    save_file(weights, str(tmp_path / "m" / "model.safetensors"), metadata={"format": "pt"})
    rc = main(["verify", str(tmp_path / "m")])
    err = capsys.readouterr().err
    assert rc == 2 and "CheckpointError" in err and "model.layers.0.self_attn.k_proj.weight" in err


def test_bad_lora_argument():
    with pytest.raises(SystemExit, match="NAME=PATH"):
        main(["verify", "x", "--lora", "nopath"])


def test_serve_flags_reach_the_engine_config():
    from moelora.cli import build_parser, serve_engine_config

    args = build_parser().parse_args(["serve", "--no-async-adapter-loading", "--async-scheduling",
                                      "--kernel-backend", "torch",
                                      "--no-overlap-shared-experts", "--no-enable-prefix-caching", "--enforce-eager",
                                      "--no-overlap-lora", "--max-loras", "3", "--lora-target-modules", "q_proj",
                                      "experts", "--fused-moe-table", "mine.json"])
    cfg = serve_engine_config(args)
    assert (cfg.async_adapter_loading, cfg.async_scheduling, cfg.kernel_backend, cfg.overlap_shared_experts,
            cfg.overlap_lora, cfg.enable_prefix_caching, cfg.enforce_eager, cfg.max_loras) == (
                False, True, "torch", False, False, False, True, 3)
    assert cfg.lora_target_modules == ("q_proj", "experts")
    assert cfg.fused_moe_table == "mine.json"
    default = serve_engine_config(build_parser().parse_args(["serve"]))
    assert (default.async_adapter_loading, default.async_scheduling, default.kernel_backend,
            default.overlap_shared_experts, default.overlap_lora, default.enable_prefix_caching) == (
                True, None, None, True, True, True)
    assert default.lora_target_modules is None and default.fused_moe_table is None
    assert serve_engine_config(build_parser().parse_args(["serve", "--no-async-scheduling"])).async_scheduling is False
