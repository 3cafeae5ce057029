"""GPU equivalence diagnostics: max teacher-forced |logprob| differences between engine paths,
in fp32 and bf16, on the random tiny Qwen2-MoE of tests/helpers/gpu_engine.py."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: moelora, tests.helpers
from tests.helpers.gpu_engine import SIZES, forced_logprob_diff, generate, gpu_engine, workload  # noqa: E402
from tests.helpers.models import build, random_adapter  # noqa: E402
from tests.helpers.oracle import tiny_hf_model  # noqa: E402

for dtype in (torch.float16, torch.bfloat16):
    hf = tiny_hf_model("qwen2_moe", seed=3, **SIZES)
    model = build(hf, max_loras=4, max_rank=16).to("cuda", dtype)
    adapters = {f"a{i}": random_adapter(model, 40 + i, r, frac=0.8) for i, r in enumerate((16, 8, 4, 12))}
    name = str(dtype).split(".")[-1]
    prompts, names = workload(n=16)
    kw = dict(dtype=name)
    runs = {
        "torch eager": dict(kernel_backend="torch"),
        "triton eager 1-stream": dict(enforce_eager=True, overlap_shared_experts=False),
        "triton eager 2-stream": dict(enforce_eager=True, overlap_shared_experts=True),
        "triton graph 1-stream": dict(overlap_shared_experts=False),
        "triton graph 2-stream": dict(overlap_shared_experts=True),
    }
    outs = {}
    for label, extra in runs.items():
        outs[label] = generate(gpu_engine(model, adapters, **kw, **extra), prompts, names, 64)
    ref_engine = gpu_engine(model, adapters, **kw, kernel_backend="torch")
    for label, reqs in outs.items():
        same = sum(a.output_ids == b.output_ids for a, b in zip(reqs, outs["torch eager"], strict=True))
        d = forced_logprob_diff(ref_engine, reqs)
        print(f"{name:9} {label:24} teacher-forced vs torch prefill: {d:.2e}; same tokens as torch eager: {same}/16",
              flush=True)
    tri = gpu_engine(model, adapters, **kw, enforce_eager=True)
    d2 = forced_logprob_diff(tri, outs["triton graph 2-stream"])
    print(f"{name:9} graph 2-stream vs triton eager prefill: {d2:.2e}", flush=True)
