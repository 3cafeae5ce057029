"""Compile the tuner's candidate launches in several processes at once, before it times them one by one.

A tuner run is mostly Triton compiles (each new tile is two kernels, about 1-3 s each on the host's CPU), done
one at a time in the timing loop while the GPU idles. Here `workers` spawned processes each make the same
launches (same shapes, inputs and so the same argument specialisations) on the same GPU; Triton's on-disk
cache keeps every kernel, and the timing loop that follows loads them instead of compiling. Nothing is timed
here; a launch that fails (out of shared memory) is counted and left to the timing loop, which skips it.
"""

from __future__ import annotations

import functools
import multiprocessing
import sys
import time
from pathlib import Path


def precompile(jobs: list[tuple[dict, str, int, dict]], workers: int, pdl: bool = False) -> None:
    """jobs: (shape, dtype name of moe_bench_common.DTYPES, M, config dict) launches, compiled by `workers`
    spawned processes (CUDA does not survive a fork); `pdl`: as the timing loop launches them (a PDL launch is
    another compiled variant)."""
    if workers <= 1 or not jobs:
        return
    t0 = time.perf_counter()
    chunks = [c for c in (jobs[i::workers] for i in range(workers)) if c]
    try:
        with multiprocessing.get_context("spawn").Pool(len(chunks)) as pool:
            failed = sum(pool.map(functools.partial(_compile_chunk, pdl=pdl), chunks))
    except Exception as exc:  # noqa: BLE001 - a worker lost (e.g. out of memory): the timing loop compiles the rest
        print(f"# precompile stopped: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        return
    print(f"# precompiled {len(jobs)} launches in {len(chunks)} processes, {time.perf_counter() - t0:.0f} s "
          f"({failed} failed: skipped when timed)", flush=True)


def _compile_chunk(chunk: list[tuple[dict, str, int, dict]], pdl: bool = False) -> int:
    """Make each launch once (compiling it into Triton's cache); the number that raised."""
    sys.path.insert(0, str(Path(__file__).parent))
    import torch
    from moe_bench_common import DTYPES, fp8_layer, make_inputs, make_layer, moe_call

    from moelora.kernels.moe_config import FusedMoEConfig

    layers, failed = {}, 0
    for shape, dtype, M, cfg in chunk:
        key = (tuple(sorted(shape.items())), dtype)
        if key not in layers:
            layer = make_layer(shape, pool_ranks=())
            layers[key] = layer if DTYPES[dtype] is None else fp8_layer(layer, DTYPES[dtype])
        layer = layers[key]
        x, wts, ids = make_inputs(layer, M)
        try:
            moe_call(layer, x, wts, ids, None, FusedMoEConfig.from_dict(cfg), None, pdl)()
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001 - the timing loop reports and skips it
            failed += 1
            torch.cuda.synchronize()
    return failed
