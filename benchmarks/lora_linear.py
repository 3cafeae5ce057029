"""Benchmark: dense multi-LoRA linear (`lora_linear`) at the attention projections of Qwen3-30B-A3B.

Shape legend: T tokens, N_in / N_out features, S = 8 adapter slots, R pool max rank, r adapter rank.
Shapes: q 2048->4096, k 2048->512, v 2048->512, o 4096->2048, and qkv 2048->4096+512+512: q/k/v merged
(`MergedLinear`: one GEMM, one LoRA shrink + expand with 3 output segments, each at rank r), timed
next to q, k and v separately (bf16, no bias). Variants: no LoRA,
1 adapter r16, 8 adapters r16, 8 adapters r64, 8 adapters r8 in a max-rank-64 pool; adapters are
interleaved over the rows (row t on slot t % n, as in decode), each LoRA variant in every `--modes`.

Timing is what decode runs: one CUDA graph holding `--layers` consecutive calls, each on its own
weights and LoRA pool (so weights come from HBM, not L2), replayed under triton's do_bench (median,
L2 flushed before every replay); the per-call time is the replay over the number of calls. "single"
is one call per graph replay (includes the graph launch). Prints the per-call time, achieved GB/s
against the copy bandwidth measured here (bytes: W, x, y and the A/B rows of the distinct slots up
to their rank), the ratio to no LoRA, and per T the sum over q/k/v/o x 48 layers (one decode step),
and with qkv measured, the same step with qkv in place of q, k and v.

usage: python benchmarks/lora_linear.py [OUT.csv] [--ts 1,8,64,256,1024] [--shapes q,k,v,qkv,o]
       [--variants off,1ad_r16,8ad_r16,8ad_r64,8ad_r8_pool64] [--modes split,splitk,planned] [--layers 0 (auto)]
       [--sweep 8ad_r16,...]   (also time these variants over a grid of split-path configs; prints the best)
       [--sweep-mode splitk]   (the grid is the split-K GEMM's tiles instead; --sweep off,8ad_r16)
       [--no-side-stream]   (by default the shrink gets a side stream, as the engine's overlap_lora gives it)
       [--fp8 fp8,fp8a8]   (also every variant on the weights in e4m3 with 128 x 128 block scales, `fp8_lora_linear`:
       W8A16 "fp8", W8A8 "fp8a8"; the LoRA its default split / planned delta; bytes count W at 1 byte)
       [--pdl]   (every Triton launch with programmatic dependent launch, as the engine's default `pdl`; cuBLAS
       launches stay plain)
With "splitk" in --modes, "off" also runs through the split-K GEMM (mode splitk), next to cuBLAS.
Writes the CSV to the path, else $OUT/lora_linear.csv, else ./lora_linear.csv.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import NamedTuple

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_bench_common import copy_gbps, write_rows  # noqa: E402

from moelora.kernels.args import DenseLoRAArgs, split_k_counters  # noqa: E402
from moelora.kernels.dense_lora.planned import row_plan  # noqa: E402
from moelora.kernels.dense_policy import DENSE_LORA_POLICY, PLAN_BLOCK_M  # noqa: E402
from moelora.kernels.fp8_linear import fp8_lora_linear  # noqa: E402
from moelora.kernels.lora_linear import LoRALinearConfig, default_lora_linear_config, lora_linear  # noqa: E402
from moelora.quant.fp8 import quantize_segments  # noqa: E402

SHAPES = {"q": (2048, 4096), "k": (2048, 512), "v": (2048, 512), "qkv": (2048, 5120), "o": (4096, 2048),
          "router": (2048, 128)}  # Qwen3-30B-A3B; the router (mlp.gate) keeps LoRA slots unless targeted away
# merged shapes: output segments, and the shapes they stand for
SEGMENTS = {"qkv": (4096, 512, 512)}
MERGES = {"qkv": ("q", "k", "v")}
TS = (1, 8, 64, 256, 1024)
SLOTS = 8
MODEL_LAYERS = 48
# name -> (adapters spread over the rows, pool max rank R, adapter rank r)
VARIANTS = {"off": (0, 0, 0), "1ad_r16": (1, 16, 16), "8ad_r16": (8, 16, 16), "8ad_r64": (8, 64, 64),
            "8ad_r8_pool64": (8, 64, 8)}
# Weights cycled through per graph: enough that a call's W is not in L2 (50 MB on an H100/H200).
COLD_BYTES = 256 << 20


def make_layers(n_in: int, n_out: int, n_layers: int, pool_ranks, seed=0, n_seg: int = 1, fp8_segments=None):
    """Per layer: W [N_out, N_in] and, per pool rank R, A [S, n_seg R, N_in] and B [S, N_out, R];
    fp8_segments: also W in e4m3 with its block scales (each segment blocked on its own): q, s."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rn(*s, scale):
        return (torch.randn(*s, generator=g, device="cuda") * scale).to(torch.bfloat16)

    layers = [dict(w=rn(n_out, n_in, scale=n_in ** -0.5),
                   pools={r: (rn(SLOTS, n_seg * r, n_in, scale=n_in ** -0.5), rn(SLOTS, n_out, r, scale=r ** -0.5))
                          for r in pool_ranks})
              for _ in range(n_layers)]
    for ly in layers if fp8_segments else ():
        ly["q"], ly["s"] = quantize_segments(ly["w"], fp8_segments)
        ly["counters"] = split_k_counters(n_out).cuda()  # a layer's own, as the engine's FP8 linears hold them
    return layers


