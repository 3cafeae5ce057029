"""Where a decode step's time goes: host phases, graph replay, and the kernels of one eager step.

For a model shape of `benchmarks/decode.py` (--model: qwen3_30b, the default, or dsv2_lite;
--layers; random bf16 weights, or FP8 with --quantization fp8 [--no-fp8-activation-quant]) at a few
concurrencies, with no LoRA, with 1 and with 8 adapters of
rank 16:
  - step wall time (median), and each host phase of `LLMEngine.step` timed with a device sync
    before and after it (schedule, adapter acquire, input prepare, graph run, sample; the rest is
    token bookkeeping);
  - the decode graph's replay alone (CUDA events, median);
  - one eager forward of the same inputs under torch.profiler: kernel count, summed kernel time,
    and the top kernels by total time.
Prints tables and writes them to OUT.txt.

usage: python benchmarks/decode_profile.py OUT.txt [--layers 0 (the model's own)] [--conc 1,64] [--top 20] [--trace DIR]
(--trace: Chrome traces of each point's graph replay and eager forward, kernel by kernel with their
streams, for chrome://tracing or Perfetto; and the middle layer of each graph replay printed kernel
by kernel, `layer_timeline`, and each kind's device time past the kernels before it, `exposed_by_category`,
over the whole replay (embedding and LM head included) divided by the layer count; one replay, so read its
shares, and the replays' median for the step's time)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, __file__.rsplit("/", 2)[0])
sys.path.insert(0, __file__.rsplit("/", 1)[0])

from decode import add_model_args, engine, model_from_args, no_lora_twin, tee  # noqa: E402
from host_overhead import phase_timers  # noqa: E402

import moelora.engine.engine as engine_module  # noqa: E402
from moelora.engine.request import SamplingParams  # noqa: E402

# (owner, attribute): owner an engine attribute, None for the engine itself, or a module (the sampler,
# called by the engine as a module function); `_read_back` is the step's one host sync plus bookkeeping.
PHASES = (("scheduler", "schedule"), ("pool", "acquire"), ("runner", "prepare"), ("graphs", "run"),
          (engine_module, "sample"), (None, "_read_back"))


CATEGORIES = (  # first match wins: Triton kernel names (exact or prefix), substrings of cuBLAS/ATen names
    ("moe lora", ("=lora_shrink_kernel", "=lora_route_delta_kernel", "=lora_block_delta_kernel", "=act_delta_kernel",
                  "=act_spread_kernel", "=lora_stacked_shrink_kernel")),
    ("dense lora", ("^_lora_", "=planned_delta_kernel", "^_expand_lora", "^_absorb_lora", "^_concat_")),
    ("dense splitk: base GEMM + LoRA shrink, reduce + expand", ("^splitk_",)),
    ("moe gemm + plan + combine", ("=gate_up_kernel", "=down_kernel", "=combine_kernel", "^_plan_")),
    ("attention", ("^_decode", "=decode_reduce_kernel", "^_prefill", "^_store", "^_mla")),
    ("fused norm/rotary/router/silu", ("=_rms_norm_kernel", "=_qk_norm_rope_kernel", "=_softmax_topk_kernel",
                                       "=_router_topk_kernel", "=_silu_mul_kernel")),
    ("fp8 GEMM + activation quant", ("=_fp8_linear_kernel", "=_group_quant_kernel")),
    ("cuBLAS GEMM", ("nvjet", "gemm", "gemv", "splitKreduce", "cutlass", "xmma")),  # + its GEMVs, split-K reduce
)


def _matches(name: str, key: str) -> bool:
    if key[0] == "=":
        return name == key[1:]
    if key[0] == "^":
        return name.startswith(key[1:])
    return key in name


def category(name: str, table=CATEGORIES) -> str:
    """The first category of `table` ((category, keys) pairs) one of whose keys matches kernel `name`."""
    return next((cat for cat, keys in table if any(_matches(name, k) for k in keys)), "other torch kernels")


def kernel_times(prof) -> dict[str, list]:
    """Kernel name -> [launches, summed device µs] of a finished torch.profiler run."""
    per_name = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per_name[ev.name][0] += 1
            per_name[ev.name][1] += ev.device_time_total
    return per_name


def by_category(per_name: dict[str, list], table=CATEGORIES) -> dict[str, list]:
    """`kernel_times` summed per `category` of `table`: category -> [launches, µs]."""
    per_cat = defaultdict(lambda: [0, 0.0])
    for name, (count, us) in per_name.items():
        per_cat[category(name, table)][0] += count
        per_cat[category(name, table)][1] += us
    return per_cat


def median(xs):
    return sorted(xs)[len(xs) // 2] if xs else float("nan")


def start(eng, conc, names, steps):
    g = torch.Generator().manual_seed(conc)
    params = SamplingParams(max_tokens=steps * 4 + 16, temperature=0, ignore_eos=True)
    reqs = [eng.add_request(torch.randint(0, 1000, (32,), generator=g).tolist(), params, names[i % len(names)])
            for i in range(conc)]
    while any(len(r.output_ids) == 0 for r in reqs):
        eng.step()
    eng.step()
    torch.cuda.synchronize()
    return reqs


def step_walls(eng, steps: int) -> list[float]:
    """Wall time of each of `steps` synchronous steps (device synced after each)."""
    walls = []
    for _ in range(steps):
        t0 = time.perf_counter()
        eng.step()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
    return walls


def profile_point(eng, conc, names, steps, top, log, trace: str | None = None):
    reqs = start(eng, conc, names, steps)
    walls = step_walls(eng, steps)
    with phase_timers(eng, PHASES, "cuda") as sinks:
        phased = step_walls(eng, steps)
    # the graph alone, and one eager forward of the same step's inputs under the profiler
    step = eng.scheduler.schedule()
    slot_of = eng.pool.acquire(r.adapter for r in step.requests)
    inputs = eng.runner.prepare(step, slot_of, eng.pool.slot_ranks)
    eng.graphs.run(inputs)
    B = next(b for b in eng.graphs.buckets if b >= conc)
    graph = eng.graphs.graph_for(B, inputs.lora)[0]  # the set this step replays
    replays = []
    for _ in range(steps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        torch.cuda.synchronize()
        replays.append(s.elapsed_time(e) / 1e3)
    eng.runner.run(inputs)
    torch.cuda.synchronize()
    if trace:  # timelines (stream, start, duration of every kernel) of one graph replay and one eager forward
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as replay_prof:
            graph.replay()
            torch.cuda.synchronize()
        replay_prof.export_chrome_trace(f"{trace}_graph.json")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        eng.runner.run(inputs)
        torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(f"{trace}_eager.json")
        kernels = trace_kernels(f"{trace}_graph.json")
        exposed, idle = exposed_by_category(kernels)
        n_layers = eng.model_config.num_layers
        log(f"  graph replay, µs a layer past the kernels before ({n_layers} layers): "
            + "; ".join(f"{cat} {us / n_layers:.1f}" for cat, us in sorted(exposed.items(), key=lambda kv: -kv[1]))
            + f"; idle {idle / n_layers:.1f}")
        for line in layer_timeline(kernels, n_layers // 2):
            log(line)
    per_name = kernel_times(prof)
    for r in reqs:
        eng.abort(r.request_id)
    n_kernels = sum(c for c, _ in per_name.values())
    kernel_us = sum(t for _, t in per_name.values())
    log(f"  step wall median {median(walls) * 1e3:.2f} ms; with phase syncs {median(phased) * 1e3:.2f} ms; "
        f"graph replay alone {median(replays) * 1e3:.2f} ms")
    rest = median(phased) - sum(median(v) for v in sinks.values())
    log("  phases (ms): " + ", ".join(f"{k} {median(v) * 1e3:.3f}" for k, v in sinks.items())
        + f", rest {rest * 1e3:.3f}")
    log(f"  eager forward: {n_kernels} kernels, {kernel_us / 1e3:.2f} ms summed kernel time")
    per_cat = by_category(per_name)
    log("  by kind: " + "; ".join(f"{cat} {us / 1e3:.2f} ms ({count})"
                                  for cat, (count, us) in sorted(per_cat.items(), key=lambda kv: -kv[1][1])))
    for name, (count, us) in sorted(per_name.items(), key=lambda kv: -kv[1][1])[:top]:
        log(f"    {us / 1e3:7.3f} ms {count:5d}x  {name[:110]}")


def trace_kernels(path: str) -> list[dict]:
    """The kernel events of a Chrome trace (`ts` start, `dur` µs, `tid` stream, `name`), by start."""
    with open(path) as f:
        return sorted((e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"), key=lambda e: e["ts"])


def exposed_by_category(kernels: list[dict], table=CATEGORIES) -> tuple[dict[str, float], float]:
    """Each kernel's device time past the end of every kernel that started before it (what it adds to the
    step's span; a kernel hidden under another one on a side stream adds 0), summed per `category`; and
    the summed idle gaps between them. The categories and gaps add up to the span, first start to last end."""
    exposed, idle = defaultdict(float), 0.0
    end = kernels[0]["ts"] if kernels else 0.0
    for e in kernels:
        idle += max(0.0, e["ts"] - end)
        exposed[category(e["name"], table)] += max(0.0, e["ts"] + e["dur"] - max(end, e["ts"]))
        end = max(end, e["ts"] + e["dur"])
    return dict(exposed), idle


def layer_timeline(kernels: list[dict], layer: int) -> list[str]:
    """One decoder layer of a graph replay (its trace's `trace_kernels`), kernel by kernel: start (µs from the
    layer's first kernel), duration, idle gap before it on the device (negative: it overlaps the
    previous one), stream. A layer runs from its input RMSNorm to the next layer's (two norm launches
    a layer: the input and the post-attention norm, each with the residual add fused in)."""
    norms = [i for i, e in enumerate(kernels) if e["name"] == "_rms_norm_kernel"]
    if len(norms) < 2 * layer + 3:
        return [f"  (trace: {len(norms)} norm kernels, too few to find layer {layer})"]
    first, last = norms[2 * layer], norms[2 * layer + 2]
    t0 = end = kernels[first]["ts"]
    lines = [f"  graph replay, layer {layer}: {kernels[last]['ts'] - t0:.1f} us"]
    for e in kernels[first:last]:
        lines.append(f"    {e['ts'] - t0:7.1f} {e['dur']:6.1f} gap {e['ts'] - end:5.1f}  stream {e['tid']:<4} "
                     f"{e['name'][:60]}")
        end = max(end, e["ts"] + e["dur"])
    return lines


def _trace_path(trace_dir: str | None, conc: int, label: str) -> str | None:
    return None if trace_dir is None else f"{trace_dir}/conc{conc}_{label.split(',')[0].replace(' ', '_')}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    add_model_args(ap, 0)  # the model's own layer count (DeepSeek-V2-Lite 27), as decode.py builds it
    ap.add_argument("--conc", default="1,64")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--trace", default=None,
                    help="directory for Chrome traces of each point's graph replay and eager forward")
    args = ap.parse_args()
    if args.trace:
        Path(args.trace).mkdir(parents=True, exist_ok=True)  # the profiler's trace writer does not create it
    lines, log = tee()
    concs = [int(c) for c in args.conc.split(",")]
    cfg, model, adapters, quant, desc = model_from_args(ap, args)
    # the synchronous step: its phases are timed one by one and a step is then driven by hand
    eng = engine(model, cfg, 8, 16, max(concs), adapters, async_scheduling=False)
    log(f"GPU {torch.cuda.get_device_name()}, {desc}")
    for conc in concs:
        for label, names in (("8 adapters r16", list(adapters)), ("1 adapter r16", ["a0"]),
                             ("LoRA engine, base rows", [None])):
            log(f"conc {conc}, {label}:")
            profile_point(eng, conc, names, args.steps, args.top, log, _trace_path(args.trace, conc, label))
    del eng
    eng = engine(no_lora_twin(model, cfg, quant), cfg, 0, 0, max(concs), {}, async_scheduling=False)  # same weights
    for conc in concs:
        log(f"conc {conc}, no LoRA (engine without slots):")
        profile_point(eng, conc, [None], args.steps, args.top, log, _trace_path(args.trace, conc, "no LoRA"))
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
