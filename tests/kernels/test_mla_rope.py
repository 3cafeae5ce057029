"""`mla_rope_store` (MLA decode's rotations, latent RMSNorm and cache store in one launch) vs the ops it replaces:
`layers.rotary`'s torch rotations (interleaved, as DeepSeek's checkpoints, and rotate-half), `kernels.norm`'s
RMSNorm and `write_latent_ref`, bit for bit under the interpreter; the `gpu` case at DeepSeek-V2-Lite's widths in
bf16 (rotations bit for bit, the norm within one bf16 rounding: its fp32 sum runs in another order)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.interp  # `make test` runs it with TRITON_INTERPRET=1 (set before triton is imported)
triton = pytest.importorskip("triton")

from moelora.kernels.mla_rope import mla_rope_store  # noqa: E402
from moelora.kernels.norm import rms_norm  # noqa: E402
from moelora.layers.mla import write_latent_ref  # noqa: E402
from moelora.layers.rotary import RotaryEmbedding, apply_rotary, apply_rotary_interleaved  # noqa: E402
from tests.helpers.kernel_env import DEV, gpu_only, kernel_test  # noqa: E402


def case(T, N, nope, rope, C, dtype, device, seed, NB=4, BS=4):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(T, N * (nope + rope) + 5, generator=g) * 2)[:, :N * (nope + rope)]  # a strided view's rows
    q = q.to(dtype).to(device).view(T, N, nope + rope)
    compressed = (torch.randn(T, C + rope, generator=g) * 2).to(dtype).to(device)
    cos, sin = RotaryEmbedding(rope, 10000.0).to(device)(torch.randint(0, 4096, (T,), generator=g).to(device))
    w = (1 + 0.2 * torch.randn(C, generator=g)).to(device)
    cache = torch.randn(NB, BS, C + rope, generator=g).to(dtype).to(device)
    slots = torch.randperm(NB * BS, generator=g)[:T].to(device)
    if T > 1:
        slots[1] = -1  # a padding row: stores nothing
    return q, compressed, cos, sin, w, cache, slots


def unfused(q, compressed, cos, sin, w, eps, cache, slots, interleave):
    """The absorbed path's ops before `mla_rope_store`: q's rope part rotated, entries = (norm(latent), rotated
    key) stored at the slots >= 0."""
    rotate = apply_rotary_interleaved if interleave else apply_rotary
    rope, C = cos.shape[1], compressed.shape[1] - cos.shape[1]
    q_rope = rotate(q[..., -rope:], cos, sin)
    entries = torch.cat((rms_norm(compressed[:, :C], w, eps), rotate(compressed[:, None, C:], cos, sin)[:, 0]), -1)
    keep = slots >= 0
    write_latent_ref(entries[keep], cache, slots[keep])
    return q_rope


@kernel_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # the interpreter's bf16 casts truncate: GPU only
@pytest.mark.parametrize("interleave", [True, False], ids=["interleaved", "halves"])
@pytest.mark.parametrize("T,N,nope,rope,C", [(3, 5, 8, 8, 24), (1, 2, 16, 6, 20), (4, 16, 4, 16, 64), (0, 2, 8, 8, 16)])
def test_mla_rope_store_equals_the_ops_it_replaces(dtype, interleave, T, N, nope, rope, C):
    q, compressed, cos, sin, w, cache, slots = case(T, N, nope, rope, C, dtype, DEV, seed=T * 7 + C)
    q0, c0 = q.clone(), compressed.clone()
    want_cache = cache.clone()
    want = unfused(q, compressed, cos, sin, w, 1e-6, want_cache, slots, interleave)
    got = mla_rope_store(q, compressed, cos, sin, w, 1e-6, cache, slots, interleave=interleave)
    assert torch.equal(q, q0) and torch.equal(compressed, c0)
    assert got.shape == (T, N, rope) and got.is_contiguous()
    assert torch.equal(got, want)
    assert torch.equal(cache, want_cache)  # the slots' entries, and every other row kept


def test_mla_rope_store_refusals():
    q, compressed, cos, sin, w, cache, slots = case(2, 2, 8, 8, 16, torch.float32, "cpu", seed=1)
    with pytest.raises(ValueError, match="rope width"):
        mla_rope_store(q, compressed, cos[:, :7], sin[:, :7], w, 1e-6, cache, slots, interleave=True)
    with pytest.raises(ValueError, match="compressed must be"):
        mla_rope_store(q, compressed.half(), cos, sin, w, 1e-6, cache, slots, interleave=True)
    with pytest.raises(ValueError, match="cache must be"):
        mla_rope_store(q, compressed, cos, sin, w, 1e-6, cache[:, :, :-1], slots, interleave=True)
    with pytest.raises(ValueError, match="norm_weight"):
        mla_rope_store(q, compressed, cos, sin, w[:-1], 1e-6, cache, slots, interleave=True)
    with pytest.raises(ValueError, match="slot_mapping"):
        mla_rope_store(q, compressed, cos, sin, w, 1e-6, cache, slots.float(), interleave=True)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("T", [1, 8, 64])
@pytest.mark.parametrize("interleave", [True, False], ids=["interleaved", "halves"])
def test_gpu_mla_rope_store_at_deepseek_widths(T, interleave):
    """DeepSeek-V2-Lite: 16 heads, nope 128, rope 64, C 512, bf16."""
    q, compressed, cos, sin, w, cache, slots = case(T, 16, 128, 64, 512, torch.bfloat16, "cuda", seed=T,
                                                   NB=64, BS=16)
    want_cache = cache.clone()
    want = unfused(q, compressed, cos, sin, w, 1e-6, want_cache, slots, interleave)
    got = mla_rope_store(q, compressed, cos, sin, w, 1e-6, cache, slots, interleave=interleave)
    assert torch.equal(got, want)
    assert torch.equal(cache[..., 512:], want_cache[..., 512:])  # the rotated keys
    latent, want_latent = cache[..., :512].float(), want_cache[..., :512].float()
    assert ((latent - want_latent).abs() <= want_latent.abs() * 2.0 ** -7).all()  # one bf16 rounding apart


def _in_place_case(T, N, nope, rope, C, dtype, device, seed, interleave):
    """(q after an in-place call, the returned view, q_rope of an out-of-place call on a copy, both caches)."""
    q, compressed, cos, sin, w, cache, slots = case(T, N, nope, rope, C, dtype, device, seed, NB=T // 16 + 2, BS=16)
    q2, cache2 = q.clone(), cache.clone()
    want = mla_rope_store(q2, compressed, cos, sin, w, 1e-6, cache2, slots, interleave=interleave)
    got = mla_rope_store(q, compressed, cos, sin, w, 1e-6, cache, slots, interleave=interleave, in_place=True)
    return q, q2, got, want, cache, cache2


@kernel_test
@pytest.mark.parametrize("interleave", [True, False], ids=["interleaved", "halves"])
@pytest.mark.parametrize("T,N,nope,rope,C", [(3, 5, 8, 8, 24), (4, 16, 4, 16, 64)])
def test_mla_rope_store_in_place_rotates_q_rope_columns(interleave, T, N, nope, rope, C):
    """in_place: the returned q_rope is q[..., Dn:] itself, holding what a separate q_rope would; the nope
    columns and the cache as out of place."""
    q, q_before, got, want, cache, cache2 = _in_place_case(T, N, nope, rope, C, torch.float32, DEV, T + N,
                                                             interleave)
    assert got.data_ptr() == q[..., nope:].data_ptr() and got.stride() == q.stride()
    assert torch.equal(q[..., nope:], want)
    assert torch.equal(q[..., :nope], q_before[..., :nope])
    assert torch.equal(cache, cache2)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("T,N", [(1, 16), (2048, 16), (1024, 128)], ids=["dsv2_1", "dsv2_2048", "dsv3_1024"])
@pytest.mark.parametrize("interleave", [True, False], ids=["interleaved", "halves"])
def test_gpu_mla_rope_store_in_place_at_deepseek_widths(T, N, interleave):
    """In place on the GPU (a pair's partner sits in another thread: the kernel's barrier) equals out of place
    bit for bit at DeepSeek-V2-Lite's 16 and DeepSeek-V3's 128 heads, bf16, nope 128, rope 64, C 512."""
    q, q_before, got, want, cache, cache2 = _in_place_case(T, N, 128, 64, 512, torch.bfloat16, "cuda", T,
                                                             interleave)
    assert torch.equal(q[..., 128:], want)
    assert torch.equal(q[..., :128], q_before[..., :128])
    assert torch.equal(cache, cache2)
