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
from decode_profile import by_category, kernel_times, layer_timeline, median
from host_overhead import phase_timers

import moelora.engine.engine as engine_module
from moelora.bench import random_prompts, time_prefill

CATEGORIES = (  # first match wins: exact Triton names (=), prefixes (^), substrings of cuBLAS / ATen names
    ("attention", ("^_prefill", "^_decode", "=decode_reduce_kernel", "^_store", "^_mla")),
    ("MoE GEMMs", ("=gate_up_kernel", "=down_kernel")),
    ("MoE plan / routing / combine", ("^_plan_", "=combine_kernel", "=_softmax_topk_kernel", "topk", "sort")),
    ("MoE LoRA", ("=lora_shrink_kernel", "=lora_route_delta_kernel", "=lora_block_delta_kernel", "=act_delta_kernel",
                  "=act_spread_kernel", "=lora_stacked_shrink_kernel")),
    ("dense LoRA", ("^_lora_", "=planned_delta_kernel", "^_expand_lora", "^_absorb_lora")),
    ("dense splitk GEMM + LoRA", ("^splitk_",)),
    ("dense GEMMs (cuBLAS)", ("nvjet", "gemm", "cutlass", "xmma", "sm90_")),
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


@contextmanager
def forward_events(eng):
    """While open, `eng.runner.run` records CUDA events (on the CPU: clock reads) around itself; yields the
    (start, end) pairs."""
    pairs: list = []
    run = eng.runner.run
    cuda = eng.device.type == "cuda"

    def timed(*a, **kw):
        s, e = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else (_Clock(),
                                                                                                          _Clock())
        s.record()
        out = run(*a, **kw)
        e.record()
        pairs.append((s, e))
        return out

    eng.runner.run = timed
    try:
        yield pairs
    finally:
        eng.runner.run = run


def host_and_device(eng, prompts, names, log) -> float:
    """Part 1 (see the module docstring); returns the device ms of a forward (median)."""
    with phase_timers(eng, PHASES, "cpu") as sinks, forward_events(eng) as pairs:
        wall, steps = time_prefill(eng, prompts, names)
    device = [s.elapsed_time(e) for s, e in pairs]
    log(f"  {steps} steps, {wall / steps * 1e3:.1f} ms a step (wall); forward on the device {median(device):.1f} ms "
        f"(median of {len(device)}), its host launch {median(sinks['run']) * 1e3:.1f} ms")
    log("  host ms a step (median): " + ", ".join(f"{k} {median(v) * 1e3:.2f}" for k, v in sinks.items() if v))
    return median(device)


def profiled(eng, prompts, names, log, top: int, trace: str | None, device_ms: float) -> None:
    """Part 2 (see the module docstring)."""
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        _, steps = time_prefill(eng, prompts, names)
    with tempfile.TemporaryDirectory() as tmp:
        path = trace or f"{tmp}/trace.json"
        prof.export_chrome_trace(path)
        for line in layer_timeline(path, eng.model_config.num_layers // 2):  # the first step's middle layer
            log(line)
    per_name = kernel_times(prof)
    n_kernels = sum(c for c, _ in per_name.values())
    kernel_ms = max(1e-9, sum(us for _, us in per_name.values()) / 1e3 / steps)
    log(f"  kernels a step: {n_kernels / steps:.0f}, {kernel_ms:.1f} ms summed (the unprofiled forward's device "
        f"span: {device_ms:.1f} ms, so {max(0.0, device_ms - kernel_ms):.1f} ms with no kernel running)")
    for cat, (count, us) in sorted(by_category(per_name, CATEGORIES).items(), key=lambda kv: -kv[1][1]):
        log(f"    {us / 1e3 / steps:8.2f} ms {100 * us / 1e3 / steps / kernel_ms:5.1f}% {count / steps:6.0f}x  {cat}")
    log("  top kernels (ms a step, launches a step):")
    for name, (count, us) in sorted(per_name.items(), key=lambda kv: -kv[1][1])[:top]:
        log(f"    {us / 1e3 / steps:8.3f} ms {count / steps:6.0f}x  {name[:100]}")
    waits: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CPU and ev.name in WAITS:
            waits[ev.name][0] += 1
            waits[ev.name][1] += ev.cpu_time_total
    log("  host waits on the device a step: " + (", ".join(f"{k} {c / steps:.1f}x {us / 1e3 / steps:.2f} ms"
                                                          for k, (c, us) in waits.items()) or "none"))


def host_profile(eng, prompts, names, log, top: int) -> None:
    """Part 3 (see the module docstring)."""
    prof = cProfile.Profile()
    prof.enable()
    t0 = time.perf_counter()
    _, steps = time_prefill(eng, prompts, names)
    prof.disable()
    log(f"  cProfile of the {steps} steps ({(time.perf_counter() - t0) * 1e3 / steps:.1f} ms a step under it); "
        "ms a step own / with callees, calls a step:")
    stats = pstats.Stats(prof).stats  # (file, line, function) -> (primitive calls, calls, own s, cumulative s, ..)
    for (path, line, func), (_, calls, own, cum, _) in sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]:
        where = f"{path.rsplit('/', 2)[-1] if path != '~' else ''}:{line}({func})"
        log(f"    {own * 1e3 / steps:8.2f} {cum * 1e3 / steps:8.2f} {calls / steps:7.0f}  {where[:100]}")


def profile_workloads(engines, prompt_len: int, n: int, vocab: int, log, trace: str | None = None,
                      top: int = 15) -> None:
    """Profile a prefill run of `n` prompts of `prompt_len` on each (label, engine, adapter names)."""
    for k, (label, eng, names) in enumerate(engines):
        log(f"profile: {label}, {n} prompts of {prompt_len} tokens")
        seed = 7_000_000 + prompt_len * 10 + k
        time_prefill(eng, random_prompts(n, prompt_len, vocab, seed=seed), names)  # warm
        device_ms = host_and_device(eng, random_prompts(n, prompt_len, vocab, seed=seed + 1), names, log)
        path = f"{trace}/prefill_{prompt_len}_{label.replace(' ', '_')}.json" if trace else None
        profiled(eng, random_prompts(n, prompt_len, vocab, seed=seed + 2), names, log, top, path, device_ms)
        host_profile(eng, random_prompts(n, prompt_len, vocab, seed=seed + 3), names, log, top)
