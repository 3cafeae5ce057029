"""`moelora verify`: moelora's logits against transformers + PEFT, per adapter.

Needs the dev extra (transformers, peft). Runs both on the CPU in float32 over a few seeded
token sequences and reports the max abs logit difference per adapter (base model included).
An FP8 checkpoint is compared against transformers + PEFT on its weights dequantized (each e4m3 weight
times its scale, in fp32: `moelora.quant.checkpoint.dequantize_checkpoint`, into a temporary directory).
"""

from __future__ import annotations

import contextlib
import copy
import tempfile
from collections.abc import Callable

import torch

from moelora.errors import ConfigError


def _oracle(model_dir: str):
    try:
        import peft  # noqa: F401
        import transformers
    except ImportError:
        raise ConfigError("moelora verify needs transformers and peft: pip install 'moelora[dev]'") from None
    from moelora.config import ModelConfig
    from moelora.quant.checkpoint import dequantize_checkpoint

    fp8 = ModelConfig.from_hf(model_dir).quantization
    if fp8 is None:
        return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with tempfile.TemporaryDirectory() as plain:
        dequantize_checkpoint(model_dir, plain, fp8)
        return transformers.AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()


@contextlib.contextmanager
def no_moe_target_rewrite():
    """Disable PEFT's transformers-5 config rewrite for MoE models.

    peft 0.21 (`tuners_utils.inject_adapter` -> `transformers_weight_conversion.
    convert_peft_config_for_transformers`) turns `target_modules` entries ending in gate_proj/up_proj/
    down_proj/w1/w2/w3 into expert `target_parameters` for qwen3_moe, olmoe and mixtral: the shared /
    dense MLP LoRA is dropped and the gate_up rank doubled. It imports the function at call time, so
    replacing the module attribute disables it for get_peft_model and PeftModel.from_pretrained alike.
    """
    from unittest import mock

    import peft.utils.transformers_weight_conversion as twc

    with mock.patch.object(twc, "convert_peft_config_for_transformers", lambda *a, **k: None):
        yield


def _peft_model(base, path: str):
    from peft import PeftModel

    with no_moe_target_rewrite():
        return PeftModel.from_pretrained(copy.deepcopy(base), path).eval()


def verify(model_dir: str, adapters: dict[str, str], *, tolerance: float = 1e-3,
           print_fn: Callable[[str], None] = print, num_seqs: int = 3, seq_len: int = 24) -> float:
    """Returns the worst max-abs logit difference over the base model and every adapter."""
    from moelora.llm import LLM

    hf = _oracle(model_dir)
    llm = LLM(model_dir, adapters, device="cpu", dtype="float32", max_loras=max(1, len(adapters)))
    g = torch.Generator().manual_seed(0)
    seqs = torch.randint(0, llm.config.vocab_size, (num_seqs, seq_len), generator=g)
    worst = 0.0
    for name in [None, *adapters]:
        ref_model = hf if name is None else _peft_model(hf, adapters[name])
        with torch.no_grad():
            ref = ref_model(input_ids=seqs).logits.float()
        ours = torch.stack(llm.logits(seqs.tolist(), [name] * num_seqs))
        diff = (ours - ref).abs().max().item()
        worst = max(worst, diff)
        verdict = "ok" if diff <= tolerance else "MISMATCH"
        print_fn(f"{name or 'base':>16}: max |logit diff| = {diff:.3e}  {verdict}")
    return worst
