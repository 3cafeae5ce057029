"""Every FP8 refusal has a message: unsupported schemes (ConfigError naming the field and value), broken FP8
checkpoints (CheckpointError naming the key and both shapes or dtypes), inconsistent engine settings."""

from __future__ import annotations

import copy
import dataclasses
import json
import types

import pytest
import torch
from safetensors.torch import load_file, save_file

from moelora import LLM
from moelora.config import ModelConfig
from moelora.demo import model_dir
from moelora.engine.config import EngineConfig
from moelora.errors import CheckpointError, ConfigError
from moelora.quant.config import parse_quantization_config
from tests.helpers.fp8_oracle import quantization_config, write_fp8_checkpoint
from tests.helpers.oracle import tiny_hf_model

BLOCK = quantization_config("block")
CT = quantization_config("channel")


def _ct(**weights):
    cfg = copy.deepcopy(CT)
    cfg["config_groups"]["group_0"]["weights"].update(weights)
    return cfg


def _ct_act(value):
    cfg = copy.deepcopy(CT)
    cfg["config_groups"]["group_0"]["input_activations"] = value
    return cfg


def _two_groups():
    cfg = copy.deepcopy(CT)
    other = copy.deepcopy(cfg["config_groups"]["group_0"])
    other["weights"]["strategy"] = "tensor"
    cfg["config_groups"]["group_1"] = other
    return cfg


