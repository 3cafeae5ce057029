"""lora_linear (cuBLAS base + Triton LoRA delta) vs lora_linear_ref (torch twin).

Interpreter tests (tiny, fp16/fp32) run when TRITON_INTERPRET=1 or on CUDA; `gpu` tests run real
shapes in bf16 against an fp32 reference (relative error <= 1e-2).
"""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")

from moelora.kernels.lora_linear import LoRALinearConfig, lora_linear  # noqa: E402
from moelora.kernels.reference import DenseLoRAArgs, SlotRows, lora_linear_ref  # noqa: E402

CUDA = torch.cuda.is_available()
INTERP = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cuda" if CUDA and not INTERP else "cpu"
kernel_test = pytest.mark.skipif(not (INTERP or CUDA), reason="needs TRITON_INTERPRET=1 or CUDA")
gpu_only = pytest.mark.skipif(not CUDA or INTERP, reason="needs CUDA (not the interpreter)")
TINY = LoRALinearConfig(16, 32, 32, 4, 2)


def make_case(T, n_in, n_out, ranks, R, *, bias=True, dtype=torch.float32, device="cpu", seed=0, slots=None):
    g = torch.Generator().manual_seed(seed)  # routing and slots
    gd = torch.Generator(device=device).manual_seed(seed)  # tensors, drawn where they live

    def rn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gd, device=device) * scale).to(dtype)

    x, w = rn(T, n_in), rn(n_out, n_in, scale=n_in ** -0.5)
    b = rn(n_out) if bias else None
    if not ranks:
        return x, w, b, None
    S = len(ranks)
    a, bb = rn(S, R, n_in, scale=n_in ** -0.5), rn(S, n_out, R, scale=R ** -0.5)
    for s, r in enumerate(ranks):
        a[s, r:].zero_()
        bb[s, :, r:].zero_()
    if slots is None:
        slots = torch.randint(-1, S, (T,), generator=g, dtype=torch.int32)
    slots = torch.as_tensor(slots, dtype=torch.int32)
    active = tuple(SlotRows(s, ranks[s], (slots == s).nonzero().squeeze(1).to(device))
                   for s in range(S) if ranks[s] > 0 and bool((slots == s).any()))
    lora = DenseLoRAArgs(a, bb, slots.to(device), torch.tensor(ranks, dtype=torch.int32, device=device), active)
    return x, w, b, lora


def check(case, tol, config=None, ref_dtype=torch.float64):
    x, w, b, lora = case
    up = lambda t: None if t is None else t.to(ref_dtype)
    lr = lora and DenseLoRAArgs(up(lora.a), up(lora.b), lora.token_slots, lora.slot_ranks, lora.active)
    want = lora_linear_ref(up(x), up(w), up(b), lr)
    x_before = x.clone()
    out = torch.full((x.shape[0], w.shape[0]), float("nan"), dtype=x.dtype, device=x.device)
    got = lora_linear(x, w, b, lora, out=out, config=config)
    assert got is out and torch.equal(x, x_before)
    assert not torch.isnan(got).any()
    err = ((got.to(ref_dtype) - want).norm() / want.norm()).item() if want.numel() else 0.0
    assert err <= tol, err


@kernel_test
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.float16, 1e-2)])
def test_mixed_slots_ranks_below_max(dtype, tol):
    case = make_case(21, 40, 72, (24, 5, 0), 24, dtype=dtype, device=DEV, seed=1,
                     slots=[0, -1, 1, 2, 1] * 4 + [-1])
    check(case, tol, TINY)


@kernel_test
def test_no_lora_no_bias_one_and_zero_tokens():
    check(make_case(1, 40, 24, (), 0, bias=False, device=DEV, seed=2), 1e-5, TINY)
    check(make_case(1, 40, 24, (16,), 16, device=DEV, seed=3, slots=[0]), 1e-4, TINY)
    check(make_case(3, 40, 24, (16,), 16, device=DEV, seed=3, slots=[-1, -1, -1]), 1e-5, TINY)
    x, w, b, lora = make_case(0, 40, 24, (16,), 16, device=DEV, seed=4)
    assert lora_linear(x, w, b, lora, config=TINY).shape == (0, 24)


@kernel_test
def test_rejects_bad_shapes():
    x, w, b, lora = make_case(4, 32, 16, (16,), 16, device=DEV)
    with pytest.raises(ValueError, match="weight"):
        lora_linear(x, w[:, :-1], b, lora)
    with pytest.raises(ValueError, match="token_slots"):
        lora_linear(x[:3], w, b, lora)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("T", [1, 77, 1000])
def test_gpu_real_shape_bf16(T):
    ranks = (64, 16, 8, 0, 32, 16, 8, 64)
    case = make_case(T, 2048, 5120 + 64, ranks, 64, dtype=torch.bfloat16, device="cuda", seed=T)
    torch.cuda.set_sync_debug_mode("error")
    try:
        lora_linear(*case)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    check(case, 1e-2, ref_dtype=torch.float32)
