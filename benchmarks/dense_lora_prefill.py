"""Benchmark: the dense LoRA modes at prefill rows, site by site: what "concat" and split's expand_first add.

Shape legend: T rows of a prefill step, N_in -> N_out a site (segments of a merged projection), S = 8 slots of rank
16 (`--rank`), n adapters on the step (prompts of T / n rows each, one slot a prompt, as the engine's steps).
Sites: DeepSeek-V2-Lite's q + kv_a 2048 -> 3072 + 576, kv_b 512 -> 4096, o 2048 -> 2048, shared gate_up
2048 -> 2 x 1408, shared down 1408 -> 2048; Qwen3-30B-A3B's q/k/v 2048 -> 4096 + 512 + 512 and o 4096 -> 2048.

Timing: one CUDA graph of `--calls` calls, each on its own x, weight, adapters and output (weights from HBM, not
L2), replayed 25 times; the median replay over the calls is a call's time. `triton.testing.do_bench` at these sizes
gave one config 1-4x apart within a run (35th session); these graphs hold to a few µs. Prints, per site and T: the
no-LoRA cuBLAS GEMM's µs, then per adapter count the µs split (expand_first) and concat (forced, whatever the policy
picks: deeper-than-wide sites run split twice) add to it, each with its error against an fp32 reference (max |err|
over max |y|), and which mode the default policy picks. Calls concat does not serve (more than 128 lane columns)
run its fallback, split.

usage: python benchmarks/dense_lora_prefill.py [--ts 2048,4096,8192] [--sites q_kva,kv_b,...] [--adapters 1,4]
       [--rank 16] [--calls 6]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's package (a bare GPU machine)
from moelora.kernels.args import DenseLoRAArgs  # noqa: E402
from moelora.kernels.lora_linear import default_lora_linear_config, lora_linear  # noqa: E402

SITES = {  # name -> (N_in, output segments)
    "q_kva": (2048, (3072, 576)), "kv_b": (512, (4096,)), "o": (2048, (2048,)), "shared_gate_up": (2048, (1408, 1408)),
    "shared_down": (1408, (2048,)), "qwen3_qkv": (2048, (4096, 512, 512)), "qwen3_o": (4096, (2048,)),
}
SLOTS = 8


def graph_us(fns) -> float:
    """A call's µs: the median of 25 replays of one CUDA graph of `fns`, over their number."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm outside the capture
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    graph.replay()
    times = []
    for _ in range(25):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(fns))
    return statistics.median(times)


def reference(x, w, lora: DenseLoRAArgs, segs, rank: int) -> torch.Tensor:
    """fp32 x W^T + each row's slot's delta, xa rounded to x's dtype as the kernels do."""
    y = x.float() @ w.float().t()
    bounds = [0]
    for n in segs:
        bounds.append(bounds[-1] + n)
    for s in lora.slots.tolist():
        rows = (lora.token_slots == s).nonzero().squeeze(1)
        for g in range(len(segs)):
            xa = (x[rows].float() @ lora.a[s, g * rank:(g + 1) * rank].float().t()).to(x.dtype).float()
            y[rows, bounds[g]:bounds[g + 1]] += xa @ lora.b[s, bounds[g]:bounds[g + 1]].float().t()
    return y


def site_line(name: str, T: int, adapters, rank: int, calls: int) -> str:
    n_in, segs = SITES[name]
    n_out, G = sum(segs), len(segs)
    gen = torch.Generator(device="cuda").manual_seed(T)

    def rand(*shape, scale):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).bfloat16()

    xs = [rand(T, n_in, scale=1.0) for _ in range(calls)]
    ws = [rand(n_out, n_in, scale=n_in ** -0.5) for _ in range(calls)]
    a_s = [rand(SLOTS, G * rank, n_in, scale=n_in ** -0.5) for _ in range(calls)]
    b_s = [rand(SLOTS, n_out, rank, scale=rank ** -0.5) for _ in range(calls)]
    outs = [torch.empty(T, n_out, device="cuda", dtype=torch.bfloat16) for _ in range(calls)]
    ranks = torch.full((G, SLOTS) if G > 1 else (SLOTS,), rank, dtype=torch.int32, device="cuda")
    base = graph_us([lambda i=i: torch.mm(xs[i], ws[i].t(), out=outs[i]) for i in range(calls)])
    picked = default_lora_linear_config(T, n_in=n_in, n_out=n_out).mode
    line = f"{name:15s} T={T:5d} off {base:6.1f} µs, default {picked:6s}"
    for n_ad in adapters:
        token_slots = (torch.arange(T, device="cuda") // -(-T // n_ad)).to(torch.int32)
        used = torch.arange(n_ad, dtype=torch.int32, device="cuda")
        loras = [DenseLoRAArgs(a_s[i], b_s[i], token_slots, ranks, active=None, segments=segs if G > 1 else (),
                               slots=used) for i in range(calls)]
        ref = reference(xs[0], ws[0], loras[0], segs, rank)
        scale = ref.abs().max().item()
        line += f" | {n_ad} ad"
        for mode in ("split", "concat" if n_out >= n_in else "split"):
            cfg = default_lora_linear_config(T, mode, n_in=n_in, n_out=n_out)
            us = graph_us([lambda i=i, lo=loras, c=cfg: lora_linear(xs[i], ws[i], None, lo[i], out=outs[i], config=c)
                           for i in range(calls)])
            lora_linear(xs[0], ws[0], None, loras[0], out=outs[0], config=cfg)
            err = (outs[0].float() - ref).abs().max().item() / scale
            line += f" {mode} +{us - base:5.1f} ({err:.1e})"
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ts", default="2048,4096,8192")
    parser.add_argument("--sites", default=",".join(SITES))
    parser.add_argument("--adapters", default="1,4")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--calls", type=int, default=6)
    args = parser.parse_args()
    adapters = [int(n) for n in args.adapters.split(",")]
    print(f"{torch.cuda.get_device_name()}; µs a call, a graph of {args.calls} calls; rank {args.rank}", flush=True)
    for T in (int(t) for t in args.ts.split(",")):
        for name in args.sites.split(","):
            print(site_line(name, T, adapters, args.rank, args.calls), flush=True)


if __name__ == "__main__":
    main()
