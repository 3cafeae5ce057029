"""`mla_prefill_keys` (MLA prefill's keys: each head's nope part beside the shared rotated key) against the
torch.cat it replaces, bit for bit: under the interpreter at small odd widths, on the GPU at DeepSeek's."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.interp  # `make test` runs it with TRITON_INTERPRET=1 (set before triton is imported)
triton = pytest.importorskip("triton")

from moelora.kernels.mla_keys import mla_prefill_keys  # noqa: E402
from tests.helpers.kernel_env import DEV, gpu_only, kernel_test  # noqa: E402


def keys_case(L, N, nope, v_dim, rope, dtype, device, seed):
    """kv [L, N, nope + v_dim] (kv_b's output, viewed), k_rope [L, rope] a column slice of wider rows (as the
    latents' cache rows give it)."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(L, N, nope + v_dim, generator=g).to(dtype).to(device)
    ctx = torch.randn(L, 7 + rope, generator=g).to(dtype).to(device)
    return kv, ctx[:, 7:]


def cat_keys(kv, k_rope, nope):
    return torch.cat((kv[..., :nope], k_rope[:, None].expand(-1, kv.shape[1], -1)), dim=-1)


@kernel_test
@pytest.mark.parametrize("L,N,nope,v_dim,rope", [(5, 3, 8, 8, 4), (9, 16, 6, 10, 5), (1, 1, 16, 16, 8),
                                                  (0, 2, 8, 8, 4)])
def test_mla_prefill_keys_equals_cat(L, N, nope, v_dim, rope):
    kv, k_rope = keys_case(L, N, nope, v_dim, rope, torch.float32, DEV, seed=L * 13 + N)
    kv0, r0 = kv.clone(), k_rope.clone()
    got = mla_prefill_keys(kv, k_rope, nope)
    assert got.shape == (L, N, nope + rope) and got.is_contiguous()
    assert torch.equal(got, cat_keys(kv, k_rope, nope))
    assert torch.equal(kv, kv0) and torch.equal(k_rope, r0)


def test_mla_prefill_keys_refusals():
    kv, k_rope = keys_case(4, 2, 8, 8, 4, torch.float32, "cpu", seed=0)
    with pytest.raises(ValueError, match="kv must be"):
        mla_prefill_keys(kv, k_rope, 17)
    with pytest.raises(ValueError, match="k_rope must be"):
        mla_prefill_keys(kv, k_rope[:3], 8)
    with pytest.raises(ValueError, match="k_rope must be"):
        mla_prefill_keys(kv, k_rope.half(), 8)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("L,N", [(8192, 16), (3000, 128), (1, 16)], ids=["dsv2_8192", "dsv3_3000", "one_row"])
def test_gpu_mla_prefill_keys_at_deepseek_widths(L, N):
    """DeepSeek-V2-Lite (16 heads) and -V3 (128): nope 128, v 128, rope 64, bf16."""
    kv, k_rope = keys_case(L, N, 128, 128, 64, torch.bfloat16, "cuda", seed=L)
    assert torch.equal(mla_prefill_keys(kv, k_rope, 128), cat_keys(kv, k_rope, 128))
