"""kernel_backend "triton" on FP8 weights (under TRITON_INTERPRET=1: an exact fp32 comparison; on CUDA the
FP8 demo test of test_fp8.py checks the same path in bf16 under CUDA graphs, W8A16 and W8A8): the FP8 expert
and dense kernels in W8A16 (the interpreter's fp32 -> e4m3 cast is wrong across a binade, so W8A8 is checked
on the GPU: tests/kernels/test_fp8_moe.py) equal the torch twin, and the model keeps only its e4m3 weights and
scales."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.interp  # `make test` runs it with TRITON_INTERPRET=1 (set before triton is imported)
triton = pytest.importorskip("triton")

from moelora import LLM  # noqa: E402
from moelora.quant.storage import weight_bytes  # noqa: E402
from tests.helpers.fp8_models import SITES, fp8_model, mixed_batch  # noqa: E402
from tests.helpers.fp8_oracle import write_fp8_checkpoint  # noqa: E402
from tests.helpers.kernel_env import DEV, interp_only  # noqa: E402
from tests.helpers.oracle_lora import MLP, build_peft_adapter  # noqa: E402


@interp_only
@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3"])
def test_triton_backend_on_fp8_equals_torch_backend(family, tmp_path):
    """kernel_backend "triton" on FP8 weights (the W8A16 kernels) equals the torch twin; the model keeps only
    its e4m3 weights and scales."""
    hf = fp8_model(family, seed=6)
    write_fp8_checkpoint(hf, tmp_path / "model", "block", "per_expert")
    peft_dir = build_peft_adapter(hf, tmp_path / "peft", seed=1, target_modules=SITES[family] + MLP)
    names, seqs = mixed_batch(hf.config.vocab_size)
    seqs, names = [s.tolist() for s in seqs[:2]], ["b", None]
    logits = {}
    for backend in ("torch", "triton"):
        llm = LLM(tmp_path / "model", {"b": peft_dir}, device=DEV, dtype="float32", max_lora_rank=8, max_loras=1,
                  kernel_backend=backend)
        before = weight_bytes(llm.engine.model)
        logits[backend] = llm.logits(seqs, names)
        assert weight_bytes(llm.engine.model) == before and "float8_e4m3fn" in before
        del llm  # before the next engine plans its memory (on CUDA it takes what is free)
    for got, want in zip(logits["triton"], logits["torch"], strict=True):
        assert (got - want).abs().max() <= 1e-4 * max(1.0, want.abs().max().item())