def lora_args(layer: dict, T: int, variant: str, segments: tuple[int, ...] = (),
              plan_block_m: int = 0) -> DenseLoRAArgs | None:
    """plan_block_m: also the rows grouped by slot ("planned" mode), built here once, as the engine
    builds it once per step for every site (so its one launch is not in the per-call time)."""
    n_ad, pool_r, rank = VARIANTS[variant]
    if n_ad == 0:
        return None
    a, b = layer["pools"][pool_r]  # a lower rank reads only its first `rank` columns: no zeroing needed
    slots = (torch.arange(T, device="cuda") % n_ad).to(torch.int32)
    ranks = torch.full((len(segments), SLOTS) if segments else (SLOTS,), rank, dtype=torch.int32, device="cuda")
    plan = row_plan(slots, SLOTS, plan_block_m) if plan_block_m else None
    return DenseLoRAArgs(a, b, slots, ranks, active=(), segments=segments, row_plan=plan)


def call_bytes(T: int, n_in: int, n_out: int, variant: str, n_seg: int = 1, fp8: bool = False) -> int:
    """Bytes a call must move: W (1 byte an element in FP8, + its fp32 128 x 128 scales), x, y, LoRA A/B."""
    n_ad, _, rank = VARIANTS[variant]
    w = n_out * n_in + 4 * triton.cdiv(n_out, 128) * triton.cdiv(n_in, 128) if fp8 else 2 * n_out * n_in
    return w + 2 * (T * n_in + T * n_out + min(n_ad, T) * rank * (n_seg * n_in + n_out))


def graph_ms(calls) -> float:
    for c in calls:  # compile and warm outside capture
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    return triton.testing.do_bench(graph.replay, warmup=10, rep=50, return_mode="median")


def mode_config(T: int, mode: str) -> LoRALinearConfig:
    """A --modes name's default config."""
    return default_lora_linear_config(T, mode)


