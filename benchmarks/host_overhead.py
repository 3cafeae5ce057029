"""Host-side cost of a decode step: what `LLMEngine.step` spends outside the model forward.

A tiny Qwen3-MoE model (1 layer, so the forward is short) decodes `--conc` requests (32-token prompts,
greedy) with 8 adapters interleaved over them, or none; each host phase of the step is timed
(median over `--steps` steps): schedule, adapter acquire, prepare (host lists -> the step's device
tensors and LoRABatch), sample (launch), read-back (the host sync plus token bookkeeping). On CUDA
each phase is bracketed by device syncs, so a phase's time includes the copies it queues. The
phases do not depend on the model's size: on a GPU they add to the step time of the synchronous
engine, and overlapped scheduling (`--async-scheduling`) hides them behind the device.

usage: python benchmarks/host_overhead.py [--device cpu|cuda] [--conc 64,256] [--steps 20] [--no-lora]
       [--profile 25]   (then cProfile `--steps` more steps, no syncs: the top functions by own time)
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode import random_adapter  # noqa: E402

import moelora.engine.engine as engine_module  # noqa: E402
from moelora.config import ModelConfig  # noqa: E402
from moelora.engine.config import EngineConfig  # noqa: E402
from moelora.engine.engine import LLMEngine  # noqa: E402
from moelora.engine.request import SamplingParams  # noqa: E402
from moelora.models.registry import model_class  # noqa: E402

TINY = dict(family="qwen3_moe", vocab_size=512, hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
            intermediate_size=128, moe_intermediate_size=32, num_experts=8, top_k=2, norm_topk_prob=True,
            qk_norm="per_head", max_position_embeddings=4096, dtype="float32")
PHASES = (("scheduler", "schedule"), ("pool", "acquire"), ("runner", "prepare"), (engine_module, "sample"),
          (None, "_read_back"))


def build(device: str, conc: int, lora: bool, async_scheduling: bool) -> LLMEngine:
    dtype = "float32" if device == "cpu" else "bfloat16"  # CUDA: the Triton backend's usual dtype
    cfg = ModelConfig(**{**TINY, "dtype": dtype}).resolve()
    ecfg = EngineConfig(device=device, dtype=dtype, max_loras=8 if lora else 0, max_lora_rank=16 if lora else 0,
                        max_num_seqs=conc, max_model_len=1024, num_kv_blocks=conc * 40, block_size=16,
                        async_scheduling=async_scheduling).resolve(cfg)
    with torch.device(device):
        model = model_class(cfg)(cfg, max_loras=8 if lora else 0, max_rank=16 if lora else 0,
                                 options=ecfg.layer_options(), dtype=getattr(torch, dtype))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0, 0.02)
    adapters = {f"a{i}": random_adapter(model, f"a{i}", 16, i) for i in range(8)} if lora else {}
    eng = LLMEngine(model, None, ecfg, lambda name, path: adapters[name])
    for name in adapters:
        eng.pool.add(name, name)
    return eng


@contextmanager
def phase_timers(eng: LLMEngine, phases, device: str) -> Iterator[dict[str, list[float]]]:
    """While open, each (owner, method) of `phases` (owner: an engine attribute's name, None for the
    engine, or a module) is bracketed by device syncs and timed; yields method name -> seconds per call.
    The methods are restored on exit."""
    sinks: dict[str, list[float]] = {}
    saved = []
    for owner, name in phases:
        obj = eng if owner is None else getattr(eng, owner) if isinstance(owner, str) else owner
        fn = getattr(obj, name)
        sink = sinks.setdefault(name, [])

        def timed(*a, _fn=fn, _sink=sink, **kw):
            sync(device)
            t0 = time.perf_counter()
            out = _fn(*a, **kw)
            sync(device)
            _sink.append(time.perf_counter() - t0)
            return out

        saved.append((obj, name, fn))
        setattr(obj, name, timed)
    try:
        yield sinks
    finally:
        for obj, name, fn in saved:
            setattr(obj, name, fn)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(eng: LLMEngine, device: str, conc: int, steps: int, lora: bool) -> dict[str, float]:
    g = torch.Generator().manual_seed(conc)
    names = [f"a{i % 8}" if lora else None for i in range(conc)]
    params = SamplingParams(max_tokens=2 * steps + 16, temperature=0, ignore_eos=True)  # --profile: as many again
    for name in names:
        eng.add_request(torch.randint(0, 500, (32,), generator=g).tolist(), params, name)
    for _ in range(4):  # prefill, then a few decode steps
        eng.step()
    with phase_timers(eng, PHASES, device) as sinks:
        for _ in range(steps):
            eng.step()
    return {name: sorted(v)[len(v) // 2] * 1e3 for name, v in sinks.items() if v}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--conc", default="64,256")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--no-lora", action="store_true")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=False,
                    help="EngineConfig.async_scheduling (default off: the phases as the synchronous step runs them)")
    ap.add_argument("--profile", type=int, default=0, help="print this many functions of a cProfile of the steps")
    args = ap.parse_args()
    lora = not args.no_lora
    print(f"host phases per decode step, ms (median of {args.steps}), device {args.device}, "
          f"{'8 adapters' if lora else 'no LoRA'}")
    for conc in map(int, args.conc.split(",")):
        eng = build(args.device, conc, lora, args.async_scheduling)
        ms = measure(eng, args.device, conc, args.steps, lora)
        print(f"conc {conc:4d}: " + "  ".join(f"{k} {v:.3f}" for k, v in ms.items())
              + f"  total {sum(ms.values()):.3f}", flush=True)
        if args.profile:
            prof = cProfile.Profile()
            for _ in range(args.steps):
                prof.runcall(eng.step)
            sync(args.device)
            print(f"# cProfile of {args.steps} steps at conc {conc} (own time, ms)")
            pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(args.profile)


if __name__ == "__main__":
    main()
