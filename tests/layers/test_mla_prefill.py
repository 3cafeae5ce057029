"""MLA prefill's attention core (`layers.mla.attend`, the expanded form's SDPA given as a batch of one so torch
takes its fused kernels) against the same causal attention in float64 and against the 3-D call it replaced (SDPA's
math kernel): the mask's bottom-right alignment (a chunk after a cached prefix), heads, and DeepSeek's head
widths (q / k 192, v 128)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moelora.layers.mla import attend
from tests.helpers.kernel_env import rel_err


def case(N: int, n: int, L: int, dtype: torch.dtype, device: str, seed: int = 0):
    """q [N, n, 192], keys [N, L, 192], vals [N, L, 128], the mask of n queries at positions L - n .. L - 1."""
    g = torch.Generator(device=device).manual_seed(seed)
    q, k = (torch.randn(N, m, 192, generator=g, device=device).to(dtype) for m in (n, L))
    v = torch.randn(N, L, 128, generator=g, device=device).to(dtype)
    mask = torch.arange(L, device=device)[None, :] <= torch.arange(L - n, L, device=device)[:, None]
    return q, k, v, mask


def exact(q, k, v, mask, scale):
    """The causal attention written out in float64."""
    s = (q.double() @ k.double().transpose(1, 2)) * scale
    return torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1) @ v.double()


@pytest.mark.parametrize("N,n,L", [(2, 5, 5), (3, 4, 11), (2, 1, 9), (1, 17, 40)])
def test_attend_is_causal_attention_bottom_right(N, n, L):
    q, k, v, mask = case(N, n, L, torch.float32, "cpu")
    got = attend(q, k, v, mask, 192 ** -0.5)
    assert got.shape == (N, n, 128)
    torch.testing.assert_close(got.double(), exact(q, k, v, mask, 192 ** -0.5), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("N,n,L", [(16, 2048, 2048), (16, 512, 2560), (128, 300, 700), (16, 1, 64)])
def test_gpu_attend_bf16_within_the_math_kernels_rounding(N, n, L):
    """bf16 on the GPU: the fused kernels' error against float64 at most twice that of the 3-D call's math kernel
    (+1e-3), which it replaced; both within bf16's rounding."""
    q, k, v, mask = case(N, n, L, torch.bfloat16, "cuda")
    want = exact(q, k, v, mask, 192 ** -0.5)
    fused = rel_err(attend(q, k, v, mask, 192 ** -0.5), want)
    math = rel_err(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=192 ** -0.5), want)
    assert fused <= 2 * math + 1e-3 and fused < 1e-2, (fused, math)