def cfg_name(cfg: LoRALinearConfig | FP8Run | None) -> str:
    if cfg is None:
        return "-"
    if isinstance(cfg, FP8Run):
        return f"{cfg.mode}/e4m3 128x128 blocks"
    if cfg.mode == "planned":
        return (f"planned/bm{cfg.block_m}/bn{cfg.block_n}/bk{cfg.block_k}/cols{cfg.plan_cols}/w{cfg.num_warps}"
                f"/st{cfg.num_stages}")
    if cfg.mode == "splitk":
        return (f"splitk/gbn{cfg.gemm_block_n}/gbk{cfg.gemm_block_k}/gsk{cfg.gemm_split_k}/bm{cfg.block_m}"
                f"/bn{cfg.block_n}/sk{cfg.split_k}")
    return (f"split/bm{cfg.block_m}/bn{cfg.block_n}/w{cfg.num_warps}/sk{cfg.split_k}/lanes{cfg.slot_lanes}"
            f"/sbk{cfg.block_k}" + ("/first" if cfg.expand_first else ""))


def sweep_configs(T: int, mode: str) -> list[LoRALinearConfig]:
    """Candidates for --sweep. "split": expand tile x warps x shrink split, one-lane (serial slots), expand-first
    tiles; "splitk": the split-K GEMM's tile x K chunks (the shrink and the reduce as the default), then the
    reduce's tiles (the GEMM as the default)."""
    if mode == "splitk":
        base = default_lora_linear_config(T, "splitk")
        return ([replace(base, gemm_block_n=bn, gemm_block_k=bk, gemm_split_k=sk)
                 for bn in (32, 64, 128) for bk in (64, 128, 256) for sk in (1, 2, 4, 8)]
                + [replace(base, block_m=bm, block_n=bn, num_warps=w)  # the reduce's tiles
                   for bm, bn, w in ((16, 128, 4), (32, 64, 4), (64, 64, 4), (64, 128, 8))])
    if mode == "planned":
        base = default_lora_linear_config(T, "planned")
        return ([replace(base, block_n=bn, block_k=bk, plan_cols=pc, num_stages=st)
                 for bn in (64, 128) for bk in (128, 256, 512) for pc in (256, 512) for st in (2, 3, 4)]
                + [replace(base, block_m=32, block_k=bk, num_warps=w) for bk in (256, 512) for w in (4, 8)])
    base = default_lora_linear_config(T, "split")
    cfgs = [replace(base, block_m=bm, block_n=bn, num_warps=w, split_k=sk)
            for bm, bn, w in ((16, 64, 4), (16, 128, 4), (32, 64, 4), (32, 128, 4), (64, 64, 4), (64, 128, 4),
                              (64, 128, 8), (128, 128, 8))
            for sk in (0, 2, 8)]
    first = [replace(base, block_m=bm, block_n=bn, num_warps=w, slot_lanes=1, expand_first=True)
             for bm, bn, w in ((64, 128, 4), (64, 128, 8), (128, 128, 8), (64, 256, 8))]
    return cfgs + [replace(base, slot_lanes=1), replace(base, block_k=64)] + first


class FP8Run(NamedTuple):
    """A run of `fp8_lora_linear` in the rows: its mode column ("fp8" / "fp8a8") and config name."""

    mode: str


def _fp8_calls(layers, x, T, var, segments, n_out, quantize_activations, side, pdl):
    """One `fp8_lora_linear` call per layer (W8A8 if quantize_activations), with the rows grouped by slot where
    the engine groups them (17..1024 rows)."""
    plan_bm = PLAN_BLOCK_M if DENSE_LORA_POLICY.wants_row_plan(T) else 0
    return [partial(fp8_lora_linear, x, ly["q"], ly["s"], None, lora_args(ly, T, var, segments, plan_bm),
                    segments=segments or (n_out,), quantize_activations=quantize_activations, side_stream=side, pdl=pdl,
                    counters=ly["counters"])
            for ly in layers]