@pytest.mark.parametrize("raw,needle", [
    ({"quant_method": "awq", "bits": 4}, "quant_method='awq'"),
    ({"quant_method": "bitsandbytes"}, "quant_method='bitsandbytes'"),
    (dict(BLOCK, fmt="e5m2"), "fmt='e5m2'"),
    (dict(BLOCK, activation_scheme="static"), "activation_scheme='static'"),
    (dict(BLOCK, weight_block_size=[64, 64]), r"weight_block_size=\[64, 64\]"),
    ({k: v for k, v in BLOCK.items() if k != "weight_block_size"}, "weight_block_size=None"),
    (dict(BLOCK, scale_fmt="e8m0x"), "scale_fmt='e8m0x'"),
    (dict(CT, format="int-quantized"), "format='int-quantized'"),
    (dict(CT, format="pack-quantized"), "format='pack-quantized'"),
    (dict(CT, kv_cache_scheme={"num_bits": 8}), "kv_cache_scheme"),
    (dict(CT, quantization_status="frozen"), "quantization_status='frozen'"),
    (dict(CT, config_groups={}), "no config_groups"),
    (_ct(num_bits=4), "num_bits=4"),
    (_ct(type="int"), "type='int'"),
    (_ct(symmetric=False), "symmetric=False"),
    (_ct(strategy="block", block_structure=[64, 64]), r"block_structure=\[64, 64\]"),
    (_ct(strategy="block"), "block_structure=None"),
    (_ct(strategy="group", group_size=128), "strategy='group'"),
    (_ct_act({"num_bits": 8, "type": "float", "dynamic": False, "strategy": "tensor"}), "static activation"),
    (_ct_act({"num_bits": 8, "type": "float", "dynamic": True, "strategy": "group", "group_size": 64}),
     "group_size=64"),
    (_ct_act({"num_bits": 8, "type": "float", "dynamic": True, "strategy": "tensor"}), "strategy='tensor'"),
    (_ct_act({"num_bits": 8, "type": "int", "dynamic": True, "strategy": "token"}), "type='int'"),
    (_two_groups(), "different schemes"),
])
def test_unsupported_schemes_are_refused(raw, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_quantization_config(raw)


def test_minimax_m2_quantization_config_is_the_block_scheme():
    """MiniMax-M2's released `quantization_config` spells the format as the torch dtype and keeps its routers, their
    correction biases and the LM head unquantized."""
    minimax = parse_quantization_config({
        "activation_scheme": "dynamic", "fmt": "float8_e4m3fn", "quant_method": "fp8", "weight_block_size": [128, 128],
        "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]})
    assert minimax == dataclasses.replace(parse_quantization_config(BLOCK), ignore=minimax.ignore)
    assert minimax.ignores("model.layers.7.block_sparse_moe.gate") and minimax.ignores("lm_head")
    assert not minimax.ignores("model.layers.7.block_sparse_moe.experts.3.w1")


def test_accepted_schemes():
    block = parse_quantization_config(dict(BLOCK, scale_fmt="ue8m0"))
    assert (block.method, block.weights, block.activations, block.block, block.scale_key) == (
        "fp8", "block", "group", (128, 128), "weight_scale_inv")
    assert block.activation_group == 128 and block.ignores("lm_head") and not block.ignores("model.layers.0.mlp")
    ct = parse_quantization_config(CT)
    assert (ct.method, ct.weights, ct.activations, ct.scale_key, ct.activation_group) == (
        "compressed-tensors", "channel", "token", "weight_scale", None)
    assert ct.ignores("model.layers.3.mlp.gate") and not ct.ignores("model.layers.3.mlp.gate_proj")
    weight_only = parse_quantization_config(_ct_act(None))
    assert weight_only.activations == "none"
    block = parse_quantization_config(quantization_config("ct_block"))
    assert (block.weights, block.activations, block.activation_group, block.scale_key) == (
        "block", "group", 128, "weight_scale")


def test_ignore_matching():
    cfg = parse_quantization_config(dict(BLOCK, modules_to_not_convert=["model.layers.1", "o_proj"]))
    assert cfg.ignores("model.layers.1.self_attn.q_proj") and not cfg.ignores("model.layers.11.self_attn.q_proj")
    assert cfg.ignores("model.layers.4.self_attn.o_proj") and not cfg.ignores("model.layers.4.self_attn.o_proj2")
    regex = parse_quantization_config(dict(BLOCK, modules_to_not_convert=[r"model\.layers\.\d+\.mlp\.gate", "(bad"]))
    assert regex.ignores("model.layers.7.mlp.gate") and not regex.ignores("model.layers.7.mlp.gate_proj")


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    hf = tiny_hf_model("qwen3_moe", seed=2)
    return write_fp8_checkpoint(hf, tmp_path_factory.mktemp("fp8") / "model", "block", "per_expert")


def _tampered(src, dst, change):
    dst.mkdir()
    tensors = load_file(str(src / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


def _load(path, **kw):
    return LLM(path, device="cpu", dtype="float32", max_loras=1, **kw)


SCALE = "model.layers.0.mlp.experts.3.up_proj.weight_scale_inv"
K_PROJ, ROUTER = "model.layers.0.self_attn.k_proj.weight", "model.layers.0.mlp.gate.weight"


@pytest.mark.parametrize("change,needle", [
    (lambda t: t.pop(SCALE), f"lacks 1 tensor.*{SCALE}"),
    (lambda t: t.pop("model.layers.1.self_attn.o_proj.weight_scale_inv"), "o_proj.weight_scale_inv"),
    (lambda t: t.update({SCALE: torch.ones(2, 1)}), rf"{SCALE}' has shape \[2, 1\].*expected \[1, 1\]"),
    (lambda t: t.update({"model.layers.0.self_attn.q_proj.weight_scale_inv": torch.ones(1)}),
     r"q_proj.weight_scale_inv' has shape \[1\].*expected \[1, 1\]"),
    (lambda t: t.update({K_PROJ: t[K_PROJ].float()}),
     "k_proj.weight' is F32 in the checkpoint, but moelora holds .* in float8_e4m3fn"),
    (lambda t: t.update({ROUTER: t[ROUTER].to(torch.float8_e4m3fn)}),
     "mlp.gate.weight' is float8_e4m3fn in the checkpoint, but moelora holds .* in float32"),
    (lambda t: t.update({"model.layers.0.mlp.experts.0.down_proj.input_scale": torch.ones(1)}),
     "unexpected tensor 'model.layers.0.mlp.experts.0.down_proj.input_scale'"),
])
def test_broken_fp8_checkpoints_are_refused(fp8_dir, tmp_path, change, needle):
    with pytest.raises(CheckpointError, match=needle):
        _load(_tampered(fp8_dir, tmp_path / "bad", change))


def test_compressed_tensors_missing_scale_is_named_in_its_spelling(tmp_path):
    hf = tiny_hf_model("qwen3_moe", seed=2)
    src = write_fp8_checkpoint(hf, tmp_path / "ct", "tensor", "per_expert")
    key = "model.layers.2.mlp.experts.1.gate_proj.weight_scale"
    with pytest.raises(CheckpointError, match=f"lacks 1 tensor.*'{key}'"):
        _load(_tampered(src, tmp_path / "bad", lambda t: t.pop(key)))


def test_ignored_projection_is_refused(fp8_dir, tmp_path):
    bad = _tampered(fp8_dir, tmp_path / "bad", lambda t: None)
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"] = ["lm_head", "model.layers.2.self_attn.o_proj"]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"leaves 1 projection\(s\) unquantized.*layers.2.self_attn.o_proj"):
        _load(bad)


def test_engine_quantization_settings_are_checked(fp8_dir, monkeypatch):
    fp8 = ModelConfig.from_hf(fp8_dir)
    plain = ModelConfig.from_dict({k: v for k, v in json.loads((fp8_dir / "config.json").read_text()).items()
                                   if k != "quantization_config"})
    cases = [(EngineConfig(device="cpu", quantization="int8"), plain, "quantization='int8'"),
             (EngineConfig(device="cpu", quantization="compressed-tensors"), fp8, "does not match"),
             (EngineConfig(device="cpu", quantization="compressed-tensors"), plain, "needs a compressed-tensors"),
             (EngineConfig(device="cpu", fp8_activation_quant=True), plain, "needs FP8 weights")]
    for cfg, model, needle in cases:
        with pytest.raises(ConfigError, match=needle):
            cfg.resolve(model)
    assert EngineConfig(device="cpu", quantization="fp8").resolve(fp8).fp8_config(fp8).method == "fp8"
    assert EngineConfig(device="cpu", quantization="fp8").resolve(plain).fp8_config(plain).on_load
    assert EngineConfig(device="cpu").resolve(plain).fp8_config(plain) is None
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the Triton backend on the CPU: the interpreter's
    w8a8 = EngineConfig(device="cpu", kernel_backend="triton", fp8_activation_quant=True).resolve(fp8)
    assert w8a8.fp8_config(fp8).quantize_activations  # the W8A8 kernels


def test_fp8_on_a_gpu_without_fp8_support_is_refused(fp8_dir, monkeypatch):
    """Before sm_89 the Triton backend refuses FP8 weights (never a silent bf16 upcast of the model)."""
    fp8 = ModelConfig.from_hf(fp8_dir)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    a100 = types.SimpleNamespace(total_memory=80 * 2**30)  # resolve reads it for max_num_batched_tokens' default
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: a100)
    with pytest.raises(ConfigError, match=r"compute capability >= 8.9.*sm_80.*kernel_backend='torch'"):
        EngineConfig(device="cuda", kernel_backend="triton").resolve(fp8)
    assert EngineConfig(device="cuda", kernel_backend="torch").resolve(fp8).fp8_config(fp8) is not None


def test_fp8_activation_quant_defaults_to_w8a8_on_the_gpu_kernels_only(fp8_dir, monkeypatch):
    """Unset, an FP8 model runs W8A8 on the Triton backend of a CUDA GPU with FP8 tensor cores (as vLLM and SGLang
    serve these checkpoints) and W8A16 on the torch backend (the dequantized twin `moelora verify` compares); a
    bf16 model stays unquantized; an explicit setting wins either way."""
    fp8 = ModelConfig.from_hf(fp8_dir)
    plain = ModelConfig.from_dict({k: v for k, v in json.loads((fp8_dir / "config.json").read_text()).items()
                                   if k != "quantization_config"})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    h200 = types.SimpleNamespace(total_memory=141 * 10**9)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: h200)

    def w8a8(model, **kw):
        cfg = EngineConfig(**kw).resolve(model)
        return cfg.fp8_activation_quant, (cfg.fp8_config(model) and cfg.fp8_config(model).quantize_activations)

    assert w8a8(fp8, device="cuda") == (True, True)
    assert w8a8(plain, device="cuda", quantization="fp8") == (True, True)  # quantized while loading
    assert w8a8(fp8, device="cuda", kernel_backend="torch") == (False, False)
    assert w8a8(fp8, device="cpu") == (False, False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the Triton backend on the CPU is the interpreter's
    assert w8a8(fp8, device="cpu", kernel_backend="triton") == (False, False)  # the interpreter: no FP8 MMA
    assert w8a8(plain, device="cuda") == (False, None)
    assert w8a8(fp8, device="cuda", fp8_activation_quant=False) == (False, False)
    assert w8a8(fp8, device="cpu", fp8_activation_quant=True) == (True, True)


EXPERTS = "model.layers.3.mlp.experts"


@pytest.mark.parametrize("key,target", [
    ("model.layers.3.mlp.experts.5.up_proj.weight_scale_inv", (f"{EXPERTS}.gate_up_proj_scale_inv", 5, 1)),
    ("model.layers.2.block_sparse_moe.experts.1.w2.weight_scale_inv",
     ("model.layers.2.mlp.experts.down_proj_scale_inv", 1, None)),
    (f"{EXPERTS}.gate_up_proj_scale_inv", (f"{EXPERTS}.gate_up_proj_scale_inv", None, None)),
    ("model.layers.0.self_attn.q_proj.weight_scale_inv", ("model.layers.0.self_attn.q_proj.weight_scale_inv",)),
])
def test_scale_keys_map_like_their_weights(key, target):
    from moelora.models.weights import KeyTarget, checkpoint_key, map_checkpoint_key

    got = map_checkpoint_key(key)
    assert got == KeyTarget(*target)
    style = "mixtral" if "block_sparse_moe" in key else "hub"
    assert checkpoint_key(got, style) == key


def test_compressed_tensors_scale_spelling():
    from moelora.quant.checkpoint import FP8Loading

    rules = FP8Loading(parse_quantization_config(CT))
    key = "model.layers.0.mlp.experts.5.up_proj.weight_scale"
    assert rules.rename(key) == key + "_inv" and rules.spell(key + "_inv") == key
    assert FP8Loading(parse_quantization_config(BLOCK)).rename(key) == key  # only compressed-tensors renames


def test_serve_flag_fp8_activation_quant_reaches_the_engine_config():
    """`moelora serve --[no-]fp8-activation-quant` sets W8A8 / W8A16 (unset: the engine's default, W8A8 on the GPU
    kernels); an explicit W8A8 without FP8 weights is refused by the resolved config, naming why."""
    from moelora.cli import build_parser, serve_engine_config

    assert serve_engine_config(build_parser().parse_args(["serve"])).fp8_activation_quant is None
    on = serve_engine_config(build_parser().parse_args(["serve", "-q", "fp8", "--fp8-activation-quant"]))
    assert on.fp8_activation_quant is True and on.quantization == "fp8"
    off = serve_engine_config(build_parser().parse_args(["serve", "-q", "fp8", "--no-fp8-activation-quant"]))
    assert off.fp8_activation_quant is False
    bare = serve_engine_config(build_parser().parse_args(["serve", "--fp8-activation-quant"]))
    with pytest.raises(ConfigError, match="fp8_activation_quant needs FP8 weights"):
        bare.resolve(ModelConfig.from_hf(model_dir()))
