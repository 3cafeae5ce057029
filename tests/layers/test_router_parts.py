"""The fp32 router's logits on bf16 tensor cores (`layers.router.bf16_parts`): the weight split into bf16 parts
that sum to it exactly, and on the GPU the Triton backend's logits against the fp32 GEMM of x upcast (the torch
backend's), within the fp32 summation-order bound, for a weight of three parts and a checkpoint's bf16 one."""

from __future__ import annotations

import pytest
import torch

from moelora.layers.options import LayerOptions
from moelora.layers.router import Router, bf16_parts
from tests.helpers.kernel_env import gpu_only


@pytest.mark.parametrize("kind,parts", [("fp32", 3), ("bf16", 1), ("bf16+bf16", 2)])
def test_bf16_parts_sum_to_the_weight_exactly(kind, parts):
    g = torch.Generator().manual_seed(parts)
    w = torch.randn(64, 256, generator=g) * 0.05
    if kind == "bf16":
        w = w.bfloat16().float()
    elif kind == "bf16+bf16":  # a weight two parts hold: a bf16 value plus one 2^-12 of its size
        w = w.bfloat16().float()
        w = w + (w * 2.0 ** -12).bfloat16().float()
    got = bf16_parts(w)
    assert got.dtype == torch.bfloat16 and got.shape == (parts, 64, 256)
    assert torch.equal(got.double().sum(0), w.double())


def test_bf16_parts_of_zeros_is_one_zero_part():
    assert torch.equal(bf16_parts(torch.zeros(4, 8)), torch.zeros(1, 4, 8, dtype=torch.bfloat16))


def _routers(E, H, weight):
    out = []
    for backend in ("torch", "triton"):
        r = Router(H, E, correction_bias=False, options=LayerOptions(kernel_backend=backend)).cuda()
        with torch.no_grad():
            r.weight.copy_(weight)
        out.append(r)
    return out


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("T", [17, 64, 8192])
@pytest.mark.parametrize("kind", ["fp32", "bf16"])
def test_gpu_router_logits_on_bf16_parts_equal_the_fp32_gemm(T, kind, monkeypatch):
    """DeepSeek-V2-Lite's router (H 2048, 64 experts), bf16 x: the Triton backend's logits (one bf16 GEMM with
    fp32 output over the parts) within 2^-20 of sum |x w| of the torch backend's fp32 GEMM of x upcast (TF32 off);
    a weight written in place is split again."""
    import moelora.layers.router as router_module

    assert not torch.backends.cuda.matmul.allow_tf32
    calls = []
    real = router_module.bf16_parts_logits
    monkeypatch.setattr(router_module, "bf16_parts_logits", lambda *a: calls.append(1) or real(*a))
    g = torch.Generator().manual_seed(T)
    w = torch.randn(64, 2048, generator=g) * 0.02
    if kind == "bf16":
        w = w.bfloat16().float()
    x = torch.randn(T, 2048, generator=g).bfloat16().cuda()
    plain, fast = _routers(64, 2048, w)
    bound = (x.float().abs() @ w.abs().cuda().t()) * 2.0 ** -20 + 1e-30
    for _ in range(2):
        want, got = plain(x), fast(x)
        assert got.dtype == torch.float32 and got.shape == (T, 64)
        assert ((got - want).abs() <= bound).all(), ((got - want).abs() / bound).max()
        with torch.no_grad():  # in place: the parts must follow
            w2 = (w * -1.5).cuda()
            plain.weight.copy_(w2)
            fast.weight.copy_(w2)
        bound = bound * 1.5
    assert len(calls) == 2  # the fast path ran (this torch has mm's out_dtype), the torch backend's never