def bench_shape(sname, T, layers, variants, modes, bw, gpu, sweep=(), side=None, sweep_mode="split", fp8=(),
                pdl=False):
    n_in, n_out = SHAPES[sname]
    segments = SEGMENTS.get(sname, ())
    x = torch.randn(T, n_in, device="cuda").to(torch.bfloat16)
    out = torch.empty(T, n_out, device="cuda", dtype=torch.bfloat16)
    # no LoRA: cuBLAS (the split path without LoRA); with: each mode's default
    runs = [(var, mode_config(T, mode if VARIANTS[var][0] else "split"), False)
            for var in variants for mode in (modes if VARIANTS[var][0] else ("-",))]
    if "splitk" in modes and "off" in variants:  # its base GEMM alone, next to cuBLAS
        runs.insert(next(i for i, r in enumerate(runs) if r[0] == "off") + 1,
                    ("off", default_lora_linear_config(T, "splitk"), False))
    runs += [(var, cfg, True) for var in sweep for cfg in sweep_configs(T, sweep_mode)]
    runs += [(var, mode, False) for mode in fp8 for var in variants]  # cfg: "fp8" (W8A16) or "fp8a8" (W8A8)
    rows, t_off = [], None
    for var, cfg, swept in runs:
        # LoRA args built once, before capture (fixed-address buffers, as the runner's step plan)
        if isinstance(cfg, str):
            calls = _fp8_calls(layers, x, T, var, segments, n_out, cfg == "fp8a8", side, pdl)
            cfg = FP8Run(cfg)
        else:
            plan_bm = cfg.block_m if cfg.mode == "planned" else 0
            calls = [partial(lora_linear, x, ly["w"], None, lora_args(ly, T, var, segments, plan_bm), out=out,
                             config=replace(cfg, pdl=pdl), side_stream=side)
                     for ly in layers]
        try:
            t_chain = graph_ms(calls) / len(calls)
        except triton.runtime.errors.OutOfResources as e:  # a swept tile this GPU cannot hold
            print(f"{sname} T={T} {var} {cfg_name(cfg)}: skipped ({e})", flush=True)
            continue
        t_single = float("nan") if swept else graph_ms(calls[:1])
        cublas = var == "off" and cfg.mode == "split"
        t_off = t_chain if cublas and not swept else t_off
        nbytes = call_bytes(T, n_in, n_out, var, max(1, len(segments)), isinstance(cfg, FP8Run))
        bound_ms = nbytes / (bw * 1e9) * 1e3
        rows.append(dict(gpu=gpu, shape=sname, n_in=n_in, n_out=n_out, T=T, variant=var,
                         mode="-" if cublas else cfg.mode, config="-" if cublas else cfg_name(cfg), sweep=swept,
                         graph_us=t_chain * 1e3,
                         single_us=t_single * 1e3, bytes=nbytes, gbps=nbytes / (t_chain * 1e-3) / 1e9,
                         x_bytes_bound=t_chain / bound_ms, vs_off=t_chain / t_off if t_off else float("nan"),
                         copy_gbps=bw, layers=len(layers)))
        r = rows[-1]
        print(f"{sname} {n_in:5d}->{n_out:<5d} T={T:5d} {var:14s} {r['config']:44s} {r['graph_us']:8.2f} us/call "
              f"(single {r['single_us']:7.2f})  {r['gbps']:6.0f} GB/s  x{r['x_bytes_bound']:5.2f} bound  "
              f"vs_off {r['vs_off']:.3f}", flush=True)
    for var in sweep:
        cand = [r for r in rows if r["sweep"] and r["variant"] == var]
        best = min(cand, key=lambda r: r["graph_us"])
        dflt = next((r for r in rows if not r["sweep"] and r["variant"] == var
                     and r["mode"] == (sweep_mode if VARIANTS[var][0] or sweep_mode == "splitk" else "-")), None)
        ref = f" (default {sweep_mode} {dflt['graph_us']:.2f} us)" if dflt else ""
        print(f"# best {sname} T={T} {var}: {best['config']} {best['graph_us']:.2f} us{ref}")
    return rows


def step_shapes(measured: set[str]) -> dict[str, set[str]]:
    """The projections one decode step runs, per way of running them: "separate" (the unmerged shapes
    measured) and, for each merged shape measured, that shape in place of its parts."""
    merged = set(MERGES)
    ways = {"separate": measured - merged}
    for name, parts in MERGES.items():
        if name in measured:
            ways[name] = (measured - merged - set(parts)) | {name}
    return {way: shapes for way, shapes in ways.items() if shapes}


