"""Decode throughput of a Qwen3-30B-A3B-shaped model (random bf16 weights) on one GPU.

Concurrency 1..256 with no LoRA (an engine without LoRA slots), 1 adapter, and 8 adapters of
rank 16 spread over the requests (an engine with 8 slots). Each run: prefill short prompts,
then time `--steps` CUDA-graph decode steps (CUDA events). Prints the step time, tokens/s, the
bytes bound of a step (attention + dense weights + distinct experts the batch touches under
uniform routing + LoRA A/B of distinct (adapter, expert) pairs + KV read, over the copy
bandwidth measured here) and the LoRA / no-LoRA throughput ratio. Writes a CSV.

usage: python benchmarks/decode.py OUT.csv [--layers 48] [--conc 1,8,32,64,128,256] [--steps 20]
"""

from __future__ import annotations

import argparse
import csv
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 2)[0])

from moelora.config import ModelConfig  # noqa: E402
from moelora.engine.config import EngineConfig  # noqa: E402
from moelora.engine.engine import LLMEngine  # noqa: E402
from moelora.engine.request import SamplingParams  # noqa: E402
from moelora.lora.adapter import LoRAAdapter, LoRAWeights  # noqa: E402
from moelora.models.decoder import MoECausalLM  # noqa: E402

QWEN3_30B = dict(family="qwen3_moe", vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32,
                 num_kv_heads=4, head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                 top_k=8, norm_topk_prob=True, qk_norm="per_head", max_position_embeddings=4096, dtype="bfloat16")


def copy_bandwidth() -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        y.copy_(x)
    end.record()
    torch.cuda.synchronize()
    return 2 * x.numel() * 10 / (start.elapsed_time(end) / 1e3)


def random_model(cfg: ModelConfig, max_loras: int, rank: int) -> MoECausalLM:
    with torch.device("cuda"):
        model = MoECausalLM(cfg, max_loras=max_loras, max_rank=rank, backend="triton", dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0, 0.3 if name.endswith("mlp.gate.weight") else 0.02)
    return model.eval()


def random_adapter(model: MoECausalLM, name: str, rank: int, seed: int) -> LoRAAdapter:
    g = torch.Generator().manual_seed(seed)
    sites = {}
    for key, (mod, proj) in model.lora_sites().items():
        if proj is None:
            if key.endswith("mlp.gate"):
                continue
            a, b = (rank, mod.in_features), (mod.out_features, rank)
        else:
            a_buf, b_buf = getattr(mod, f"lora_{proj}_a"), getattr(mod, f"lora_{proj}_b")
            a, b = (a_buf.shape[1], rank, a_buf.shape[3]), (b_buf.shape[1], b_buf.shape[2], rank)
        sites[key] = LoRAWeights(0.01 * torch.randn(a, generator=g), 0.01 * torch.randn(b, generator=g))
    return LoRAAdapter(name, "", sites)


def step_bytes(cfg: ModelConfig, conc: int, n_adapters: int, rank: int, ctx: int) -> float:
    H, inter, E, K, L = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.top_k, cfg.num_layers
    attn = H * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim + cfg.num_heads * cfg.head_dim * H
    touched = E * (1 - (1 - K / E) ** conc)
    experts = touched * 3 * H * inter
    lora = 0.0
    if n_adapters:
        per_adapter_tokens = conc / n_adapters
        pairs = n_adapters * E * (1 - (1 - K / E) ** per_adapter_tokens)
        lora = pairs * rank * (H + 2 * inter + inter + H) + n_adapters * rank * 2 * (attn / H)
    kv = conc * ctx * 2 * cfg.num_kv_heads * cfg.head_dim
    head = cfg.vocab_size * H
    return 2.0 * (L * (attn + experts + lora + kv) + head)


def measure(eng: LLMEngine, conc: int, names: list, steps: int, prompt_len: int = 32) -> float:
    g = torch.Generator().manual_seed(conc)
    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    reqs = [eng.add_request(torch.randint(0, 1000, (prompt_len,), generator=g).tolist(), params,
                            names[i % len(names)]) for i in range(conc)]
    while any(len(r.output_ids) == 0 for r in reqs):
        eng.step()
    eng.step()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        eng.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    for r in reqs:
        eng.abort(r.request_id)
    return sorted(times)[len(times) // 2]


def engine(model, cfg: ModelConfig, max_loras: int, rank: int, max_seqs: int, adapters: dict) -> LLMEngine:
    ecfg = EngineConfig(device="cuda", dtype="bfloat16", kernel_backend="triton", max_loras=max_loras,
                        max_lora_rank=rank, max_num_seqs=max_seqs, max_model_len=512, num_kv_blocks=max_seqs * 40,
                        block_size=16).resolve(cfg)
    eng = LLMEngine(model, None, ecfg, lambda name, path: adapters[name])
    for name in adapters:
        eng.pool.add(name, name)
    return eng


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--conc", default="1,8,32,64,128,256")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rank", type=int, default=16)
    args = ap.parse_args()
    concs = [int(c) for c in args.conc.split(",")]
    cfg = ModelConfig(**{**QWEN3_30B, "num_layers": args.layers}).resolve()
    bw = copy_bandwidth()
    print(f"GPU {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s, layers {args.layers}")
    model = random_model(cfg, 8, args.rank)
    adapters = {f"a{i}": random_adapter(model, f"a{i}", args.rank, i) for i in range(8)}
    rows = []
    lora_eng = engine(model, cfg, 8, args.rank, max(concs), adapters)
    results = {}
    for conc in concs:
        for label, names in (("1 adapter", ["a0"]), ("8 adapters", list(adapters))):
            results[(label, conc)] = measure(lora_eng, conc, names, args.steps)
    del lora_eng
    for m in model.modules():  # the same weights without LoRA slots: the no-LoRA baseline
        if hasattr(m, "has_lora"):
            m.has_lora = False
    base_eng = engine(model, cfg, 0, 0, max(concs), {})
    for conc in concs:
        results[("no LoRA", conc)] = measure(base_eng, conc, [None], args.steps)
    print(f"{'config':>11} {'conc':>5} {'step ms':>8} {'tok/s':>9} {'bound ms':>9} {'x bound':>8} {'vs noLoRA':>9}")
    for conc in concs:
        for label, n in (("no LoRA", 0), ("1 adapter", 1), ("8 adapters", 8)):
            t = results[(label, conc)]
            bound = step_bytes(cfg, conc, n, args.rank, 40) / bw
            ratio = results[("no LoRA", conc)] / t
            rows.append(dict(config=label, concurrency=conc, step_ms=t * 1e3, tokens_per_s=conc / t,
                             bound_ms=bound * 1e3, x_bound=t / bound, throughput_vs_nolora=ratio))
            print(f"{label:>11} {conc:>5} {t * 1e3:8.2f} {conc / t:9.0f} {bound * 1e3:9.2f} {t / bound:8.2f} "
                  f"{ratio:9.3f}")
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main()
