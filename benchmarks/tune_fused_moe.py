"""Offline tuner: picks fused_moe launch configs per (shape, M) on this GPU and writes the table
moelora/kernels/configs/fused_moe_<gpu>.json (and a copy plus all timings under $OUT), after every
(shape, M) entry, so a run cut short keeps the entries it finished.

Shape legend: M tokens, H hidden, I expert intermediate, E experts, K top-k.
Per (shape, M): time the LoRA-off layer (CUDA-graph replay, L2 flushed, median) over a short
candidate list of tiles chosen by routes per expert, keep the fastest; then try TMA on it, and where
M * K <= E the plan with a block per route and no sort (plan_per_route); then pick the routed-LoRA path
(`lora`) by the summed time of one adapter and of 8 adapters, rank 16 (--score; a graph serves both kinds
of batch, and the best path differs between them: H200, Qwen3 M=256, scored on 8 alone the route path won,
on both the block path, which then decoded faster with 1 adapter AND with 8): every registered path's
`trials` (moelora.kernels.moe_lora), then each of the pick's `refinements`, kept if faster; then
`lora_wide` (each path at its best narrow config) on 8 adapters of rank 64 plus 8 of rank 8 in the
rank-64 pool. Every timing launches as the engine does: with programmatic dependent launch (EngineConfig.pdl;
--no-pdl: plain launches, which charge each extra launch its full latency: the per-route plan's saved launch won
a 2 % bar here and lost 3-4 % in the engine on an H100, DSV2 M=1) and the LoRA deltas on the engine's high-priority
side stream (`side_stream.lora_stream`, overlap_lora; --no-side-stream: not).
Usage:
  python benchmarks/tune_fused_moe.py [--shapes a,b] [--model /path/to/hf-model ...
                                      [--tensor-parallel-size N [--enable-expert-parallel]]] [--ms 1,8]
                                      [--lora-only] [--no-side-stream] [--no-pdl] [--score 1ad_r16,8ad_r16 | 8ad_r16]
                                      [--dtype bf16 | fp8 | fp8a8 | fp8,fp8a8] [--tiles-only] [--precompile N]
The table is keyed by GPU name and (E, H, I, weight dtype), so `--model` tunes a deployment's own model;
with --tensor-parallel-size N its ranks' shapes (E / N experts under EP, or each rank's intermediate rows: on FP8
weights whole 128 blocks, unevenly where they do not divide, so two shapes).
--dtype fp8 / fp8a8: e4m3 expert weights with 128 x 128 block scales, timed W8A16 / W8A8, into the entries
"dtype=float8_e4m3fn" (W8A16, the default mode) / "dtype=float8_e4m3fn,act=float8_e4m3fn" (W8A8, served under
EngineConfig.fp8_activation_quant): the FP8 search space of benchmarks/tune_fp8.py (block_k 128, one scale
block a K step; no TMA, the FP8 kernels have none), the joint pick then refined per GEMM.
--tiles-only: no LoRA round; the entry's LoRA fields are the bf16 entry's at that M (the routed LoRA runs the
same bf16 paths on FP8 weights), else the existing entry's. --precompile N: compile every candidate first in N
processes (benchmarks/tune_precompile.py), so the timing loop does not wait on one compile at a time.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).parent))
from moe_bench_common import (  # noqa: E402
    DTYPES,
    MS,
    SHAPES,
    bench_side_stream,
    fp8_layer,
    graph_time_ms,
    make_inputs,
    make_layer,
    make_lora,
    moe_call,
)
from tune_fp8 import fp8_candidates, lora_fields_from, split_refinements  # noqa: E402
from tune_precompile import precompile  # noqa: E402

from moelora.config import ModelConfig  # noqa: E402
from moelora.kernels.fp8_moe import fp8_table_key  # noqa: E402
from moelora.kernels.moe_config import CONFIG_DIR, FusedMoEConfig, GemmTile, device_tag, shape_key  # noqa: E402
from moelora.kernels.moe_lora import PATHS  # noqa: E402

DECODE_TILES = [(64, 128, 4, 4), (32, 128, 4, 4), (64, 256, 4, 3), (32, 256, 4, 3), (16, 256, 4, 4)]
MID_TILES = [(64, 128, 4, 3), (128, 64, 4, 4)]
LARGE_TILES = [(128, 64, 4, 4), (128, 64, 8, 3), (128, 128, 8, 3)]


def candidates(M: int, shape: dict, fp8: bool = False) -> list[FusedMoEConfig]:
    """The tiles tried at M (FP8: benchmarks/tune_fp8.py's space)."""
    return fp8_candidates(M, shape) if fp8 else _candidates(M, shape)


def _candidates(M: int, shape: dict) -> list[FusedMoEConfig]:
    per_expert = M * shape["K"] / shape["E"]
    if per_expert <= 4:
        combos = [(16, t) for t in DECODE_TILES]
    elif per_expert <= 48:
        combos = [(bm, t) for bm in (16, 32) for t in MID_TILES]
        if per_expert > 16:  # most experts' routes in one 64-row block: each expert's weights read once
            combos += [(64, t) for t in MID_TILES + LARGE_TILES[:2]]
    else:
        combos = [(bm, t) for bm in (64,) for t in LARGE_TILES] + [(128, (128, 64, 8, 3)), (128, (256, 64, 8, 3))]
    return [FusedMoEConfig(bm, GemmTile(*t), GemmTile(*t)) for bm, t in combos]


class Launch(NamedTuple):
    """How the layer is launched while timed: as the engine launches it (its LoRA side stream, `overlap_lora`, at
    the engine's priority: `side_stream.lora_stream`; programmatic dependent launch, `EngineConfig.pdl`), unless
    --no-side-stream / --no-pdl."""

    side: torch.cuda.Stream | None = None
    pdl: bool = False


PLAIN = Launch()  # no side stream, plain launches (the defaults of the functions below)


def timed(layer, x, wts, ids, lora, cfg, how: Launch = PLAIN) -> float:
    """Graph replay ms of one config, launched `how`."""
    try:
        return graph_time_ms(moe_call(layer, x, wts, ids, lora, cfg, how.side, how.pdl), rep=25)
    except Exception as exc:  # out of shared memory / registers for this tile: skip it
        print(f"  skip {cfg}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
        torch.cuda.synchronize()
        return float("inf")


def lora_trials(base: FusedMoEConfig) -> list[FusedMoEConfig]:
    """The LoRA paths tune_lora times on base's tiles: every registered path's `trials`
    (scripts/compile_check.py compiles each)."""
    return [base.with_lora(t) for path in PATHS.values() for t in path.trials(base.block_m)]


def refinements(base: FusedMoEConfig) -> list[FusedMoEConfig]:
    """Each `refinements` change of base's LoRA path, applied to base."""
    return [base.with_lora(dataclasses.replace(base.lora, **change)) for change in PATHS[base.lora.path].refinements]


def tune_lora(layer, M, base: FusedMoEConfig, log, how: Launch = PLAIN, score=("1ad_r16", "8ad_r16")
              ) -> FusedMoEConfig:
    """Keep base's tiles; pick the LoRA path and its knobs by the summed time of the `score` variants
    (default one adapter and 8, rank 16): every path's trials, then the pick's refinements, each kept if
    faster."""
    x, wts, ids = make_inputs(layer, M)
    loras = [make_lora(layer, M, v) for v in score]

    def run(cfg):
        return sum(timed(layer, x, wts, ids, lora, cfg, how) for lora in loras)

    scored = []
    for cfg in lora_trials(base):
        scored.append((run(cfg), cfg))
        log.append(dict(M=M, what=f"lora_{_tag(cfg.lora)}", config=json.dumps(cfg.to_dict()), ms=scored[-1][0]))
    t_best, best = min(scored, key=lambda p: p[0])
    for cfg in refinements(best):
        t = run(cfg)
        scored.append((t, cfg))
        log.append(dict(M=M, what=f"lora_{_tag(cfg.lora)}", config=json.dumps(cfg.to_dict()), ms=t))
        if t < t_best:
            t_best, best = t, cfg
    print(f"  M={M:5d} {'+'.join(score)} " + "  ".join(f"{_tag(c.lora)} {t * 1e3:7.1f}" for t, c in scored)
          + f"  -> {_tag(best.lora)}", flush=True)
    return tune_wide(layer, M, best, scored, log, how)


def _tag(cfg) -> str:
    return cfg.path + "/" + "/".join(f"{k}{v}" for k, v in dataclasses.asdict(cfg).items())


def tune_wide(layer, M, base: FusedMoEConfig, scored, log, how: Launch = PLAIN) -> FusedMoEConfig:
    """Keep base; pick lora_wide (the path of pools of max rank > 16): each path at its best config of the
    narrow round (`scored`), on the summed time of 8 adapters of rank 64 and of 8 of rank 8 in that pool (a
    narrow adapter in a wide pool must cost what its rank costs)."""
    x, wts, ids = make_inputs(layer, M)
    loras = [make_lora(layer, M, v) for v in ("8ad_r64", "8ad_r8_pool64")]
    best_of = {}
    for _t, cfg in sorted(scored, key=lambda p: p[0], reverse=True):  # the fastest of each path last
        best_of[cfg.lora.path] = cfg.lora
    wide = []
    for path, lora in best_of.items():
        cfg = dataclasses.replace(base, lora_wide=None if lora == base.lora else lora)
        wide.append((sum(timed(layer, x, wts, ids, lo, cfg, how) for lo in loras), cfg))
        log.append(dict(M=M, what=f"wide_{path}", config=json.dumps(cfg.to_dict()), ms=wide[-1][0]))
    t_best, best = min(wide, key=lambda p: p[0])
    print(f"  M={M:5d} 8ad_r64+8ad_r8_pool64 " + "  ".join(f"{c.lora_for(64).path} {t * 1e3:7.1f}" for t, c in wide)
          + f"  -> {best.lora_for(64).path}", flush=True)
    return best


def tune_one(layer, M, log, how: Launch = PLAIN, score=("1ad_r16", "8ad_r16"), lora_from: dict | None = None):
    """The entry of one M: tiles (LoRA off), then the LoRA round, or (lora_from, --tiles-only) its LoRA fields."""
    x, wts, ids = make_inputs(layer, M)
    scored = []
    tried = candidates(M, layer.shape, layer.fp8 is not None)
    for cfg in tried:
        t = timed(layer, x, wts, ids, None, cfg, how)
        scored.append((t, cfg))
        log.append(dict(M=M, what="tile", config=json.dumps(cfg.to_dict()), ms=t))
    t_best, best = min(scored, key=lambda p: p[0])
    for which in ("down", "gate_up") if layer.fp8 is not None else ():
        for cfg in split_refinements(best, tried, which):
            t = timed(layer, x, wts, ids, None, cfg, how)
            log.append(dict(M=M, what=f"tile_{which}", config=json.dumps(cfg.to_dict()), ms=t))
            if t < t_best:
                best, t_best = cfg, t
    tma = dataclasses.replace(best, use_tma=True)
    t_tma = float("nan") if layer.fp8 is not None else timed(layer, x, wts, ids, None, tma, how)
    log.append(dict(M=M, what="tma", config=json.dumps(tma.to_dict()), ms=t_tma))
    if t_tma < 0.98 * t_best:
        best, t_best = tma, t_tma
    t_pr = float("nan")
    if M * layer.shape["K"] <= layer.shape["E"]:  # routes rarely share an expert: no sort, a block per route
        pr = dataclasses.replace(best, plan_per_route=True)
        t_pr = timed(layer, x, wts, ids, None, pr, how)
        log.append(dict(M=M, what="plan_per_route", config=json.dumps(pr.to_dict()), ms=t_pr))
        if t_pr < 0.98 * t_best:
            best, t_best = pr, t_pr
    print(f"  M={M:5d} off {t_best * 1e3:8.1f} us (tma {t_tma * 1e3:8.1f}, plan per route {t_pr * 1e3:8.1f}) -> {best}",
          flush=True)
    log.append(dict(M=M, what="best_off", config=json.dumps(best.to_dict()), ms=t_best))
    if lora_from is not None:
        return dataclasses.replace(best, **lora_fields_from(lora_from))
    return tune_lora(layer, M, best, log, how, score)


def model_shapes(model_dir: str, tensor_parallel_size: int = 1, expert_parallel: bool = False,
                 fp8: bool = False) -> list[tuple[str, dict]]:
    """[(name, {E, K, H, I})] of the routed experts of a Hugging Face model folder (its config.json, read
    as moelora reads it), so a deployment can tune the table for its own model on its own GPU; on several ranks
    the ranks' own shapes (the table is keyed by them), each once: EP's E / N experts, or TP's intermediate rows a
    rank, on whole 128 blocks for FP8 weights (a checkpoint's block FP8, or `fp8`: --quantization fp8), so an
    uneven split gives two shapes (GLM-4.5-Air at TP=4: I 384 and 256)."""
    from moelora.parallel.rules import ShardPlan, split_unit
    from moelora.quant.config import FP8Config

    cfg = ModelConfig.from_dict(json.loads((Path(model_dir) / "config.json").read_text()))
    quant = cfg.quantization or (FP8Config.from_engine("fp8") if fp8 else None)
    name, out = Path(model_dir).resolve().name, []
    for rank in range(tensor_parallel_size):
        plan = ShardPlan(rank, tensor_parallel_size, expert_parallel, split_unit(quant))
        local = plan.local_config(cfg)
        shape = dict(E=plan.experts(cfg)[1], K=cfg.top_k, H=cfg.hidden_size, I=local.moe_intermediate_size)
        if shape not in [s for _, s in out]:
            out.append((name if tensor_parallel_size == 1 else f"{name}:rank{rank}", shape))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=None, help=f"named shapes ({', '.join(SHAPES)}); default: all, "
                                                   "unless --model is given")
    ap.add_argument("--model", action="append", default=[], help="a Hugging Face model folder: tune its "
                    "routed-expert shape (repeatable)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1, help="with --model: tune the shapes of its ranks "
                    "at this size (each distinct one)")
    ap.add_argument("--enable-expert-parallel", action="store_true", help="with --tensor-parallel-size: EP ranks")
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--lora-only", action="store_true", help="keep the table's tiles, re-pick the LoRA fields")
    ap.add_argument("--no-side-stream", action="store_true", help="time LoRA without the engine's side stream")
    ap.add_argument("--no-pdl", action="store_true", help="plain launches (the engine's default is PDL)")
    ap.add_argument("--dtype", default="bf16", help="expert weights, a list of: bf16, or e4m3 timed W8A16 (fp8) / "
                    "W8A8 (fp8a8)")
    ap.add_argument("--tiles-only", action="store_true", help="no LoRA round: LoRA fields from the bf16 entry")
    ap.add_argument("--precompile", type=int, default=0, help="compile the candidates first in N processes")
    ap.add_argument("--score", default="1ad_r16,8ad_r16", help="LoRA variants whose summed time picks the narrow "
                    "path (default: one adapter and many)")
    args = ap.parse_args(argv)
    dtypes = args.dtype.split(",")
    if set(dtypes) - set(DTYPES):
        ap.error(f"--dtype: {sorted(set(dtypes) - set(DTYPES))} not in {list(DTYPES)}")
    how = Launch(bench_side_stream(args.no_side_stream), not args.no_pdl)
    score = tuple(args.score.split(","))
    gpu = torch.cuda.get_device_name()
    path = CONFIG_DIR / f"fused_moe_{device_tag(gpu)}.json"
    table = json.loads(path.read_text()) if path.is_file() else {"device": gpu, "configs": {}}
    log = []
    shapes = [(n, SHAPES[n]) for n in (args.shapes or ("" if args.model else ",".join(SHAPES))).split(",") if n]
    fp8 = any(DTYPES[d] is not None for d in dtypes)
    shapes += [s for m in args.model for s in model_shapes(m, args.tensor_parallel_size, args.enable_expert_parallel,
                                                            fp8)]
    out = Path(os.environ.get("OUT", "."))
    ms = [int(m) for m in args.ms.split(",")]
    precompile([(shape, d, M, c.to_dict()) for _n, shape in shapes for d in dtypes for M in ms
                for c in candidates(M, shape, DTYPES[d] is not None)], 0 if args.lora_only else args.precompile,
               how.pdl)

    def save():  # after every entry: a run cut short (a device call's time limit) keeps what it tuned
        text = json.dumps(table, indent=1, sort_keys=True) + "\n"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        (out / path.name).write_text(text)
        with (out / "tune_fused_moe.csv").open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["shape", "M", "what", "config", "ms"])
            w.writeheader()
            w.writerows(log)

    for (sname, shape), dtype in [(s, d) for s in shapes for d in dtypes]:
        print(f"# {sname} {dtype} {shape}", flush=True)
        layer = make_layer(shape, pool_ranks=() if args.tiles_only else (16, 64))
        if DTYPES[dtype] is not None:
            layer = fp8_layer(layer, DTYPES[dtype])
        bf16_key = shape_key(shape["E"], shape["H"], shape["I"], torch.bfloat16)
        key = bf16_key if layer.fp8 is None else fp8_table_key(shape["E"], shape["H"], shape["I"], DTYPES[dtype])
        per_m = table["configs"].setdefault(key, {})
        for M in ms:
            if args.lora_only and str(M) in per_m:
                per_m[str(M)] = tune_lora(layer, M, FusedMoEConfig.from_dict(per_m[str(M)]), log, how,
                                          score).to_dict()
            else:
                lora_from = None
                if args.tiles_only:
                    lora_from = table["configs"].get(bf16_key, {}).get(str(M)) or per_m.get(str(M)) or {}
                per_m[str(M)] = tune_one(layer, M, log, how, score, lora_from).to_dict()
            for row in log:
                row.setdefault("shape", f"{sname}:{dtype}")
            save()
            print(f"# wrote {path} and {out / path.name} ({sname} {dtype} M={M} done)", flush=True)
        del layer
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
