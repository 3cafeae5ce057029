"""Benchmark: GQA prefill attention on the paged cache (`kernels.attention`'s `_prefill_kernel`), per launch config.

Shape legend: N query heads, N_kv kv heads, D 128 (Qwen3-30B-A3B: N 32, N_kv 4); a mix is the step's sequences,
`BxL` B fresh prompts of L tokens or `BxL+P` B chunks of L tokens after a P-token cached prefix; the cache in
blocks of 16 tokens (the engine's default), each sequence on its own blocks. The step's k / v are in the cache
before timing (the layer's rotary kernel stores them: `kv_stored`), so a call is the attention launch alone.

Timing: a CUDA graph of `--calls` calls (distinct inputs) replayed 25 times, the median replay over the calls
(`dense_lora_prefill.graph_us`). TFLOP/s counts the causal work (4 N D per visible query-key pair), % against the
bf16 matmul peak measured in the run. err: max |diff| over max |ref| against `paged_attention_ref` (first call).

usage: python benchmarks/attention_prefill.py [--heads 32/4] [--mixes 1x2048,4x512,1x2048+6144,1x8192]
       [--configs default,128x64x8x3,...] [--calls 4]
"""

from __future__ import annotations

import argparse
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 2)[0])
sys.path.insert(0, __file__.rsplit("/", 1)[0])

from dense_lora_prefill import graph_us  # noqa: E402
from mla_prefill import metadata, parse_config, parse_mix  # noqa: E402
from moe_bench_common import matmul_tflops  # noqa: E402

from moelora.kernels.attention import paged_attention  # noqa: E402
from moelora.kernels.reference import paged_attention_ref  # noqa: E402

D, BS = 128, 16
CONFIGS = "default,128x64x8x2,128x64x8x3,128x128x8x2,128x128x8x3,64x64x4x2,64x64x4x3,64x128x4x2,128x32x8x3"


def causal_flops(spec, N: int) -> float:
    """4 N D per visible (query, key) pair: query i of a chunk after P cached tokens sees P + i + 1 keys."""
    return sum(4 * N * D * (n * ctx + n * (n + 1) / 2) for ctx, n in spec)


def case(spec, meta, N: int, n_kv: int, seed: int):
    """q and this call's own filled cache (k / v of every position, the step's included: stored)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    T, blocks = sum(n for _, n in spec), int(meta.block_tables.max().item()) + 1
    q = (torch.randn(T, N, D, device="cuda", generator=g) * 2).bfloat16()
    kc = torch.randn(blocks, BS, n_kv, D, device="cuda", generator=g).bfloat16()
    vc = torch.randn(blocks, BS, n_kv, D, device="cuda", generator=g).bfloat16()
    return q, kc, vc


def mix_lines(N: int, n_kv: int, mix: str, configs: list[str], calls: int, peak: float) -> list[str]:
    spec = parse_mix(mix)
    meta = metadata(spec, BS)
    scale = D ** -0.5
    cases = [case(spec, meta, N, n_kv, seed=i) for i in range(calls)]
    q, kc, vc = cases[0]
    flat_k, flat_v = kc.view(-1, n_kv, D), vc.view(-1, n_kv, D)
    step_k, step_v = flat_k[meta.slot_mapping].clone(), flat_v[meta.slot_mapping].clone()
    want = paged_attention_ref(q, step_k, step_v, kc.clone(), vc.clone(), meta, scale).float()
    top = want.abs().max().item()
    flops = causal_flops(spec, N)
    lines = []
    for text in configs:
        cfg = parse_config(text)
        fns = [lambda c=c, k=cfg: paged_attention(c[0], None, None, c[1], c[2], meta, scale, config=k,
                                                  kv_stored=True) for c in cases]
        err = (fns[0]().float() - want).abs().max().item() / top
        us = graph_us(fns)
        tf = flops / (us * 1e-6) / 1e12
        lines.append(f"N={N}/{n_kv} {mix:12s} {text:12s} {us:8.1f} µs {tf:6.1f} TF/s ({100 * tf / peak:4.1f}% of "
                     f"{peak:.0f}) err {err:.1e}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--heads", default="32/4", help="N/N_kv pairs, comma-separated")
    parser.add_argument("--mixes", default="1x2048,4x512,1x2048+6144,1x8192")
    parser.add_argument("--configs", default=CONFIGS)
    parser.add_argument("--calls", type=int, default=4)
    args = parser.parse_args()
    peak = matmul_tflops()
    print(f"{torch.cuda.get_device_name()}; bf16 matmul {peak:.0f} TFLOP/s; µs a call (graph of {args.calls})",
          flush=True)
    for pair in args.heads.split(","):
        N, n_kv = (int(v) for v in pair.split("/"))
        for mix in args.mixes.split(","):
            for line in mix_lines(N, n_kv, mix, args.configs.split(","), args.calls, peak):
                print(line, flush=True)


if __name__ == "__main__":
    main()
