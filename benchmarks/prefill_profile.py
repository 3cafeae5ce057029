"""Where a prefill step's time goes: GPU time by kernel category, host time against GPU time, host syncs.

`benchmarks/prefill.py --profile` calls `profile_workloads` with its engines (no LoRA, 1 adapter, 8 adapters
of rank 16) after its timed runs. For each workload, over one prefill run of `n` prompts of `prompt_len`:
  1. unprofiled: the host time of each phase of a step (`host_overhead.phase_timers` with no device sync:
     schedule, adapter acquire, input prepare, the forward's launch, sampling's launch, read-back; with
     overlapped scheduling the read-back waits for the device) and the device time of each forward (CUDA
     events around `runner.run`). A forward whose host launch time is near its device time, and whose device
     time is well above the kernels' summed time, leaves the GPU waiting on the host;
  2. under torch.profiler (CPU + CUDA): the kernels' summed time per step by category (`CATEGORIES`) and the
     top kernels, and the host calls that wait for the device (synchronizations, blocking copies, `.item()`);
     and the first step's middle layer kernel by kernel, with the device's idle gaps between them
     (`decode_profile.layer_timeline`);
  3. a cProfile of the host side of the same steps: the functions with the most own time.
Chrome traces of the profiled runs with `trace` (a directory).
"""

from __future__ import annotations

import cProfile
import pstats
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager

import torch
from decode_profile import by_category, kernel_times, layer_timeline, median, trace_kernels
from host_overhead import phase_timers

import moelora.engine.engine as engine_module
from moelora.bench import random_prompts, time_prefill

CATEGORIES = (  # first match wins: exact Triton names (=), prefixes (^), substrings of cuBLAS / ATen names
    ("attention", ("^_prefill", "^_decode", "=decode_reduce_kernel", "^_store", "^_mla")),
    ("MoE GEMMs", ("=gate_up_kernel", "=down_kernel")),
    ("MoE plan / routing / combine", ("^_plan_", "=combine_kernel", "=_softmax_topk_kernel", "topk", "sort")),
    ("MoE LoRA", ("=lora_shrink_kernel", "=lora_route_delta_kernel", "=lora_block_delta_kernel", "=act_delta_kernel",
                  "=act_spread_kernel", "=lora_stacked_shrink_kernel")),
    ("dense LoRA", ("^_lora_", "=planned_delta_kernel", "^_expand_lora", "^_absorb_lora", "^_concat_")),
    ("dense splitk GEMM + LoRA", ("^splitk_",)),
    ("dense GEMMs (cuBLAS; FP8: Triton + activation quant)", ("nvjet", "gemm", "gemv", "splitKreduce", "cutlass",
                                                              "xmma", "sm90_", "=_fp8_linear_kernel",
                                                              "=_group_quant_kernel")),
    ("norms / rotary / silu", ("=_rms_norm_kernel", "=_qk_norm_rope_kernel", "=_silu_mul_kernel")),
    ("copies / fills", ("Memcpy", "Memset", "copy", "Copy", "fill", "index", "gather", "scatter", "cat")),
)
# host calls that wait for the device (the first three are CUDA runtime calls, the last ATen's `.item()`)
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
         "aten::_local_scalar_dense")
PHASES = (("scheduler", "schedule"), ("pool", "acquire"), ("runner", "prepare"), ("runner", "run"),
          (engine_module, "sample"), (None, "_read_back"))


class _Clock:
    """A CUDA event's stand-in on the CPU, where the forward runs as it is launched."""

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, end: _Clock) -> float:
        return (end.t - self.t) * 1e3


def forwards(eng) -> list[str]:
    """The engine attributes whose `run` enqueues a step's forward: the runner, and the piecewise graphs if captured
    (the steps of up to `piecewise_graph_tokens`: the engine's default)."""
    return ["runner"] + (["pieces"] if eng.pieces is not None else [])


@contextmanager
def forward_events(eng):
    """While open, each forward's `run` (`forwards`) records CUDA events (on the CPU: clock reads) around itself;
    yields the (start, end) pairs."""
    pairs: list = []
    cuda = eng.device.type == "cuda"
    saved = [(getattr(eng, owner), getattr(eng, owner).run) for owner in forwards(eng)]

    def wrap(run):
        def timed(*a, **kw):
            s, e = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else (
                _Clock(), _Clock())
            s.record()
            out = run(*a, **kw)
            e.record()
            pairs.append((s, e))
            return out
        return timed

    for obj, run in saved:
        obj.run = wrap(run)
    try:
        yield pairs
    finally:
        for obj, run in saved:
            obj.run = run


