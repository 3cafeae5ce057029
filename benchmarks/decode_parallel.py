"""Tensor- / expert-parallel decode on several GPUs (`benchmarks/decode.py --tensor-parallel-size N`).

A tensor-parallel engine reads its weights from disk (every rank reads its slices), so this writes a random
bf16 checkpoint of the model's shape, cut to `--layers` layers (default 8: ~10 GB for the Qwen3-30B shape), and
8 random rank-`--rank` adapters (attention and routed-expert LoRA, PEFT per-expert keys) into a temporary
directory, then times decode (`moelora.bench.time_decode`: back-to-back steps, one sync at the end) on an
engine of 1 rank (the reference) and of N ranks (both under CUDA graphs; overlapped scheduling is off with N),
with no LoRA, 1 adapter and 8 adapters. `--quantization fp8`: both engines quantize the checkpoint while loading
(each rank its slices; intermediate rows split on whole 128 blocks: the Qwen3-30B shape's 768 at N = 2 or 4
(256 / 256 / 128 / 128), the Qwen3-235B shape's 1536 at N = 8 (256 x 4 / 128 x 4), any N with
--enable-expert-parallel). Prints the step time, tokens/s and the ratio N ranks / 1 rank, and writes the rows
to the CSV.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from moelora import LLM
from moelora.bench import random_prompts, time_decode
from moelora.config import ModelConfig
from moelora.models.registry import model_class

_HF = {  # moelora's ModelConfig fields -> the config.json a checkpoint would carry (Qwen3-MoE only here)
    "qwen3_moe": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", rms_norm_eps=1e-6,
                      rope_theta=1e6, tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[]),
}
_RENAME = dict(num_layers="num_hidden_layers", num_heads="num_attention_heads", num_kv_heads="num_key_value_heads",
               top_k="num_experts_per_tok", dtype="torch_dtype")


def write_random_checkpoint(spec: dict, layers: int, out: Path) -> ModelConfig:
    """config.json + one safetensors file per layer (random bf16 weights, as benchmarks/decode.py's)."""
    from safetensors.torch import save_file

    if spec["family"] not in _HF:
        raise SystemExit(f"--tensor-parallel-size: only {sorted(_HF)} shapes are written here")
    raw = {_RENAME.get(k, k): v for k, v in spec.items() if k not in ("family", "qk_norm")}
    raw = {**_HF[spec["family"]], **raw, "num_hidden_layers": layers}
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(raw, indent=1))
    cfg = ModelConfig.from_hf(out)
    with torch.device("meta"):
        shapes = {n: t.shape for n, t in model_class(cfg)(cfg, dtype=torch.bfloat16).weight_params().items()}
    files: dict[str, dict[str, torch.Tensor]] = {}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for name, shape in shapes.items():
        std = 0.3 if name.endswith("mlp.gate.weight") else 0.02
        t = torch.ones(shape) if "norm" in name else torch.randn(shape, device=device) * std
        part = name.split(".")[2] if name.startswith("model.layers.") else "other"
        files.setdefault(f"model-{part}.safetensors", {})[name] = t.to(torch.bfloat16).cpu()
    index = {}
    for fname, tensors in files.items():
        save_file(tensors, str(out / fname))
        index.update({k: fname for k in tensors})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    return cfg


def write_random_adapter(cfg: ModelConfig, rank: int, seed: int, out: Path) -> Path:
    """PEFT keys for q/k/v/o and every routed expert's gate/up/down, std 0.01, alpha = rank (scaling 1); gate and up
    stack to rank 2 r at the experts' gate_up site (the engine's max_lora_rank)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    H, D, inter = cfg.hidden_size, cfg.head_dim, cfg.moe_intermediate_size
    sizes = {"q_proj": (H, cfg.num_heads * D), "k_proj": (H, cfg.num_kv_heads * D),
             "v_proj": (H, cfg.num_kv_heads * D), "o_proj": (cfg.num_heads * D, H)}
    tensors = {}
    for layer in range(cfg.num_layers):
        mods = {f"model.layers.{layer}.self_attn.{p}": s for p, s in sizes.items()}
        for e in range(cfg.num_experts):
            for p, s in (("gate_proj", (H, inter)), ("up_proj", (H, inter)), ("down_proj", (inter, H))):
                mods[f"model.layers.{layer}.mlp.experts.{e}.{p}"] = s
        for mod, (fin, fout) in mods.items():
            tensors[f"base_model.model.{mod}.lora_A.weight"] = 0.01 * torch.randn(rank, fin, generator=g)
            tensors[f"base_model.model.{mod}.lora_B.weight"] = 0.01 * torch.randn(fout, rank, generator=g)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(dict(
        peft_type="LORA", r=rank, lora_alpha=rank, target_modules=[*sizes, "gate_proj", "up_proj", "down_proj"],
        bias="none", use_rslora=False, use_dora=False)))
    return out


def run_parallel(spec: dict, name: str, tp: int, expert_parallel: bool, layers: int, concs: list[int], steps: int,
                 rank: int, repeats: int, quantization: str | None = None,
                 fp8_activation_quant: bool | None = None) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="moelora-tp-bench-") as tmp:
        cfg = write_random_checkpoint(spec, layers, Path(tmp) / "model")
        adapters = {f"a{i}": str(write_random_adapter(cfg, rank, i, Path(tmp) / f"a{i}")) for i in range(8)}
        results = {}
        for label, kw in (("1 rank", dict(tensor_parallel_size=1)),
                          (f"{tp} ranks{' EP' if expert_parallel else ''}",
                           dict(tensor_parallel_size=tp, expert_parallel=expert_parallel))):
            llm = LLM(Path(tmp) / "model", adapters, dtype="bfloat16", max_loras=8, max_lora_rank=2 * rank,
                      max_num_seqs=max(concs), max_model_len=512, num_kv_blocks=max(concs) * 16 + 64,
                      quantization=quantization, fp8_activation_quant=fp8_activation_quant, **kw)
            try:
                for conc in concs:
                    for config, names in (("no LoRA", [None]), ("1 adapter", ["a0"]), ("8 adapters", list(adapters))):
                        prompts = random_prompts(conc, 32, min(1000, cfg.vocab_size), seed=conc)
                        times = [time_decode(llm.engine, prompts, names, steps)[1] for _ in range(repeats)]
                        results[label, config, conc] = sorted(times)[len(times) // 2]
            finally:
                llm.engine.close()
        one = "1 rank"
        print(f"{'engine':>12} {'config':>11} {'conc':>5} {'step ms':>8} {'tok/s':>9} {'vs 1 rank':>9}")
        for (label, config, conc), t in results.items():
            ratio = results[one, config, conc] / t
            print(f"{label:>12} {config:>11} {conc:>5} {t * 1e3:8.2f} {conc / t:9.0f} {ratio:9.3f}")
            rows.append(dict(model=name, engine=label, config=config, concurrency=conc, layers=layers,
                             step_ms=t * 1e3, tokens_per_s=conc / t, speedup_vs_one_rank=ratio))
    return rows
