"""`kernels.rounding.round_to` rounds as torch's casts do (to nearest, ties to even), including exact ties and
values that round up into the next binade; and the rotary kernel's bf16 output on the GPU equals torch's bf16
ops bit for bit (where a `.to(bf16).to(fp32)` round trip was folded into an fma: 2026-12-03)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.interp  # `make test` runs it with TRITON_INTERPRET=1 (set before triton is imported)
triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from moelora.kernels.rotary import qk_norm_rope  # noqa: E402
from moelora.kernels.rounding import round_to  # noqa: E402
from moelora.layers.rotary import RotaryEmbedding, apply_rotary  # noqa: E402
from tests.helpers.kernel_env import DEV, gpu_only, kernel_test  # noqa: E402


@triton.jit
def _round_kernel(x_ptr, like_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(y_ptr + offs, round_to(x, like_ptr), mask=offs < n)


def values(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4096, generator=g) * torch.exp2(torch.randint(-20, 20, (4096,), generator=g).float())
    # exact ties between two bf16 neighbours (low 16 bits 0x8000), an odd and an even upper half each, and the
    # largest fp32 below 2 (rounds up into the next binade)
    ties = torch.tensor([0x3F808000, 0x3F818000, -0x40800000 + 0x8000, 0x3FFFFFFF], dtype=torch.int64)
    return torch.cat((x, ties.to(torch.int32).view(torch.float32), torch.zeros(1), torch.tensor([-0.0])))


@kernel_test
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_round_to_equals_torch_casts(dtype):
    x = values(1).to(DEV)
    y = torch.empty_like(x)
    _round_kernel[(triton.cdiv(x.numel(), 1024),)](x, torch.empty(1, dtype=dtype, device=DEV), y, x.numel(),
                                                   BLOCK=1024)
    want = x.to(dtype).float()
    assert torch.equal(y, want)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("DR", [64, 128])
def test_gpu_rotary_bf16_equals_torch_ops(DR):
    """Qwen3's head width, no per-head norm (with it the rsqrt differs): q and k bit for bit torch's rotation."""
    g = torch.Generator().manual_seed(DR)
    T, NQ, NK, D = 64, 32, 4, 128
    q = (torch.randn(T, NQ, D, generator=g) * 2).bfloat16().cuda()
    k = (torch.randn(T, NK, D, generator=g) * 2).bfloat16().cuda()
    cos, sin = RotaryEmbedding(DR, 1e6).cuda()(torch.randint(0, 32768, (T,), generator=g).cuda())
    gq, gk = qk_norm_rope(q, k, cos, sin, None, None, 1e-6)
    assert torch.equal(gq, apply_rotary(q, cos, sin)) and torch.equal(gk, apply_rotary(k, cos, sin))
