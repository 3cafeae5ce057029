"""Benchmark: MLA prefill attention, the host loop of one SDPA a sequence (the layer's path: `kernels.mla_keys`'
keys, then `layers.mla.attend_by_sequence`) against `kernels.mla_prefill`'s one launch.

Shape legend: N heads, Dn 128 / Dr 64 / Dv 128 (DeepSeek-V2-Lite: N 16; DeepSeek-V3: N 128), C 512; a mix is the
step's sequences, `BxL` B fresh prompts of L tokens or `BxL+P` B chunks of L tokens after a P-token cached prefix.
The inputs are what the layer hands attention: q [T, N, 192], kv_b's output [sum L, N, 256] and the latents' rows
[sum L, 576] (the rotated key their last 64 columns), bf16.

Timing, per path: "device", a CUDA graph of `--calls` calls (distinct inputs) replayed 25 times, the median replay
over the calls (`dense_lora_prefill.graph_us`); "eager", `--calls` calls launched back to back from the host, 5
rounds, the median over the calls: what an eager prefill step pays, the host's launches included (the SDPA loop's
~15 ATen ops a sequence). Each kernel config (`--configs`, BLOCK_M x BLOCK_N x warps x stages; "default": the
launcher's pick) prints its device µs, and its error against the SDPA path (max |diff| over max |sdpa|).

usage: python benchmarks/mla_prefill.py [--heads 16,128] [--mixes 4x2048,16x512,1x8192,2x1024+3072]
       [--configs default,128x64x8x2,...] [--calls 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 2)[0])
sys.path.insert(0, __file__.rsplit("/", 1)[0])

from dense_lora_prefill import graph_us  # noqa: E402

from moelora.kernels.attention import AttentionConfig  # noqa: E402
from moelora.kernels.mla_keys import mla_prefill_keys  # noqa: E402
from moelora.kernels.mla_prefill import mla_prefill_attention  # noqa: E402
from moelora.layers.attention import AttnMetadata, SeqSlice  # noqa: E402
from moelora.layers.mla import attend_by_sequence  # noqa: E402

NOPE, ROPE, V_DIM, C = 128, 64, 128, 512
CONFIGS = "default,128x64x8x2,128x64x8x3,64x64x4x2,64x64x4x3,128x32x8x2,64x128x8x2,128x128x8x2"


def parse_mix(mix: str) -> list[tuple[int, int]]:
    """`BxL` or `BxL+P` -> [(cached, q_len)] a sequence."""
    count, rest = mix.split("x")
    q_len, _, prefix = rest.partition("+")
    return [(int(prefix or 0), int(q_len))] * int(count)


def metadata(spec: list[tuple[int, int]], block_size: int = 16) -> AttnMetadata:
    """The step's attention metadata: sequence b on its own consecutive cache blocks of `block_size` tokens, its new
    tokens' slots after its cached prefix (the MLA paths here read no cache: they ignore both)."""
    seqs, qs, tables, slots, first = [], [0], [], [], 0
    width = max(-(-(c + n) // block_size) for c, n in spec)
    for b, (ctx, n) in enumerate(spec):
        blocks = -(-(ctx + n) // block_size)
        tables.append(list(range(first, first + blocks)) + [0] * (width - blocks))
        slots.extend(first * block_size + p for p in range(ctx, ctx + n))
        seqs.append(SeqSlice(qs[-1], n, ctx + n, b))
        qs.append(qs[-1] + n)
        first += blocks
    i32 = dict(dtype=torch.int32, device="cuda")
    return AttnMetadata(slot_mapping=torch.tensor(slots, dtype=torch.int64, device="cuda"),
                        block_tables=torch.tensor(tables, **i32),
                        seq_lens=torch.tensor([s.seq_len for s in seqs], **i32), query_start=torch.tensor(qs, **i32),
                        seqs=tuple(seqs), max_seq_len=max(s.seq_len for s in seqs),
                        max_query_len=max(n for _, n in spec))


def inputs(spec, N: int, seed: int):
    """q [T, N, 192] (scaled so the softmax is not flat), kv [sum L, N, 256], the latents' rows [sum L, 576]."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    T, L = sum(n for _, n in spec), sum(c + n for c, n in spec)
    q = (torch.randn(T, N, NOPE + ROPE, device="cuda", generator=g) * 2).bfloat16()
    kv = torch.randn(L, N, NOPE + V_DIM, device="cuda", generator=g).bfloat16()
    latents = torch.randn(L, C + ROPE, device="cuda", generator=g).bfloat16()
    return q, kv, latents


def sdpa_path(q, kv, latents, meta, scale):
    keys = mla_prefill_keys(kv, latents[:, C:], NOPE)
    return attend_by_sequence(q, keys, kv[..., NOPE:], meta, scale)


def kernel_path(q, kv, latents, meta, scale, config, kv_start):
    return mla_prefill_attention(q, kv, latents[:, C:], meta.seq_lens, meta.query_start, kv_start, NOPE, scale,
                                 meta.max_query_len, config)


def eager_us(fns) -> float:
    """A call's µs launched back to back from the host (`fns` once each, synchronized), median of 5 rounds."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for f in fns:
            f()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6 / len(fns))
    return statistics.median(times)


def device_us(fns) -> str:
    """`graph_us` formatted; "not captured" where a call cannot be captured in a CUDA graph."""
    try:
        return f"{graph_us(fns):8.1f} µs"
    except RuntimeError as e:
        return f"not captured ({str(e).splitlines()[0][:60]})"


def parse_config(text: str) -> AttentionConfig | None:
    if text == "default":
        return None
    bm, bn, warps, stages = (int(v) for v in text.split("x"))
    return AttentionConfig(bm, bn, num_warps=warps, num_stages=stages)


def mix_lines(N: int, mix: str, configs: list[str], calls: int) -> list[str]:
    spec = parse_mix(mix)
    meta = metadata(spec)
    scale = (NOPE + ROPE) ** -0.5
    cases = [inputs(spec, N, seed=i) for i in range(calls)]
    starts = torch.tensor([0] + [c + n for c, n in spec], device="cuda").cumsum(0)[:-1].to(torch.int32)
    want = sdpa_path(*cases[0], meta, scale).float()
    top = want.abs().max().item()
    sdpa = [lambda c=c: sdpa_path(*c, meta, scale) for c in cases]
    lines = [f"N={N:3d} {mix:12s} sdpa loop: device {device_us(sdpa)}, eager {eager_us(sdpa):8.1f} µs"]
    for text in configs:
        cfg = parse_config(text)
        fns = [lambda c=c, k=cfg: kernel_path(*c, meta, scale, k, starts) for c in cases]
        err = (kernel_path(*cases[0], meta, scale, cfg, starts).float() - want).abs().max().item() / top
        line = f"N={N:3d} {mix:12s} kernel {text:12s}: device {device_us(fns)}"
        if text == configs[0]:
            line += f", eager {eager_us(fns):8.1f} µs"
        lines.append(line + f" (err {err:.1e})")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--heads", default="16,128")
    parser.add_argument("--mixes", default="4x2048,16x512,1x8192,2x1024+3072")
    parser.add_argument("--configs", default=CONFIGS)
    parser.add_argument("--calls", type=int, default=4)
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}; µs a call (graph of {args.calls} calls / eager back to back)", flush=True)
    for N in (int(n) for n in args.heads.split(",")):
        for mix in args.mixes.split(","):
            for line in mix_lines(N, mix, args.configs.split(","), args.calls):
                print(line, flush=True)


if __name__ == "__main__":
    main()
