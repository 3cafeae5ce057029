"""kernel_backend "triton" on FP8 weights (under TRITON_INTERPRET=1: an exact fp32 comparison; on CUDA the
FP8 demo test of test_fp8.py checks the same path in bf16 under CUDA graphs): the FP8 expert and dense kernels,
W8A16 and W8A8 (the decoder's norms writing the quantized rows every FP8 GEMM of that input reads, `norm_fp8`;
the other inputs quantized by `per_token_group_quant`, both bit for bit the twin's `fake_quantize_groups`),
equal the torch twin, and the model keeps only its e4m3 weights and scales."""

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
@pytest.mark.parametrize("w8a8", [False, True], ids=["w8a16", "w8a8"])
@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3"])
def test_triton_backend_on_fp8_equals_torch_backend(family, w8a8, tmp_path):
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
                  kernel_backend=backend, fp8_activation_quant=w8a8)
        before = weight_bytes(llm.engine.model)
        logits[backend] = llm.logits(seqs, names)
        assert weight_bytes(llm.engine.model) == before and "float8_e4m3fn" in before
        del llm  # before the next engine plans its memory (on CUDA it takes what is free)
    for got, want in zip(logits["triton"], logits["torch"], strict=True):
        assert (got - want).abs().max() <= 1e-4 * max(1.0, want.abs().max().item())


@interp_only
def test_w8a8_decode_with_rows_quantized_by_their_writers_equals_torch_backend(tmp_path):
    """Decode steps of a W8A8 model with 128-wide heads: the norms write q/k/v's and the experts' inputs
    quantized, decode attention writes the o projection's; greedy tokens and their logprobs on the Triton
    backend equal the torch twin's (which rounds each GEMM input itself)."""
    from moelora.engine.request import SamplingParams
    from tests.helpers.fp8_models import QWEN_SIZES
    from tests.helpers.oracle import tiny_hf_model

    hf = tiny_hf_model("qwen3_moe", seed=8, **dict(QWEN_SIZES, head_dim=128))
    write_fp8_checkpoint(hf, tmp_path / "model", "block", "per_expert")
    peft_dir = build_peft_adapter(hf, tmp_path / "peft", seed=2, target_modules=SITES["qwen3_moe"] + MLP)
    names, seqs = mixed_batch(hf.config.vocab_size)
    got = {}
    for backend in ("torch", "triton"):
        eng = LLM(tmp_path / "model", {"b": peft_dir}, device=DEV, dtype="float32", max_lora_rank=8, max_loras=1,
                  kernel_backend=backend, fp8_activation_quant=True).engine
        params = SamplingParams(max_tokens=4, temperature=0, logprobs=0, ignore_eos=True)
        reqs = [eng.add_request(s.tolist(), params, None if n == "a" else n)
                for s, n in zip(seqs[:3], names[:3], strict=True)]
        while eng.has_unfinished():
            eng.step()
        got[backend] = [(r.output_ids, [lp[0] for lp in r.logprobs]) for r in reqs]
        del eng
    for (ids_t, lp_t), (ids_w, lp_w) in zip(got["triton"], got["torch"], strict=True):
        assert ids_t == ids_w
        assert max(abs(a - b) for a, b in zip(lp_t, lp_w, strict=True)) <= 1e-4