def print_step_summary(rows):
    """Per T and (variant, mode): sum over the projections present x 48 layers, as one decode step (q/k/v
    separately, and merged when qkv was measured)."""
    print(f"\n# per decode step ({MODEL_LAYERS} layers x the projections benchmarked)")
    rows = [r for r in rows if not r["sweep"]]
    ways = step_shapes({r["shape"] for r in rows})
    keys = sorted({(r["T"], r["variant"], r["mode"]) for r in rows},
                  key=lambda k: (k[0], list(VARIANTS).index(k[1]), k[2]))
    for T, var, mode in keys:
        for way, shapes in ways.items():
            tot = sum(r["graph_us"] for r in rows
                      if (r["T"], r["variant"], r["mode"]) == (T, var, mode) and r["shape"] in shapes)
            off = sum(r["graph_us"] for r in rows
                      if (r["T"], r["variant"], r["mode"]) == (T, "off", "-") and r["shape"] in shapes)
            ratio = tot / off if off else float("nan")
            print(f"T={T:5d} {var:14s} {mode:6s} {way:8s} {tot * MODEL_LAYERS / 1e3:8.3f} ms/step  "
                  f"vs_off {ratio:.3f}")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("csv", nargs="?")
    ap.add_argument("--ts", default=",".join(map(str, TS)))
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--modes", default="split,planned")
    ap.add_argument("--layers", type=int, default=0, help="calls per graph (0: enough to keep W out of L2)")
    ap.add_argument("--sweep", default="", help="variants (e.g. 8ad_r16) to also time over split-path configs")
    ap.add_argument("--sweep-mode", default="split", choices=("split", "splitk", "planned"),
                    help="which path --sweep varies")
    ap.add_argument("--no-side-stream", action="store_true", help="the shrink on the main stream (overlap_lora off)")
    ap.add_argument("--pdl", action="store_true", help="Triton launches with programmatic dependent launch")
    ap.add_argument("--fp8", default="", help="also on FP8 weights: fp8 (W8A16), fp8a8 (W8A8), or both")
    args = ap.parse_args(argv)
    side = None if args.no_side_stream else torch.cuda.Stream()
    path = Path(args.csv or Path(os.environ.get("OUT", ".")) / "lora_linear.csv")
    variants = args.variants.split(",")
    if "off" not in variants:
        variants.insert(0, "off")
    modes = tuple(args.modes.split(","))
    sweep = [v for v in args.sweep.split(",") if v]
    pool_ranks = sorted({VARIANTS[v][1] for v in variants + sweep if VARIANTS[v][0]})
    bw = copy_gbps()
    gpu = torch.cuda.get_device_name()
    print(f"# {gpu}: copy {bw:.0f} GB/s; triton {triton.__version__}; torch {torch.__version__}")
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for sname in args.shapes.split(","):
        n_in, n_out = SHAPES[sname]
        n_layers = args.layers or min(MODEL_LAYERS, max(4, triton.cdiv(COLD_BYTES, 2 * n_in * n_out)))
        fp8 = tuple(m for m in args.fp8.split(",") if m)
        layers = make_layers(n_in, n_out, n_layers, pool_ranks, n_seg=max(1, len(SEGMENTS.get(sname, ()))),
                             fp8_segments=(SEGMENTS.get(sname) or (n_out,)) if fp8 else None)
        for T in map(int, args.ts.split(",")):
            rows += bench_shape(sname, T, layers, variants, modes, bw, gpu, sweep, side, args.sweep_mode, fp8,
                                args.pdl)
        del layers
        torch.cuda.empty_cache()
    write_rows(path, rows)
    print_step_summary(rows)
    print(f"# wrote {path}")


if __name__ == "__main__":
    main()