def host_and_device(eng, prompts, names, log) -> float:
    """Part 1 (see the module docstring); returns the device ms of a forward (median)."""
    phases = PHASES + tuple((owner, "run") for owner in forwards(eng) if owner != "runner")  # one "run" sink
    with phase_timers(eng, phases, "cpu") as sinks, forward_events(eng) as pairs:
        wall, steps = time_prefill(eng, prompts, names)
    device = [s.elapsed_time(e) for s, e in pairs]
    log(f"  {steps} steps ({len(pairs)} forwards; the last step only reads back), {wall / len(pairs) * 1e3:.1f} ms "
        f"a forward (wall); a forward on the device {median(device):.1f} ms (median), its host launch "
        f"{median(sinks['run']) * 1e3:.1f} ms")
    log("  host ms a call (median): " + ", ".join(f"{k} {median(v) * 1e3:.2f}" for k, v in sinks.items() if v))
    return median(device)


def profiled(eng, prompts, names, log, top: int, trace: str | None, device_ms: float) -> None:
    """Part 2 (see the module docstring)."""
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof, forward_events(eng) as pairs:
        time_prefill(eng, prompts, names)
    fwd = max(1, len(pairs))
    with tempfile.TemporaryDirectory() as tmp:
        path = trace or f"{tmp}/trace.json"
        prof.export_chrome_trace(path)
        # the first forward's middle layer
        for line in layer_timeline(trace_kernels(path), eng.model_config.num_layers // 2):
            log(line)
    per_name = kernel_times(prof)
    n_kernels = sum(c for c, _ in per_name.values())
    kernel_ms = max(1e-9, sum(us for _, us in per_name.values()) / 1e3 / fwd)
    log(f"  kernels a forward: {n_kernels / fwd:.0f}, {kernel_ms:.1f} ms summed (the unprofiled forward's device "
        f"span: {device_ms:.1f} ms, so {max(0.0, device_ms - kernel_ms):.1f} ms with no kernel running)")
    for cat, (count, us) in sorted(by_category(per_name, CATEGORIES).items(), key=lambda kv: -kv[1][1]):
        log(f"    {us / 1e3 / fwd:8.2f} ms {100 * us / 1e3 / fwd / kernel_ms:5.1f}% {count / fwd:6.0f}x  {cat}")
    log("  top kernels (ms a forward, launches a forward):")
    for name, (count, us) in sorted(per_name.items(), key=lambda kv: -kv[1][1])[:top]:
        log(f"    {us / 1e3 / fwd:8.3f} ms {count / fwd:6.0f}x  {name[:100]}")
    waits: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CPU and ev.name in WAITS:
            waits[ev.name][0] += 1
            waits[ev.name][1] += ev.cpu_time_total
    log("  host waits on the device a forward: " + (", ".join(f"{k} {c / fwd:.1f}x {us / 1e3 / fwd:.2f} ms"
                                                             for k, (c, us) in waits.items()) or "none"))


def host_profile(eng, prompts, names, log, top: int) -> None:
    """Part 3 (see the module docstring)."""
    prof = cProfile.Profile()
    with forward_events(eng) as pairs:
        prof.enable()
        t0 = time.perf_counter()
        time_prefill(eng, prompts, names)
        prof.disable()
    fwd = max(1, len(pairs))
    log(f"  cProfile of {fwd} forwards ({(time.perf_counter() - t0) * 1e3 / fwd:.1f} ms a forward under it); "
        "ms a forward own / with callees, calls a forward:")
    stats = pstats.Stats(prof).stats  # (file, line, function) -> (primitive calls, calls, own s, cumulative s, ..)
    for (path, line, func), (_, calls, own, cum, _) in sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]:
        where = f"{path.rsplit('/', 2)[-1] if path != '~' else ''}:{line}({func})"
        log(f"    {own * 1e3 / fwd:8.2f} {cum * 1e3 / fwd:8.2f} {calls / fwd:7.0f}  {where[:100]}")


def profile_workloads(engines, prompt_len: int, n: int, vocab: int, log, trace: str | None = None,
                      top: int = 15) -> None:
    """Profile a prefill run of `n` prompts of `prompt_len` on each (label, engine, adapter names): every
    workload's unprofiled timing first, then the cProfiles, then torch.profiler (after a torch.profiler
    session the host's CUDA calls measured slower: run 1 of issue 32, LoRA's host launch 179 ms a forward
    under the profile's timing against 125-130 ms in the timed runs before it)."""
    def prompts(k: int, part: int):
        return random_prompts(n, prompt_len, vocab, seed=7_000_000 + prompt_len * 10 + k + 100 * part)

    device_ms = []
    for k, (label, eng, names) in enumerate(engines):
        log(f"profile: {label}, {n} prompts of {prompt_len} tokens: host and device")
        time_prefill(eng, prompts(k, 0), names)  # warm
        device_ms.append(host_and_device(eng, prompts(k, 1), names, log))
    for k, (label, eng, names) in enumerate(engines):
        log(f"profile: {label}: host functions")
        host_profile(eng, prompts(k, 2), names, log, top)
    for k, (label, eng, names) in enumerate(engines):
        log(f"profile: {label}: kernels")
        path = f"{trace}/prefill_{prompt_len}_{label.replace(' ', '_')}.json" if trace else None
        profiled(eng, prompts(k, 3), names, log, top, path, device_ms[k])
