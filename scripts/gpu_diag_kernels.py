"""Which Triton kernel carries the half-precision error? Prefill logits of the random tiny Qwen2-MoE
with the Triton backend on one module kind at a time, each against an fp32 torch reference. A module of
that kind is taken from the model's Triton twin (its own code path on the kernels, its children torch)."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: moelora, tests.helpers
from moelora.layers.attention import Attention  # noqa: E402
from moelora.layers.linear import Linear  # noqa: E402
from moelora.layers.moe import Experts  # noqa: E402
from moelora.layers.options import LayerOptions, adopt_tensors  # noqa: E402
from tests.helpers.gpu_engine import SIZES, gpu_engine, workload  # noqa: E402
from tests.helpers.models import build, random_adapter  # noqa: E402
from tests.helpers.oracle import tiny_hf_model  # noqa: E402


def triton_on(model, kinds):
    """A torch-backend twin of `model` (the same tensors) whose modules of `kinds` are its Triton twin's, each
    around the torch twin's children: the Triton path of those modules alone."""
    with torch.device("meta"):
        mixed = adopt_tensors(type(model)(model.config, **model.build_args), model)
    triton = model.with_options(LayerOptions(kernel_backend="triton"))
    swaps = {name: triton.get_submodule(name) for name, mod in mixed.named_modules() if name and isinstance(mod, kinds)}
    for name, swapped in swaps.items():  # each child: its own swap, or the torch twin's
        for child, _ in list(swapped.named_children()):
            setattr(swapped, child, swaps.get(f"{name}.{child}", mixed.get_submodule(f"{name}.{child}")))
    for name, swapped in swaps.items():
        mixed.set_submodule(name, swapped)
    return mixed


hf = tiny_hf_model("qwen2_moe", seed=3, **SIZES)
prompts, names = workload(n=8)
ref_model = build(hf, max_loras=4, max_rank=16).to("cuda", torch.float32)
adapters = {f"a{i}": random_adapter(ref_model, 40 + i, r, frac=0.8) for i, r in enumerate((16, 8, 4, 12))}
ref = gpu_engine(ref_model, adapters, dtype="float32", kernel_backend="torch").prompt_logits(prompts, names)
for dtype in ("float16", "bfloat16"):
    model = build(hf, max_loras=4, max_rank=16).to("cuda", getattr(torch, dtype))
    for kinds in ((), (Attention,), (Linear,), (Experts,), (Attention, Linear, Experts)):
        eng = gpu_engine(triton_on(model, kinds), adapters, dtype=dtype, kernel_backend="torch",
                         overlap_shared_experts=False)  # the mixed model's own options: no twin of it
        for lora in (True, False):
            nm = names if lora else [None] * len(names)
            out = eng.prompt_logits(prompts, nm)
            r = ref if lora else gpu_engine(ref_model, adapters, dtype="float32", kernel_backend="torch"
                                           ).prompt_logits(prompts, nm)
            err = max(((a - b).norm() / b.norm()).item() for a, b in zip(out, r, strict=True))
            label = "+".join(k.__name__ for k in kinds) or "none (torch)"
            print(f"{dtype:9} triton on {label:28} lora={lora!s:5} rel err vs fp32: {err:.2e}", flush=True)
