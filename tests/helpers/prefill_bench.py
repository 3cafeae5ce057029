"""A tiny Qwen3-MoE model and a CPU engine in place of benchmarks/prefill.py's GPU-sized ones: its tests run
the whole benchmark (timing, tables, CSV, profile, the ITL mode) on the CPU."""

from __future__ import annotations

import torch

from moelora.config import ModelConfig
from moelora.engine.config import EngineConfig
from moelora.engine.engine import LLMEngine
from moelora.models.registry import model_class
from tests.helpers.scripts import load_script

decode = load_script("benchmarks/decode.py", skip_missing=True)  # needs triton importable

TINY = dict(family="qwen3_moe", vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
            intermediate_size=128, moe_intermediate_size=32, num_experts=8, top_k=2, norm_topk_prob=True,
            qk_norm="per_head", max_position_embeddings=64, dtype="float32")


def tiny_model(name, layers, n, rank, max_positions=None, distinct=True, quant=None):
    assert quant is None, "the tiny CPU model is fp32, never FP8 (--quantization needs the GPU)"
    cfg = ModelConfig(**{**TINY, "max_position_embeddings": max(64, max_positions or 0)}).resolve()
    torch.manual_seed(0)
    model = model_class(cfg)(cfg, max_loras=n, max_rank=rank, dtype=torch.float32)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.fill_(1.0) if "norm" in pname else p.normal_(0, 0.3 if pname.endswith("mlp.gate.weight") else 0.02)
    return cfg, model.eval(), {f"a{i}": decode.random_adapter(model, f"a{i}", rank, i) for i in range(n)}


def cpu_engine(model, cfg, max_loras, rank, max_seqs, adapters, **kw):
    ecfg = EngineConfig(device="cpu", dtype="float32", max_loras=max_loras, max_lora_rank=rank, max_num_seqs=max_seqs,
                        block_size=16, **kw).resolve(cfg)
    eng = LLMEngine(model, None, ecfg, lambda name, path: adapters[name])
    for name in adapters:
        eng.pool.add(name, name)
    return eng
