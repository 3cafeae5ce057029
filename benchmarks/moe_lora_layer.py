"""Benchmark: one routed-expert MoE layer, LoRA off / on, at three real shapes (not a test).

Shape legend: M tokens, H hidden, I expert intermediate, E experts, K top-k, R rank.
Usage: python benchmarks/moe_lora_layer.py [CSV path] [--shapes a,b] [--ms 1,8] [--variants off,8ad_r16]
       [--shrink table,route,block]   (LoRA variants once per routed-LoRA path, at every pool width: the table
       entry's own config of that path, else the path's defaults; "table": the tuned config as it is)
       [--gate-up-at table,epilogue,activation] [--no-side-stream] [--no-pdl] [--chain 8 (default; 0: off)]
       [--sets "block_n=64;block_n=256,block_k=64"]   (LoRA variants once per ';'-separated set of the
       path's config fields, ints or strings, set on each of the config's LoRA paths that has them)
       [--orders interleaved,grouped,last]   (the LoRA rows' slots, `moe_bench_common.make_lora`: decode's
       interleaved adapters (default), prefill's runs of one adapter, or one prompt on the last slot)
       [--dtype bf16,fp8,fp8a8]   (expert weights: bf16, or e4m3 with 128 x 128 block scales, W8A16 ("fp8") or
       W8A8 ("fp8a8"); each dtype's rows compare with its own LoRA-off row; the bytes bound counts FP8
       weights at 1 byte)
The layer launches as the engine launches it: the LoRA deltas on the engine's side stream (at its high priority:
`side_stream.lora_stream`, EngineConfig.overlap_lora) unless --no-side-stream, every Triton launch with programmatic
dependent launch (EngineConfig.pdl) unless --no-pdl.
--chain N: also the time per layer of one graph replaying N layers of distinct weights in turn (as a decode step
replays its layers; their weights exceed L2, so no flush is needed): a single-layer graph's replay carries the
graph launch itself, which a decode step pays once, not once per layer (column chain_ms).
Writes the CSV to the path, else $OUT/moe_lora_layer.csv, else ./moe_lora_layer.csv. Prints, per
row, the CUDA-graph replay median, achieved GB/s and its ratio to the bytes bound (distinct
experts' weights + distinct (adapter, expert) LoRA A/B + activations, over the copy bandwidth
measured in this run), TFLOP/s vs the measured bf16 matmul peak, and the ratio to LoRA off.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
from dataclasses import fields, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from moe_bench_common import (  # noqa: E402
    DTYPES,
    LORA_VARIANTS,
    MS,
    ORDERS,
    SHAPES,
    bench_side_stream,
    bytes_bound,
    eager_time_ms,
    fp8_layer,
    graph_time_ms,
    layer_config,
    make_inputs,
    make_layer,
    make_lora,
    measure_ceilings,
    moe_call,
)

EAGER_VARIANTS = ("off", "8ad_r16")


def with_knobs(cfg, knobs: dict):
    """cfg with `knobs` set on each of its LoRA path configs (narrow, wide) that has those fields, and
    on the entry itself for its own plain fields (`plan_per_route`, `block_m` is the LoRA path's)."""
    names = {f.name for lora in (cfg.lora, cfg.lora_wide) if lora is not None for f in fields(lora)}
    top = {k: bool(v) if isinstance(getattr(cfg, k), bool) else v for k, v in knobs.items()
           if k not in names and k in {f.name for f in fields(cfg)} and k not in ("lora", "lora_wide")}
    knobs = {k: v for k, v in knobs.items() if k not in top}
    if set(knobs) - names:
        raise SystemExit(f"{sorted(set(knobs) - names)}: no field of {cfg} or its LoRA paths")
    cfg = replace(cfg, **top)

    def on(lora):
        own = {k: bool(v) if isinstance(getattr(lora, k), bool) else v for k, v in knobs.items()
               if lora is not None and k in {f.name for f in fields(lora)}}
        return replace(lora, **own) if own else lora

    return replace(cfg, lora=on(cfg.lora), lora_wide=on(cfg.lora_wide))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("csv", nargs="?")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--variants", default=",".join(LORA_VARIANTS))
    ap.add_argument("--shrink", default="table")
    ap.add_argument("--gate-up-at", default="table", help="table, or a list of epilogue / activation")
    ap.add_argument("--sets", default="", help="';'-separated sets of config overrides (key=value,...)")
    ap.add_argument("--no-side-stream", action="store_true", help="LoRA deltas on the main stream (overlap_lora off)")
    ap.add_argument("--no-pdl", action="store_true", help="plain launches (the engine's default is PDL)")
    ap.add_argument("--orders", default="interleaved", help="the LoRA rows' slots: a list of "
                    f"{' / '.join(ORDERS)} (moe_bench_common.make_lora)")
    ap.add_argument("--dtype", default="bf16", help="a list of bf16 / fp8 (W8A16) / fp8a8 (W8A8)")
    ap.add_argument("--chain", type=int, default=8, help="also time N distinct layers in one graph, per layer "
                    "(0: not; the decode-like per-layer time, the one the targets are read against)")
    args = ap.parse_args(argv)
    side = bench_side_stream(args.no_side_stream)
    pdl = not args.no_pdl
    out_dir = os.environ.get("OUT", ".")
    path = Path(args.csv or Path(out_dir) / "moe_lora_layer.csv")
    bw, peak = measure_ceilings()
    gpu = torch.cuda.get_device_name()
    print(f"# {gpu}: copy {bw:.0f} GB/s, bf16 matmul {peak:.0f} TFLOP/s; triton {__import__('triton').__version__}")
    path.parent.mkdir(parents=True, exist_ok=True)
    f = path.open("w", newline="")
    writer = None
    rows = []
    for sname, dtype in [(s, d) for s in args.shapes.split(",") for d in args.dtype.split(",")]:
        shape = SHAPES[sname]
        layer = make_layer(shape)
        others = [make_layer(shape, seed=i) for i in range(1, args.chain)]
        if DTYPES[dtype] is not None:
            layer, others = fp8_layer(layer, DTYPES[dtype]), [fp8_layer(o, DTYPES[dtype]) for o in others]
        for M in map(int, args.ms.split(",")):
            x, wts, ids = make_inputs(layer, M)
            t_off = c_off = None
            runs = [(v, m, a, o, r) for v in args.variants.split(",")
                    for m in (["table"] if v == "off" else args.shrink.split(","))
                    for a in (["table"] if v == "off" else args.gate_up_at.split(","))
                    for o in ([""] if v == "off" else args.sets.split(";"))
                    for r in (["interleaved"] if v == "off" else args.orders.split(","))]
            for var, mode, at, sets, order in runs:
                label = var if dtype == "bf16" else f"{var}:{dtype}"
                if order != "interleaved":
                    label = f"{label}~{order}"
                lora = make_lora(layer, M, var, order)
                cfg = layer_config(layer, M, gpu)
                if mode != "table":
                    cfg = cfg.on_path(mode)  # this path at every width
                    label = f"{label}/{mode}"
                if at != "table":
                    cfg = with_knobs(cfg, dict(gate_up_at=at))
                    label = f"{label}@{at[:3]}"
                if sets:
                    kv = dict(item.split("=") for item in sets.split(","))
                    cfg = with_knobs(cfg, {k: int(v) if v.lstrip("-").isdigit() else v for k, v in kv.items()})
                    label = f"{label}[{sets}]"
                fn = moe_call(layer, x, wts, ids, lora, cfg, side, pdl)
                t = graph_time_ms(fn)
                t_eager = eager_time_ms(fn) if label.split("/")[0].split(":")[0] in EAGER_VARIANTS else float("nan")
                t_chain = float("nan")
                if others:
                    calls = [fn] + [moe_call(o, x, wts, ids, make_lora(o, M, var, order), cfg, side, pdl)
                                    for o in others]
                    t_chain = graph_time_ms(lambda calls=calls: [c() for c in calls]) / len(calls)
                t_off = t if var == "off" else t_off
                c_off = t_chain if var == "off" else c_off
                nbytes = bytes_bound(layer, x, ids, lora)
                flops = 2 * M * shape["K"] * 3 * shape["H"] * shape["I"]
                bound_ms = nbytes / (bw * 1e9) * 1e3
                rows.append(dict(gpu=gpu, shape=sname, M=M, variant=label, graph_ms=t, eager_ms=t_eager,
                                 chain_ms=t_chain, chain_x_bound=t_chain / bound_ms,
                                 chain_vs_off=t_chain / c_off if c_off else float("nan"),
                                 bytes=nbytes, gbps=nbytes / (t * 1e-3) / 1e9, x_bytes_bound=t / bound_ms,
                                 tflops=flops / (t * 1e-3) / 1e12, pct_peak=100 * flops / (t * 1e-3) / 1e12 / peak,
                                 vs_off=t / t_off if t_off else float("nan"), copy_gbps=bw, peak_tflops=peak))
                r = rows[-1]
                if writer is None:
                    writer = csv.DictWriter(f, fieldnames=list(r))
                    writer.writeheader()
                writer.writerow(r)
                f.flush()
                print(f"{sname:14s} M={M:5d} {label:14s} {t * 1e3:9.1f} us  eager {t_eager * 1e3:8.1f} us  "
                      f"chain {t_chain * 1e3:8.1f} us/layer (x{t_chain / bound_ms:.2f} bound)  "
                      f"{r['gbps']:6.0f} GB/s  x{r['x_bytes_bound']:.2f} bound  {r['tflops']:6.1f} TF/s "
                      f"({r['pct_peak']:4.1f}%)  vs_off {r['vs_off']:.3f}", flush=True)
        del layer, others
        torch.cuda.empty_cache()
    f.close()
    print(f"# wrote {path}")


if __name__ == "__main__":
    main()
