"""Does the host keep the device busy? Synchronous vs overlapped scheduling, traced.

For a model shape of `benchmarks/decode.py` (--model: qwen3_30b, the default, or dsv2_lite;
--layers; random bf16 weights), at a few concurrencies, with no LoRA (an engine without slots) and
with 8 adapters of rank 16, each with `async_scheduling` off and on:
  - step time of `--steps` back-to-back steps (one device sync at the end, as decode.py measures);
  - the same steps under torch.profiler (CPU and CUDA): the device's busy share of the window (the
    union of its kernel / copy / memset intervals over the window), the idle gaps between them, the
    host time of each engine phase (no syncs added: `record_function` ranges), and the CUDA runtime
    calls the host spent most time in (a host that blocks shows up as cudaStreamSynchronize,
    cudaEventSynchronize, a long cudaMemcpyAsync or cudaHostAlloc).
Prints a table per point and writes it to OUT.txt; `--trace DIR` also writes each point's Chrome
trace (gzip) for Perfetto.

usage: python benchmarks/step_overlap.py OUT.txt [--layers 12] [--conc 8,64,256] [--steps 12] [--trace DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, __file__.rsplit("/", 2)[0])
sys.path.insert(0, __file__.rsplit("/", 1)[0])

from decode import add_model_args, engine, model_from_args, no_lora_twin, tee  # noqa: E402

import moelora.engine.engine as engine_module  # noqa: E402
from moelora.engine.request import SamplingParams  # noqa: E402

# (owner, method): owner an engine attribute, None for the engine, or a module the engine calls into
PHASES = (("scheduler", "schedule"), ("pool", "acquire"), ("runner", "prepare"), ("graphs", "run"),
          (engine_module, "sample"), (None, "_read_back"))
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


@contextlib.contextmanager
def labelled_phases(eng):
    """Each phase method inside a `record_function` range named `phase:<method>` (no sync)."""
    saved = []
    for owner, name in PHASES:
        obj = eng if owner is None else getattr(eng, owner) if isinstance(owner, str) else owner
        fn = getattr(obj, name)

        def wrapped(*a, _fn=fn, _label=f"phase:{name}", **kw):
            with torch.profiler.record_function(_label):
                return _fn(*a, **kw)

        saved.append((obj, name, fn))
        setattr(obj, name, wrapped)
    try:
        yield
    finally:
        for obj, name, fn in saved:
            setattr(obj, name, fn)


def start(eng, conc: int, names: list, steps: int) -> list:
    g = torch.Generator().manual_seed(conc)
    params = SamplingParams(max_tokens=3 * steps + 16, temperature=0, ignore_eos=True)
    reqs = [eng.add_request(torch.randint(0, 1000, (32,), generator=g).tolist(), params, names[i % len(names)])
            for i in range(conc)]
    while any(len(r.output_ids) == 0 for r in reqs):
        eng.step()
    for _ in range(3):
        eng.step()
    torch.cuda.synchronize()
    return reqs


def timed_steps(eng, steps: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def busy_union(intervals: list[tuple[float, float]]) -> tuple[float, list[float]]:
    """Total covered length of [start, end) intervals and the gaps between the covered runs."""
    covered, gaps, end = 0.0, [], None
    for s, e in sorted(intervals):
        if end is None or s > end:
            if end is not None:
                gaps.append(s - end)
            covered += e - s
            end = e
        elif e > end:
            covered += e - end
            end = e
    return covered, gaps


def analyse(trace_path: str, steps: int, log) -> None:
    with open(trace_path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    device = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in DEVICE_CATS]
    host_ranges = [e for e in events if e.get("cat") == "user_annotation"]  # not their gpu_user_annotation twins
    steps_ev = sorted((e for e in host_ranges if e["name"] == "bench:step"), key=lambda e: e["ts"])
    if not device or not steps_ev:
        log("  (trace has no device events or no step ranges)")
        return
    t0, t1 = steps_ev[0]["ts"], max(max(e for _, e in device), steps_ev[-1]["ts"] + steps_ev[-1]["dur"])
    window = [(max(s, t0), min(e, t1)) for s, e in device if e > t0 and s < t1]
    covered, gaps = busy_union(window)
    span = t1 - t0
    big = sorted(gaps, reverse=True)
    log(f"  profiled window {span / steps / 1e3:.3f} ms a step; device busy {covered / span:.1%}; idle "
        f"{(span - covered) / steps / 1e3:.3f} ms a step in {len(gaps) / steps:.1f} gaps a step "
        f"(largest {', '.join(f'{g:.0f}' for g in big[:6])} us)")
    host = defaultdict(float)
    for e in host_ranges:
        if e["name"].startswith("phase:"):
            host[e["name"][6:]] += e["dur"]
    step_host = sum(e["dur"] for e in steps_ev)
    log(f"  host per step: step() {step_host / steps / 1e3:.3f} ms = "
        + ", ".join(f"{k} {v / steps / 1e3:.3f}" for k, v in host.items()))
    runtime = defaultdict(lambda: [0, 0.0, 0.0])
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver"):
            r = runtime[e["name"]]
            r[0] += 1
            r[1] += e["dur"]
            r[2] = max(r[2], e["dur"])
    top = sorted(runtime.items(), key=lambda kv: -kv[1][1])[:10]
    log("  CUDA runtime calls (per step: count, ms; longest us): "
        + "; ".join(f"{k} {c / steps:.0f}x {t / steps / 1e3:.3f} ({m:.0f})" for k, (c, t, m) in top))


def point(eng, conc: int, names: list, steps: int, label: str, log, trace: str | None, tmp: str) -> None:
    reqs = start(eng, conc, names, steps)
    wall = sorted(timed_steps(eng, steps) for _ in range(3))[1]
    path = f"{tmp}/trace.json"  # the profiler writes a file; analysed, then kept (gzip) only with --trace
    with labelled_phases(eng), torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            with torch.profiler.record_function("bench:step"):
                eng.step()
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)
    for r in reqs:
        eng.abort(r.request_id)
    while eng.has_unfinished():
        eng.step()
    log(f"conc {conc}, {label}: step {wall * 1e3:.3f} ms (back to back, median of 3 x {steps})")
    analyse(path, steps, log)
    if trace:
        with open(path, "rb") as src, gzip.open(f"{trace}/conc{conc}_{label.replace(' ', '_')}.json.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    add_model_args(ap, 12)
    ap.add_argument("--conc", default="8,64,256")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--trace", default=None, help="directory for each point's Chrome trace (gzip)")
    args = ap.parse_args()
    if args.trace:
        Path(args.trace).mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp()
    lines, log = tee()
    concs = [int(c) for c in args.conc.split(",")]
    cfg, model, adapters, quant, desc = model_from_args(ap, args)
    twin = no_lora_twin(model, cfg, quant)
    log(f"GPU {torch.cuda.get_device_name()}, {desc}")
    for overlapped in (False, True):
        mode = "async" if overlapped else "sync"
        engines = (("no LoRA", engine(twin, cfg, 0, 0, max(concs), {}, async_scheduling=overlapped), [None]),
                   ("8 adapters", engine(model, cfg, 8, 16, max(concs), adapters, async_scheduling=overlapped),
                    list(adapters)))
        for conc in concs:
            for label, eng, names in engines:
                point(eng, conc, names, args.steps, f"{label} {mode}", log, args.trace, tmp)
        del engines
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
