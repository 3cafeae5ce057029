"""A model directory for serving benchmarks of a real model's shape, without its weights: config.json, a
tokenizer covering the whole vocabulary, and random PEFT adapters. Serve it with random weights
(`moelora serve DIR --load-format dummy`), e.g. through `benchmarks/serve.py --model DIR`.

Shapes: qwen3_30b (Qwen3-30B-A3B's config.json: 48 layers, H 2048, 32 q / 4 kv heads of 128, 128 experts
top-8 of I 768, vocab 151936) and tiny (the bundled demo's dimensions, for tests). `--layers` cuts the
layer count.

The tokenizer is the bundled demo's byte-level one (ids 0..259: bytes and its four special tokens, its
chat template and eos) with one plain added token `<tN>` for every other id up to vocab_size, so every
token a model with random weights samples decodes to text (a streamed chunk each, as with a real
tokenizer) and random token-id prompts need no real vocabulary.

Adapters `a0..a{n-1}` are PEFT LoRA of rank r (lora_alpha = r) on q/k/v/o and on the routed experts
(`target_parameters` gate_up_proj / down_proj, PEFT's fused expert layout: A [E*r, in] expert-major,
B [out, E*r]), values N(0, 0.01) like benchmarks/decode.py's; `--targets attention` leaves the experts out
(a 1.3 GB adapter becomes 40 MB at the full Qwen3-30B shape).

usage: python benchmarks/serve_model.py OUT [--shape qwen3_30b|tiny] [--layers N] [--adapters 8] [--rank 16]
       [--targets all|attention]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

DEMO_DIR = Path(__file__).resolve().parents[1] / "moelora" / "demo" / "model"

QWEN3_30B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "attention_bias": False, "tie_word_embeddings": False, "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}
SHAPES = {"qwen3_30b": QWEN3_30B, "tiny": None}  # tiny: the demo's own config.json


def write_model_dir(out: str | Path, shape: str = "qwen3_30b", layers: int | None = None) -> dict:
    """config.json, tokenizer.json (+ config, chat template) in `out`; returns the config written."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    demo = json.loads((DEMO_DIR / "config.json").read_text())
    config = dict(SHAPES[shape] or demo)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # the demo tokenizer's special ids
        config[key] = demo[key]
    if layers:
        config["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(DEMO_DIR / name, out / name)
    write_tokenizer(out / "tokenizer.json", config["vocab_size"])
    return config


def write_tokenizer(path: Path, vocab_size: int) -> None:
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_file(str(DEMO_DIR / "tokenizer.json"))
    first = tok.get_vocab_size()
    tok.add_tokens([AddedToken(f"<t{i}>", normalized=False) for i in range(first, vocab_size)])
    tok.save(str(path))


def write_adapter(out: str | Path, config: dict, rank: int, seed: int, experts: bool = True) -> None:
    """One PEFT LoRA adapter of `rank` for a model of `config` (see the module docstring)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    H, D = config["hidden_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * D, config["num_key_value_heads"] * D
    E, inter = config.get("num_experts") or config["num_local_experts"], config["moe_intermediate_size"]

    def rand(*shape):
        return (0.01 * torch.randn(shape, generator=g)).to(torch.bfloat16)

    weights = {}
    for layer in range(config["num_hidden_layers"]):
        pre = f"base_model.model.model.layers.{layer}"
        for proj, (n_in, n_out) in {"q_proj": (H, q), "k_proj": (H, kv), "v_proj": (H, kv), "o_proj": (q, H)}.items():
            weights[f"{pre}.self_attn.{proj}.lora_A.weight"] = rand(rank, n_in)
            weights[f"{pre}.self_attn.{proj}.lora_B.weight"] = rand(n_out, rank)
        if experts:  # PEFT ParamWrapper nesting: the first target parameter wraps the second
            weights[f"{pre}.mlp.experts.base_layer.lora_A.weight"] = rand(E * rank, H)  # gate_up_proj
            weights[f"{pre}.mlp.experts.base_layer.lora_B.weight"] = rand(2 * inter, E * rank)
            weights[f"{pre}.mlp.experts.lora_A.weight"] = rand(E * rank, inter)  # down_proj
            weights[f"{pre}.mlp.experts.lora_B.weight"] = rand(H, E * rank)
    save_file(weights, str(out / "adapter_model.safetensors"))
    adapter_config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank,
                      "lora_dropout": 0.0, "bias": "none", "use_rslora": False, "use_dora": False,
                      "fan_in_fan_out": False, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
                      "target_parameters": ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"] if experts else None}
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=1))


def write_assets(out: str | Path, shape: str, layers: int | None, adapters: int, rank: int,
                 experts: bool = True) -> tuple[Path, dict[str, Path]]:
    """`out`/model and `out`/adapters/a{i}: (model dir, {name: adapter dir})."""
    out = Path(out)
    config = write_model_dir(out / "model", shape, layers)
    paths = {}
    for i in range(adapters):
        paths[f"a{i}"] = out / "adapters" / f"a{i}"
        write_adapter(paths[f"a{i}"], config, rank, seed=i, experts=experts)
    return out / "model", paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--shape", default="qwen3_30b", choices=list(SHAPES))
    ap.add_argument("--layers", type=int, default=None, help="layer count (default: the shape's)")
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", default="all", choices=["all", "attention"])
    args = ap.parse_args()
    model, adapters = write_assets(args.out, args.shape, args.layers, args.adapters, args.rank,
                                   experts=args.targets == "all")
    print(f"model dir {model} (no weights: serve it with --load-format dummy)")
    print("--lora-modules " + " ".join(f"{n}={p}" for n, p in adapters.items()))


if __name__ == "__main__":
    main()
