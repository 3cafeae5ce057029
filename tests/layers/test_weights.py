"""Checkpoint loading: every on-disk form into NaN-poisoned destinations, against transformers' own
parameters (the oracle), plus every strictness error of contract 7."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from moelora.errors import CheckpointError
from moelora.models.weights import KeyTarget, checkpoint_key, load_checkpoint, map_checkpoint_key
from tests.helpers.models import hf_weights
from tests.helpers.oracle import DEEPSEEK_GLM_FAMILIES, FAMILIES, tiny_model_cache

GU = "mlp.experts.gate_up_proj"
DOWN = "mlp.experts.down_proj"


@pytest.fixture(scope="module")
def models():
    """Tiny randomised HF models, built once per family (and variant) for the whole module."""
    return tiny_model_cache(1)


def poisoned(model, dtype=None) -> dict[str, torch.Tensor]:
    """NaN-filled destinations shaped like the model's state_dict under moelora's names (`hf_weights`; no lm_head
    when tied)."""
    params = {k: torch.full(v.shape, float("nan"), dtype=dtype or v.dtype)
              for k, v in hf_weights(model).items()}
    if model.config.tie_word_embeddings:
        del params["lm_head.weight"]
    return params


def assert_loaded(model, params: dict[str, torch.Tensor]) -> None:
    expected = hf_weights(model)
    for name, got in params.items():
        want = expected[name].to(got.dtype)
        assert torch.equal(got, want), name


def disk_keys(model_dir) -> dict[str, list[int]]:
    shapes = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            shapes.update({k: f.get_slice(k).get_shape() for k in f.keys()})
    return shapes


def hub_state_dict(model, *, mixtral: bool) -> dict[str, torch.Tensor]:
    """The model's weights as per-expert Hub keys, written by hand (independent of transformers'
    own reverse conversion): gate = rows [:I] of gate_up_proj, up = rows [I:]."""
    gate, up, down, block = ("w1", "w3", "w2", "block_sparse_moe") if mixtral else \
        ("gate_proj", "up_proj", "down_proj", "mlp")
    out = {}
    for name, t in model.state_dict().items():
        if name.endswith(GU) or name.endswith(DOWN):
            prefix = name.rsplit("mlp.experts.", 1)[0] + f"{block}.experts."
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                if name.endswith(GU):
                    out[f"{prefix}{e}.{gate}.weight"] = t[e, :inter].clone()
                    out[f"{prefix}{e}.{up}.weight"] = t[e, inter:].clone()
                else:
                    out[f"{prefix}{e}.{down}.weight"] = t[e].clone()
        elif mixtral and name.endswith("mlp.gate.weight"):
            out[name.replace("mlp.gate.weight", "block_sparse_moe.gate.weight")] = t.clone()
        else:
            out[name] = t.clone()
    return out


def write_single(model_dir, tensors: dict[str, torch.Tensor]):
    model_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(model_dir / "model.safetensors"))
    return model_dir


def saved(model, model_dir, **kwargs):
    model.save_pretrained(str(model_dir), **kwargs)
    return model_dir


# ---------------------------------------------------------------- the pure name mapping


@pytest.mark.parametrize("key, target", [
    ("model.embed_tokens.weight", KeyTarget("model.embed_tokens.weight")),
    ("model.layers.3.self_attn.q_proj.bias", KeyTarget("model.layers.3.self_attn.q_proj.bias")),
    ("model.layers.0.mlp.experts.gate_up_proj", KeyTarget("model.layers.0.mlp.experts.gate_up_proj")),
    ("model.layers.2.mlp.experts.11.gate_proj.weight", KeyTarget(f"model.layers.2.{GU}", 11, 0)),
    ("model.layers.2.mlp.experts.0.up_proj.weight", KeyTarget(f"model.layers.2.{GU}", 0, 1)),
    ("model.layers.2.mlp.experts.5.down_proj.weight", KeyTarget(f"model.layers.2.{DOWN}", 5)),
    ("model.layers.1.block_sparse_moe.experts.3.w1.weight",
     KeyTarget("model.layers.1.mlp.experts.gate_up_proj", 3, 0)),
    ("model.layers.1.block_sparse_moe.experts.3.w3.weight",
     KeyTarget("model.layers.1.mlp.experts.gate_up_proj", 3, 1)),
    ("model.layers.1.block_sparse_moe.experts.3.w2.weight", KeyTarget(f"model.layers.1.{DOWN}", 3)),
    ("model.layers.1.block_sparse_moe.gate.weight", KeyTarget("model.layers.1.mlp.gate.weight")),
    ("model.layers.1.mlp.shared_expert.up_proj.weight",
     KeyTarget("model.layers.1.mlp.shared_expert.up_proj.weight")),
    ("model.layers.1.mlp.up_proj.weight", KeyTarget("model.layers.1.mlp.up_proj.weight")),
    # mixed spellings are not a known form: they stay as they are (and are then unexpected)
    ("model.layers.1.mlp.experts.3.w1.weight", KeyTarget("model.layers.1.mlp.experts.3.w1.weight")),
    ("model.layers.0.self_attn.rotary_emb.inv_freq", None),
    ("model.rotary_emb.inv_freq", None),
])
def test_map_checkpoint_key(key, target):
    assert map_checkpoint_key(key) == target


@pytest.mark.parametrize("style, per_expert", [("fused", False), ("hub", True), ("mixtral", True)])
def test_checkpoint_key_inverts_map(style, per_expert):
    targets = [KeyTarget("model.norm.weight"), KeyTarget("model.layers.4.mlp.gate.weight"),
               KeyTarget(f"model.layers.4.{GU}"), KeyTarget(f"model.layers.4.{DOWN}")]
    if per_expert:
        targets += [KeyTarget("model.layers.4.mlp.experts.gate_up_proj", 7, 0),
                    KeyTarget("model.layers.4.mlp.experts.gate_up_proj", 7, 1),
                    KeyTarget("model.layers.4.mlp.experts.down_proj", 12)]
    for target in targets:
        spelled = checkpoint_key(target, style)
        assert map_checkpoint_key(spelled) == target, spelled
        mixtral_spelled = target.expert is not None or target.name.endswith("mlp.gate.weight")
        assert ("block_sparse_moe" in spelled) == (style == "mixtral" and mixtral_spelled), spelled


# ---------------------------------------------------------------- every form loads exactly


@pytest.mark.parametrize("family", FAMILIES)
def test_load_save_pretrained_default_per_expert(family, models, tmp_path):
    model = models(family)
    model_dir = saved(model, tmp_path / "ckpt")
    keys = disk_keys(model_dir)
    per_expert = ("model.layers.0.block_sparse_moe.experts.0.w1.weight" if family in ("mixtral", "minimax_m2")
                  else "model.layers.0.mlp.experts.0.gate_proj.weight")
    assert per_expert in keys and "model.layers.0.mlp.experts.gate_up_proj" not in keys
    params = poisoned(model)
    load_checkpoint(model_dir, params, progress=False)
    assert_loaded(model, params)


@pytest.mark.parametrize("family", FAMILIES)
def test_load_fused(family, models, tmp_path):
    model = models(family)
    model_dir = saved(model, tmp_path / "ckpt", save_original_format=False)
    keys = disk_keys(model_dir)
    assert "model.layers.0.mlp.experts.gate_up_proj" in keys
    assert not any(".experts.0." in k for k in keys)
    params = poisoned(model)
    load_checkpoint(model_dir, params, progress=False)
    assert_loaded(model, params)


@pytest.mark.parametrize("family, original_format",
                         [("qwen2_moe", True), ("mixtral", False), ("olmoe", True)])
def test_load_sharded(family, original_format, models, tmp_path):
    model = models(family)
    model_dir = saved(model, tmp_path / "ckpt", max_shard_size="20KB", save_original_format=original_format)
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3
    assert not (model_dir / "model.safetensors").exists()
    params = poisoned(model)
    load_checkpoint(model_dir, params, progress=False)
    assert_loaded(model, params)


@pytest.mark.parametrize("family, mixtral", [("mixtral", True), ("qwen3_moe", False), ("qwen2_moe", False)])
def test_load_hand_written_hub_form(family, mixtral, models, tmp_path):
    model = models(family)
    model_dir = write_single(tmp_path / "ckpt", hub_state_dict(model, mixtral=mixtral))
    params = poisoned(model)
    load_checkpoint(model_dir, params, progress=False)
    assert_loaded(model, params)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_load_casts_to_destination_dtype(dtype, models, tmp_path):
    model = models("qwen3_moe")
    model_dir = saved(model, tmp_path / "ckpt")
    params = poisoned(model, dtype=dtype)
    load_checkpoint(model_dir, params, progress=False)
    assert all(p.dtype == dtype for p in params.values())
    assert_loaded(model, params)


def test_destination_may_be_a_parameter_requiring_grad(models, tmp_path):
    model = models("olmoe")
    model_dir = saved(model, tmp_path / "ckpt")
    params = {k: torch.nn.Parameter(v) for k, v in poisoned(model).items()}
    load_checkpoint(model_dir, params, progress=False)
    assert_loaded(model, params)


def test_tied_embeddings(models, tmp_path):
    model = models("qwen3_moe", tie_word_embeddings=True)
    model_dir = saved(model, tmp_path / "ckpt")
    assert "lm_head.weight" not in disk_keys(model_dir)
    params = poisoned(model)
    assert "lm_head.weight" not in params
    load_checkpoint(model_dir, params, progress=False)
    assert_loaded(model, params)

    # a checkpoint that nevertheless stores the head is accepted when its shape matches...
    tensors = load_file(str(model_dir / "model.safetensors"))
    tensors["lm_head.weight"] = torch.randn(tensors["model.embed_tokens.weight"].shape)
    params = poisoned(model)
    load_checkpoint(write_single(tmp_path / "with_head", tensors), params, progress=False)
    assert_loaded(model, params)
    # ...and refused when it does not
    tensors["lm_head.weight"] = torch.randn(5, tensors["model.embed_tokens.weight"].shape[1])
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        load_checkpoint(write_single(tmp_path / "bad_head", tensors), poisoned(model), progress=False)


def test_rotary_inv_freq_buffers_are_ignored(models, tmp_path):
    model = models("mixtral")
    tensors = hub_state_dict(model, mixtral=True)
    tensors["model.rotary_emb.inv_freq"] = torch.rand(8)
    tensors["model.layers.1.self_attn.rotary_emb.inv_freq"] = torch.rand(8)
    params = poisoned(model)
    load_checkpoint(write_single(tmp_path / "ckpt", tensors), params, progress=False)
    assert_loaded(model, params)


def test_progress_bar_only_when_asked(models, tmp_path, capsys):
    model = models("olmoe")
    model_dir = saved(model, tmp_path / "ckpt")
    capsys.readouterr()
    load_checkpoint(model_dir, poisoned(model), progress=False)
    assert "Loading weights" not in capsys.readouterr().err
    load_checkpoint(model_dir, poisoned(model), progress=True)
    assert "Loading weights" in capsys.readouterr().err


# ---------------------------------------------------------------- strictness (contract 7)


def load_error(model, model_dir) -> str:
    params = poisoned(model)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(model_dir, params, progress=False)
    assert all(torch.isnan(p).all() for p in params.values()), "an error must come before any copy"
    return str(info.value)


@pytest.mark.parametrize("dropped", [
    "model.layers.0.mlp.experts.2.up_proj.weight",
    "model.layers.1.mlp.experts.4.down_proj.weight",  # the last expert
    "model.layers.1.mlp.shared_expert.gate_proj.weight",
    "model.layers.2.mlp.down_proj.weight",  # a dense layer (mlp_only_layers)
    "model.layers.0.self_attn.q_proj.bias",
    "lm_head.weight",
])
def test_missing_tensor_is_named(dropped, models, tmp_path):
    model = models("qwen2_moe")
    tensors = hub_state_dict(model, mixtral=False)
    del tensors[dropped]
    message = load_error(model, write_single(tmp_path / "ckpt", tensors))
    assert dropped in message and "1 tensor" in message


def test_missing_mixtral_expert_named_in_mixtral_spelling(models, tmp_path):
    model = models("mixtral")
    tensors = hub_state_dict(model, mixtral=True)
    for key in ("model.layers.1.block_sparse_moe.experts.3.w3.weight",
                "model.layers.2.block_sparse_moe.gate.weight"):
        del tensors[key]
    message = load_error(model, write_single(tmp_path / "ckpt", tensors))
    assert "model.layers.1.block_sparse_moe.experts.3.w3.weight" in message
    assert "model.layers.2.block_sparse_moe.gate.weight" in message
    assert "2 tensor" in message


def test_missing_fused_tensor_is_named(models, tmp_path):
    model = models("olmoe")
    tensors = {k: v.clone() for k, v in model.state_dict().items()}
    del tensors["model.layers.1.mlp.experts.down_proj"]
    message = load_error(model, write_single(tmp_path / "ckpt", tensors))
    assert "model.layers.1.mlp.experts.down_proj" in message and "1 tensor" in message


def test_many_missing_tensors_are_counted(models, tmp_path):
    model = models("qwen3_moe")
    tensors = hub_state_dict(model, mixtral=False)
    dropped = [k for k in tensors if k.startswith("model.layers.2.")]
    for key in dropped:
        del tensors[key]
    message = load_error(model, write_single(tmp_path / "ckpt", tensors))
    assert f"{len(dropped)} tensor" in message and dropped[0].rsplit(".", 2)[0] in message


@pytest.mark.parametrize("extra", ["model.layers.0.mlp.experts.0.bogus.weight",
                                   "model.layers.0.self_attn.q_proj.bias",
                                   "model.layers.0.mlp.experts.9.up_proj.weight",
                                   "visual.patch_embed.weight"])
def test_unexpected_tensor_is_named(extra, models, tmp_path):
    model = models("qwen3_moe")
    tensors = hub_state_dict(model, mixtral=False)
    tensors[extra] = torch.randn(40, 48)
    message = load_error(model, write_single(tmp_path / "ckpt", tensors))
    assert extra in message


@pytest.mark.parametrize("key, fused", [("model.layers.0.mlp.experts.1.up_proj.weight", False),
                                        ("model.layers.2.self_attn.k_proj.weight", False),
                                        ("model.layers.0.mlp.experts.gate_up_proj", True)])
def test_misshaped_tensor_names_key_and_both_shapes(key, fused, models, tmp_path):
    model = models("qwen3_moe")
    if fused:
        tensors = {k: v.clone() for k, v in model.state_dict().items()}
    else:
        tensors = hub_state_dict(model, mixtral=False)
    good = tuple(tensors[key].shape)
    bad = (good[0] + 1,) + good[1:]
    tensors[key] = torch.randn(bad)
    message = load_error(model, write_single(tmp_path / "ckpt", tensors))
    assert key in message and str(list(bad)) in message and str(list(good)) in message


def test_fused_and_per_expert_forms_together_are_refused(models, tmp_path):
    model = models("olmoe")
    tensors = hub_state_dict(model, mixtral=False)
    tensors[f"model.layers.0.{DOWN}"] = model.state_dict()[f"model.layers.0.{DOWN}"].clone()
    message = load_error(model, write_single(tmp_path / "ckpt", tensors))
    assert "model.layers.0.mlp.experts" in message and "already" in message


def test_missing_shard(models, tmp_path):
    model = models("qwen2_moe")
    model_dir = saved(model, tmp_path / "ckpt", max_shard_size="20KB")
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (model_dir / victim).unlink()
    assert victim in load_error(model, model_dir)


def test_shard_lacking_a_tensor_its_index_promises(models, tmp_path):
    model = models("qwen2_moe")
    model_dir = saved(model, tmp_path / "ckpt", max_shard_size="20KB")
    index_path = model_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.layers.0.mlp.ghost.weight"] = next(iter(index["weight_map"].values()))
    index_path.write_text(json.dumps(index))
    assert "model.layers.0.mlp.ghost.weight" in load_error(model, model_dir)


def test_bin_only_checkpoint_is_refused(models, tmp_path):
    model = models("mixtral")
    model_dir = tmp_path / "ckpt"
    model_dir.mkdir()
    torch.save(model.state_dict(), model_dir / "pytorch_model.bin")
    assert "only safetensors" in load_error(model, model_dir)


def test_no_weights(models, tmp_path):
    model = models("mixtral")
    (tmp_path / "empty").mkdir()
    assert "no weights" in load_error(model, tmp_path / "empty")
    assert "does not exist" in load_error(model, tmp_path / "nowhere")
    assert "no tensors" in load_error(model, write_single(tmp_path / "zero", {}))


# ------------------------------------------------------------------------- --load-format dummy


def config_only_dir(tmp_path, family: str, **overrides):
    """A model directory holding config.json and a tokenizer, no weights (what a serving benchmark of a model
    that is not on disk has)."""
    from tests.helpers.oracle import tiny_hf_config
    from tests.helpers.server import byte_tokenizer

    out = tmp_path / family
    tiny_hf_config(family, **overrides).save_pretrained(str(out))
    byte_tokenizer().save(str(out / "tokenizer.json"))
    return out


@pytest.mark.parametrize("family", FAMILIES + DEEPSEEK_GLM_FAMILIES)
def test_dummy_weights_need_only_config_json_and_give_finite_outputs(family, tmp_path):
    from moelora.engine.config import EngineConfig
    from moelora.engine.loader import build_engine
    from moelora.engine.request import SamplingParams
    from moelora.models.weights import init_dummy_weights

    model_dir = config_only_dir(tmp_path, family, vocab_size=260)
    assert not list(model_dir.glob("*.safetensors"))
    cfg = EngineConfig(device="cpu", max_loras=1, max_lora_rank=4, num_kv_blocks=64, max_model_len=128)
    with pytest.raises(CheckpointError):  # auto still wants the checkpoint
        build_engine(model_dir, cfg)
    engine = build_engine(model_dir, cfg, load_format="dummy", seed=3)
    params = engine.model.weight_params()
    assert all(torch.isfinite(p).all() for p in params.values())
    matrices = [p for n, p in params.items() if p.dim() >= 2 and "norm" not in n]
    assert all(0 < p.abs().max() <= 1e-3 and p.std() > 1e-4 for p in matrices)  # drawn, not left empty
    assert all((p == 1).all() for n, p in params.items() if n.endswith("norm.weight"))
    logits = engine.prompt_logits([[5, 9, 200, 17]], [None])[0]
    assert logits.shape == (4, 260) and torch.isfinite(logits).all()
    out = engine.add_request([5, 9, 200], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert len(out.output_ids) == 4
    again = {n: torch.empty_like(p) for n, p in params.items()}
    init_dummy_weights(again, seed=3)  # the seed fixes the weights
    assert all(torch.equal(again[n], p) for n, p in params.items())
    init_dummy_weights(again, seed=4)
    assert not torch.equal(again["model.embed_tokens.weight"], params["model.embed_tokens.weight"])


def qwen3_30b_a3b_config(**overrides):
    """Qwen3-30B-A3B's config.json (the serving benchmark's shape)."""
    import transformers as tf

    fields = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                  num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                  num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                  max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False,
                  bos_token_id=151643, eos_token_id=151645, dtype="bfloat16")
    return tf.Qwen3MoeConfig(**{**fields, **overrides})


def test_dummy_weights_of_the_qwen3_30b_a3b_config(tmp_path):
    """Its config.json, cut on the CPU to one layer of 8 experts and 512 tokens (a CPU generator draws 0.6 G
    values in ~12 s); the whole model runs in test_dummy_weights_serve_the_whole_qwen3_30b_a3b_on_cuda."""
    from moelora.engine.config import EngineConfig
    from moelora.engine.loader import build_engine

    qwen3_30b_a3b_config(num_hidden_layers=1, num_experts=8, vocab_size=512).save_pretrained(str(tmp_path))
    engine = build_engine(tmp_path, EngineConfig(device="cpu", dtype="bfloat16", max_loras=1, max_lora_rank=8,
                                                 num_kv_blocks=8, max_model_len=64), load_format="dummy")
    experts = engine.model.weight_params()["model.layers.0.mlp.experts.gate_up_proj"]
    assert experts.shape == (8, 2 * 768, 2048) and experts.dtype == torch.bfloat16
    logits = engine.prompt_logits([list(range(1, 20))], [None])[0]
    assert logits.shape == (19, 512) and torch.isfinite(logits).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_dummy_weights_serve_the_whole_qwen3_30b_a3b_on_cuda(tmp_path):
    """What benchmarks/serve.py runs on the H200: the whole Qwen3-30B-A3B from its config.json alone, random
    weights, CUDA graphs; generated tokens come out and every logit is finite."""
    from moelora.engine.config import EngineConfig
    from moelora.engine.loader import build_engine
    from moelora.engine.request import SamplingParams
    from tests.helpers.server import byte_tokenizer

    qwen3_30b_a3b_config().save_pretrained(str(tmp_path))
    byte_tokenizer().save(str(tmp_path / "tokenizer.json"))
    # A fixed KV cache (1.6 GB), not gpu_memory_utilization's share: beside the 57 GB of weights that share took
    # ~60 GB more, and `make gpu-check`'s parallel workers' engines ran out of memory (the demo's at -n 3).
    cfg = EngineConfig(max_model_len=2048, max_num_seqs=16, max_loras=2, max_lora_rank=16, num_kv_blocks=1024)
    engine = build_engine(tmp_path, cfg, load_format="dummy")
    assert engine.model.weight_params()["model.layers.47.mlp.experts.down_proj"].shape == (128, 2048, 768)
    logits = engine.prompt_logits([list(range(1, 200))], [None])[0]
    assert torch.isfinite(logits).all()
    reqs = [engine.add_request(list(range(i, i + 50)), SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
            for i in range(1, 9)]
    while engine.has_unfinished():
        engine.step()
    assert all(len(r.output_ids) == 32 for r in reqs)
