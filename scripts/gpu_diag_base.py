"""Which GPU-only factor moves a family's base-only steps on the LoRA graphs away from the eager plain path?
(`tests/engine/test_gpu_engine.py::test_base_only_steps_replay_graphs_without_lora[glm4_moe]` at 0.1975 > 0.05 in
the 53rd session, on main; not reproduced on the CPU interpreter in fp16.)

The test's two waves (8 requests over the adapters, then 8 on none; 48 greedy tokens) on engines with the base graphs
off (every step replays the LoRA graphs), one switch flipped at a time, each against the eager engine: per wave the
max |logprob difference| over the tokens both runs share (up to the first divergence, reported with its step) and
the request and step where it peaks. A switch that brings the base wave to the graphed engine's level names the part.

In float32 (`--dtype float32`) the paths' rounding shrinks ~65000-fold: a base wave still far from the eager one there
is a wrong value, not bf16 rounding amplified by the tiny model's routing.

usage: python scripts/gpu_diag_base.py [--family glm4_moe] [--tokens 48] [--dtype float32] [--variants 2]
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: moelora, tests.helpers
from tests.helpers.gpu_engine import FAMILIES, generate, gpu_engine, tiny_adapters, tiny_model, workload  # noqa: E402

VARIANTS = {  # label -> engine switches on top of base_decode_graphs=False ("graphed": the base graphs on)
    "graphed (base graphs on)": dict(base_decode_graphs=True),
    "base graphs off": {},
    "  pdl off": dict(pdl=False),
    "  overlap_shared_experts off": dict(overlap_shared_experts=False),
    "  overlap_lora off": dict(overlap_lora=False),
    "  skip_idle_lora_sites off": dict(skip_idle_lora_sites=False),
    "  lora_width_by_batch off": dict(lora_width_by_batch=False),
    "  merge_qkv, merge_gate_up off": dict(merge_qkv=False, merge_gate_up=False),
}


def wave_diff(got, want) -> tuple[float, str]:
    """Max |logprob difference| over the shared tokens of each request pair, where it peaks, and the divergences."""
    worst, where, diverged = 0.0, "-", []
    for g, w in zip(got, want, strict=True):
        for i, (a, b, ga, wa) in enumerate(zip(g.output_ids, w.output_ids, g.logprobs, w.logprobs, strict=True)):
            if a != b:
                diverged.append(f"{g.request_id} diverges at {i}")
                break
            if abs(ga[0] - wa[0]) > worst:
                worst, where = abs(ga[0] - wa[0]), f"{g.request_id} step {i}"
    return worst, "; ".join([where, *diverged])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="glm4_moe", choices=FAMILIES)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--variants", type=int, default=len(VARIANTS), help="the first N of VARIANTS only")
    args = ap.parse_args()
    model = tiny_model(args.family, dtype=getattr(torch, args.dtype))
    adapters = tiny_adapters(model, args.family)
    prompts, names = workload(n=16, seed=5)

    def waves(**kw):
        eng = gpu_engine(model, adapters, dtype=args.dtype, **kw)
        return (generate(eng, prompts[8:], names[8:], args.tokens),
                generate(eng, prompts[:8], [None] * 8, args.tokens))

    eager = waves(enforce_eager=True)
    for label, kw in list(VARIANTS.items())[:args.variants]:
        mixed, base = waves(**{"base_decode_graphs": False, **kw})
        (dm, wm), (db, wb) = wave_diff(mixed, eager[0]), wave_diff(base, eager[1])
        print(f"{args.family} {args.dtype} {label:32} mixed wave {dm:.4f} ({wm}); base wave {db:.4f} ({wb})",
              flush=True)


if __name__ == "__main__":
    main()
