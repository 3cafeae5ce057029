"""The bundled demo assets (made by scripts/train_demo.py) are complete and consistent.

Fast and transformers-free: files, config fields, tokenizer ids, chat template, adapter keys and
shapes, and the pure-Python task definitions the demo's answers are checked against.
"""

from __future__ import annotations

import json
import random

import pytest

from moelora.demo import ADAPTER_NAMES, adapter_dir, demo_dir, model_dir, tasks

MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def _config() -> dict:
    return json.loads((model_dir() / "config.json").read_text())


def _shapes(path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def test_assets_exist_and_are_small():
    for name in MODEL_FILES:
        assert (model_dir() / name).is_file(), name
    for name in ADAPTER_NAMES:
        for file in ("adapter_config.json", "adapter_model.safetensors"):
            assert (adapter_dir(name) / file).is_file(), (name, file)
    assert (demo_dir() / "README.md").is_file()
    total = sum(p.stat().st_size for p in demo_dir().rglob("*") if p.is_file())
    assert total < 8 * 2**20, total


def test_model_config():
    cfg = _config()
    assert cfg["model_type"] == "qwen3_moe"
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"]
    assert cfg.get("num_experts", cfg.get("num_local_experts")) == 8  # transformers 5 writes the latter
    assert cfg["num_experts_per_tok"] == 2
    assert cfg["norm_topk_prob"] is True and cfg["tie_word_embeddings"] is False
    assert cfg["head_dim"] == 32
    # every expert tensor (and its LoRA A/B) has a shape of its own, so a swapped one cannot load
    assert len({cfg["hidden_size"], cfg["moe_intermediate_size"], 2 * cfg["moe_intermediate_size"]}) == 3
    assert cfg["mlp_only_layers"] == [] and cfg["decoder_sparse_step"] == 1  # every layer is MoE


def test_model_weights_are_bf16_with_per_expert_keys():
    cfg = _config()
    h, i, layers = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_hidden_layers"]
    shapes = _shapes(model_dir() / "model.safetensors")
    assert shapes["lm_head.weight"] == shapes["model.embed_tokens.weight"] == (cfg["vocab_size"], h)
    for layer in range(layers):
        p = f"model.layers.{layer}.mlp."
        assert shapes[f"{p}gate.weight"] == (8, h)
        for e in range(8):
            assert shapes[f"{p}experts.{e}.gate_proj.weight"] == shapes[f"{p}experts.{e}.up_proj.weight"] == (i, h)
            assert shapes[f"{p}experts.{e}.down_proj.weight"] == (h, i)
    assert len(shapes) == 3 + layers * (9 + 3 * 8)
    from safetensors import safe_open

    with safe_open(str(model_dir() / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}


def test_readme_records_every_task_above_95_percent():
    rows = [line for line in (demo_dir() / "README.md").read_text().splitlines() if line.startswith("| `")]
    assert [row.split("`")[1] for row in rows] == list(tasks.TASKS)
    for row in rows:
        fp32, bf16 = (float(cell) for cell in row.split("|")[3:5])
        assert fp32 >= 0.95 and bf16 >= 0.95, row


def test_special_token_ids_agree():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir() / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in (tasks.ENDOFTEXT, tasks.IM_START, tasks.IM_END, tasks.PAD)}
    assert ids == {tasks.ENDOFTEXT: 256, tasks.IM_START: 257, tasks.IM_END: 258, tasks.PAD: 259}
    cfg = _config()
    assert cfg["eos_token_id"] == ids[tasks.IM_END] and cfg["pad_token_id"] == ids[tasks.PAD]
    assert cfg["vocab_size"] == tok.get_vocab_size() == 260
    tok_cfg = json.loads((model_dir() / "tokenizer_config.json").read_text())
    assert tok_cfg["eos_token"] == tasks.IM_END and tok_cfg["pad_token"] == tasks.PAD


def test_tokenizer_is_byte_level():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir() / "tokenizer.json"))
    text = "abc xyz Zürich\n"
    prompt = tasks.user_prompt(text)
    enc = tok.encode(prompt)
    body = list(text.encode())
    assert enc.ids == [257, *b"user\n", *body, 258, *b"\n", 257, *b"assistant\n"]
    assert tok.decode(enc.ids, skip_special_tokens=False) == prompt


def test_chat_template_renders_the_prompt():
    import jinja2

    template = (model_dir() / "chat_template.jinja").read_text()
    assert json.loads((model_dir() / "tokenizer_config.json").read_text())["chat_template"] == template
    rendered = (
        jinja2.Environment()
        .from_string(template)
        .render(messages=[{"role": "user", "content": "ab cd"}], add_generation_prompt=True)
    )
    assert rendered == tasks.user_prompt("ab cd") == "<|im_start|>user\nab cd<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("name", ADAPTER_NAMES)
def test_adapter_has_attention_and_expert_lora(name):
    cfg = _config()
    acfg = json.loads((adapter_dir(name) / "adapter_config.json").read_text())
    assert set(acfg["target_modules"]) == set(ATTENTION)
    assert set(acfg["target_parameters"]) == {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}
    r, e, h, i = acfg["r"], 8, cfg["hidden_size"], cfg["moe_intermediate_size"]
    shapes = _shapes(adapter_dir(name) / "adapter_model.safetensors")
    assert len(shapes) == 12 * cfg["num_hidden_layers"]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"base_model.model.model.layers.{layer}."
        for proj in ATTENTION:
            assert shapes[f"{p}self_attn.{proj}.lora_A.weight"][0] == r
            assert shapes[f"{p}self_attn.{proj}.lora_B.weight"][1] == r
        # PEFT nests one wrapper per parameter: base_layer is gate_up_proj, the outer one down_proj.
        assert shapes[f"{p}mlp.experts.base_layer.lora_A.weight"] == (e * r, h)
        assert shapes[f"{p}mlp.experts.base_layer.lora_B.weight"] == (2 * i, e * r)
        assert shapes[f"{p}mlp.experts.lora_A.weight"] == (e * r, i)
        assert shapes[f"{p}mlp.experts.lora_B.weight"] == (h, e * r)


def test_transformations():
    assert tasks.shift("az") == "ba"
    assert tasks.shift("hello zz") == "ifmmp aa"
    assert tasks.upper("ab cd") == "AB CD"
    assert tasks.reverse("ab cd efg") == "efg cd ab"
    assert tasks.copy("ab cd") == "ab cd"
    assert [tasks.transform(t, "xy z") for t in tasks.TASKS] == ["xy z", "XY Z", "z xy", "yz a"]
    with pytest.raises(ValueError):
        tasks.transform("nope", "ab")


def test_heldout_inputs_are_deterministic_and_in_distribution():
    lines = tasks.heldout_inputs(200)
    assert lines == tasks.heldout_inputs(200)
    assert lines[:10] == tasks.heldout_inputs(10)
    assert lines != tasks.heldout_inputs(200, seed=tasks.HELDOUT_SEED + 1)
    for line in lines:
        words = line.split(" ")
        assert tasks.MIN_WORDS <= len(words) <= tasks.MAX_WORDS
        assert all(tasks.MIN_LETTERS <= len(w) <= tasks.MAX_LETTERS and w.isalpha() and w.islower() for w in words)
    rng = random.Random(tasks.HELDOUT_SEED)
    assert lines[:3] == [tasks.random_input(rng) for _ in range(3)]  # the training distribution
