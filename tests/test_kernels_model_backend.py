"""A whole tiny model on the Triton backend equals the torch backend (under TRITON_INTERPRET=1 on the
CPU, or on CUDA): every family's wiring of the fused norm / residual, q/k norm + rotary, softmax
router and SiLU·up kernels, next to the attention, MoE and LoRA kernels, with a mixed-adapter batch.
Shape legend: T tokens of the step, V vocab.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from kernel_env import DEV, kernel_test  # noqa: E402
from oracle import tiny_hf_model  # noqa: E402
from test_forward import build, engine, random_adapter  # noqa: E402

import moelora.kernels.norm as norm_kernels  # noqa: E402
import moelora.kernels.rotary as rotary_kernels  # noqa: E402
import moelora.kernels.silu_mul as silu_kernels  # noqa: E402
import moelora.kernels.softmax_topk as router_kernels  # noqa: E402

LAUNCHERS = [(norm_kernels, "rms_norm"), (norm_kernels, "add_rms_norm"), (rotary_kernels, "qk_norm_rope"),
             (router_kernels, "softmax_topk"), (silu_kernels, "silu_mul")]


def count_launches(monkeypatch) -> dict[str, int]:
    """Wrap each launcher so the test knows the Triton path really ran (layers import them per call)."""
    calls = {name: 0 for _, name in LAUNCHERS}
    for module, name in LAUNCHERS:
        fn = getattr(module, name)

        def counted(*args, _fn=fn, _name=name, **kw):
            calls[_name] += 1
            return _fn(*args, **kw)

        monkeypatch.setattr(module, name, counted)
    return calls


# qwen3_moe: per-head q/k norm and a dense layer; qwen2_moe: gated shared expert, q/k/v bias, a dense
# layer, no q/k norm; olmoe: q/k norm over all heads.
@kernel_test
@pytest.mark.parametrize("family,fused", [("qwen3_moe", {"qk_norm_rope", "silu_mul"}),
                                          ("qwen2_moe", {"qk_norm_rope", "silu_mul"}),
                                          ("olmoe", {"qk_norm_rope", "rms_norm"})])
def test_triton_backend_logits_equal_torch_backend(family, fused, monkeypatch):
    hf = tiny_hf_model(family, seed=21)
    model = build(hf, max_loras=2, max_rank=4).to(DEV)
    adapters = {"a": random_adapter(model, seed=22, rank=4, frac=0.6)}
    calls = compare_backends(model, adapters, hf.config.vocab_size, (6, 1, 9), 23, monkeypatch)
    layers = hf.config.num_hidden_layers
    assert calls["add_rms_norm"] == 2 * layers  # one add + norm per layer and step, and the final one
    assert calls["softmax_topk"] >= 1 and all(calls[name] >= 1 for name in fused), calls


def compare_backends(model, adapters, vocab, lengths, seed, monkeypatch) -> dict[str, int]:
    """Logits of a mixed batch (adapter "a", base, "a") on the Triton backend equal the torch
    backend's within 1e-4; returns how often each fused launcher ran."""
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
    names = ["a", None, "a"]
    want = engine(model, adapters, max_loras=2, device=DEV, kernel_backend="torch").prompt_logits(seqs, names)
    calls = count_launches(monkeypatch)
    got = engine(model, adapters, max_loras=2, device=DEV, kernel_backend="triton").prompt_logits(seqs, names)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape
        assert (a - b).abs().max() <= 1e-4 * max(1.0, b.abs().max().item())
    return calls


# glm4_moe: partial rotary with per-head q/k norm, sigmoid group-limited router (torch), shared experts,
# a dense first layer; deepseek_v3: MLA (its inner norms on the rms_norm kernel), shared experts.
@kernel_test
@pytest.mark.parametrize("family,fused", [("glm4_moe", {"qk_norm_rope", "silu_mul"}),
                                          ("deepseek_v3", {"rms_norm", "silu_mul"})])
def test_triton_backend_logits_equal_torch_backend_glm_deepseek(family, fused, monkeypatch):
    from oracle import randomize_

    from moelora.config import ModelConfig
    from moelora.models.registry import model_class

    hf = tiny_hf_model(family, seed=31)
    randomize_(hf, seed=31)  # random correction bias and wide routers: selection has a margin
    cfg = ModelConfig.from_dict(dict(hf.config.to_dict(), architectures=[type(hf).__name__]))
    model = model_class(cfg)(cfg, max_loras=2, max_rank=4)
    model.load_state_dict(hf.state_dict(), strict=True)
    model = model.eval().to(DEV)
    adapters = {"a": random_adapter(model, seed=32, rank=4, frac=0.7)}
    calls = compare_backends(model, adapters, hf.config.vocab_size, (5, 1, 8), 33, monkeypatch)
    assert calls["add_rms_norm"] == 2 * hf.config.num_hidden_layers
    assert calls["softmax_topk"] == 0 and all(calls[name] >= 1 for name in fused), calls
