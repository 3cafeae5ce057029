"""mla_decode_attention (Triton store + split-KV decode over the latent cache) vs mla_decode_attention_ref.

Interpreter tests (tiny, awkward widths, fp16/fp32) run when TRITON_INTERPRET=1 or on CUDA; `gpu` tests
run DeepSeek's sizes (C 512, Dr 64, N 16 / 128) in bf16 against an fp32 twin (relative error <= 1e-2),
with no host sync, and under a CUDA graph replayed after the metadata is updated in place.
Every case uses shuffled block ids, random cache contents everywhere (a read of a wrong block or slot
shows) and block-table padding that points at a random-filled block; outputs are poisoned first.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.interp  # `make test` runs it with TRITON_INTERPRET=1 (set before triton is imported)
triton = pytest.importorskip("triton")

from moelora.kernels.mla_attention import MLAConfig, default_mla_config, mla_decode_attention  # noqa: E402
from moelora.kernels.reference import mla_decode_attention_ref  # noqa: E402
from moelora.layers.attention import AttnMetadata  # noqa: E402
from tests.helpers.attention_cases import build_meta, rel_errors, scattered_tables  # noqa: E402
from tests.helpers.kernel_env import DEV, gpu_only, kernel_test  # noqa: E402

TINY = MLAConfig(block_h=16, block_n=16)


def make_case(cached, N, C, Dr, bs, *, dtype=torch.float32, device="cpu", seed=0, spare=3, mb=None):
    """One decode step: sequence i has cached[i] tokens plus one new one. q_rope is a slice of a wider
    query (as the layer passes it) and q_abs a transposed view (as its batched matmul returns it)."""
    g = torch.Generator().manual_seed(seed)
    tables, NB, _ = scattered_tables([n + 1 for n in cached], bs, spare, g)
    T = len(cached)

    def rn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)

    q_abs = rn(N, T, C, scale=0.5).transpose(0, 1)
    q_rope = rn(T, N, 7 + Dr)[..., 7:]
    entries, cache = rn(T, C + Dr), rn(NB, bs, C + Dr)
    meta = build_meta([(n, 1) for n in cached], tables, bs, device, mb=mb)
    return q_abs, q_rope, entries, cache, meta


def check(case, tol, ref_dtype=torch.float64, row_tol=None, scale=None, **kw):
    q_abs, q_rope, entries, cache, meta = case
    scale = scale or (q_abs.shape[-1] // 4 + q_rope.shape[-1]) ** -0.5
    up = lambda t: t.to(ref_dtype)  # noqa: E731
    cache_ref = up(cache)
    want = mla_decode_attention_ref(up(q_abs), up(q_rope), up(entries), cache_ref, meta, scale)
    inputs = [t.clone() for t in (q_abs, q_rope, entries)]
    torch.full((2 * q_abs.numel() + 64,), float("nan"), dtype=q_abs.dtype, device=q_abs.device)  # freed: poison
    got = mla_decode_attention(q_abs, q_rope, entries, cache, meta, scale, **kw)
    assert got.shape == q_abs.shape and got.dtype == q_abs.dtype
    assert all(torch.equal(a, b) for a, b in zip(inputs, (q_abs, q_rope, entries), strict=True)), "inputs written"
    assert torch.equal(up(cache), cache_ref), "cache differs from the twin's write"
    assert not torch.isnan(got).any()
    whole, rows = rel_errors(got, want)
    assert whole <= tol and rows <= (row_tol or tol), (whole, rows)
    return got


@kernel_test
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.float16, 1e-2)])
def test_mixed_lengths_awkward_widths(dtype, tol):
    # 5 heads, C 20 and Dr 8 (padded to 32 / 16 and masked); lengths 1..13 over blocks of 4
    check(make_case([0, 3, 4, 7, 12, 5], 5, 20, 8, 4, dtype=dtype, device=DEV, seed=1), tol, config=TINY)


@kernel_test
@pytest.mark.parametrize("N,C,Dr,bs", [(20, 48, 16, 16), (3, 40, 6, 3), (16, 64, 24, 5)])
def test_head_blocks_widths_block_sizes(N, C, Dr, bs):
    # N 20: two head blocks, the second mostly masked; bs 3 and 5: blocks of odd size
    check(make_case([17, 0, 30], N, C, Dr, bs, device=DEV, seed=N), 1e-4, config=TINY)


@kernel_test
@pytest.mark.parametrize("splits", [1, 3, 4, None])
def test_split_kv(splits):
    # seq_len 1 and 15 leave most splits empty; 69 and 41 are not multiples of the block size
    check(make_case([0, 40, 68, 14], 4, 32, 16, 2, device=DEV, seed=7), 1e-4, config=TINY, num_splits=splits)


@kernel_test
def test_single_sequence_and_length_one():
    check(make_case([0], 2, 16, 16, 16, device=DEV, seed=9), 1e-4, config=TINY)  # T = 1, L = 1, default splits
    check(make_case([150], 6, 24, 8, 16, dtype=torch.float16, device=DEV, seed=10), 1e-2)  # default config
    check(make_case([33], 4, 20, 8, 4, device=DEV, seed=11, mb=12), 1e-4, config=TINY, num_splits=5)  # wide table


@kernel_test
def test_padding_slot_is_not_stored():
    q_abs, q_rope, entries, cache, meta = make_case([6], 2, 16, 8, 4, device=DEV, seed=12)
    want = mla_decode_attention_ref(q_abs.double(), q_rope.double(), entries.double(), cache.double(), meta, 0.25)
    before = cache.clone()
    pad = AttnMetadata(torch.tensor([-1], device=DEV), meta.block_tables, meta.seq_lens, meta.query_start,
                       meta.seqs, meta.max_seq_len, 1)
    mla_decode_attention(q_abs, q_rope, entries, cache, pad, 0.25, config=TINY)
    assert torch.equal(cache, before)
    got = mla_decode_attention(q_abs, q_rope, entries, cache, meta, 0.25, config=TINY)
    assert rel_errors(got, want)[1] <= 1e-4


@kernel_test
def test_zero_tokens():
    q_abs, q_rope, entries, cache, _ = make_case([3], 2, 16, 8, 4, device=DEV, seed=13)
    meta = build_meta([], [], 4, DEV)
    assert mla_decode_attention(q_abs[:0], q_rope[:0], entries[:0], cache, meta, 0.25).shape == (0, 2, 16)


@kernel_test
def test_layer_decode_with_kernel_equals_expanded():
    """MLAttention's absorbed decode with the Triton core (a twin of the layer built with kernel_backend
    "triton", around the torch layer's projections) equals the expanded torch path, LoRA on kv_b_proj in
    slots of different ranks included. The core includes `kernels.mla_rope` (rotations, the latent's RMSNorm,
    the cache store in one launch): the cache is the torch path's up to the norm's fp32 summation order."""
    from tests.helpers.mla import decode_step, mla_layer, run, twin

    layer = mla_layer(seed=4).to(DEV)
    step = decode_step(layer, [0, 3, 4, 7, 12, 5], [0, -1, 1, 2, -1, 0], seed=6, device=DEV)
    want, cache_want = run(layer, step, absorbed=False)
    core = twin(layer, kernel_backend="triton")
    for name, child in layer.named_children():  # its projections and norms stay torch: the Triton core alone
        setattr(core, name, child)
    got, cache_got = run(core, step, absorbed=True)
    torch.testing.assert_close(cache_got, cache_want, rtol=1e-6, atol=1e-6)
    assert (got - want).abs().max() <= 1e-4


def test_validation_errors():
    q_abs, q_rope, entries, cache, meta = make_case([3, 5], 4, 16, 8, 4, seed=14)
    with pytest.raises(ValueError, match="q_rope"):
        mla_decode_attention(q_abs, q_rope.half(), entries, cache, meta, 0.25)
    with pytest.raises(ValueError, match="q_abs"):
        mla_decode_attention(q_abs.double(), q_rope, entries, cache, meta, 0.25)
    with pytest.raises(ValueError, match="entries"):
        mla_decode_attention(q_abs, q_rope, entries[:, :-1], cache, meta, 0.25)
    with pytest.raises(ValueError, match="cache"):
        mla_decode_attention(q_abs, q_rope, entries, cache[..., 1:], meta, 0.25)
    with pytest.raises(ValueError, match="cache"):
        mla_decode_attention(q_abs, q_rope, entries, cache.transpose(0, 1), meta, 0.25)
    with pytest.raises(ValueError, match="latent width"):
        big = torch.randn(2, 4, 1100)
        mla_decode_attention(big, q_rope, torch.randn(2, 1108), torch.randn(3, 4, 1108), meta, 0.25)
    bad = AttnMetadata(meta.slot_mapping.int(), meta.block_tables, meta.seq_lens, meta.query_start, meta.seqs,
                       meta.max_seq_len, 1)
    with pytest.raises(ValueError, match="slot_mapping"):
        mla_decode_attention(q_abs, q_rope, entries, cache, bad, 0.25)
    extend = AttnMetadata(meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.query_start, meta.seqs,
                          meta.max_seq_len, 2)
    with pytest.raises(ValueError, match="decode only"):
        mla_decode_attention(q_abs, q_rope, entries, cache, extend, 0.25)
    with pytest.raises(ValueError, match="num_splits"):
        mla_decode_attention(q_abs, q_rope, entries, cache, meta, 0.25, num_splits=0)
    with pytest.raises(ValueError, match="block_h"):
        MLAConfig(block_h=8)
    assert default_mla_config(128, 512, batch=64).block_h == 64 and default_mla_config(128, 512).block_h == 16
    assert default_mla_config(5, 20, torch.float32) == TINY


# ---------------------------------------------------------------------------------------------
# GPU: DeepSeek sizes, bf16, no host sync, CUDA graph.

LONG = [999, 0, 4095, 17, 1500, 2047, 63, 1000]


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("N", [16, 128])
@pytest.mark.parametrize("splits", [None, 1, 7])
def test_gpu_deepseek_sizes_bf16(N, splits):
    case = make_case(LONG, N, 512, 64, 16, dtype=torch.bfloat16, device="cuda", seed=N + (splits or 0), spare=50)
    q_abs, q_rope, entries, cache, meta = case
    torch.cuda.set_sync_debug_mode("error")
    try:
        mla_decode_attention(q_abs, q_rope, entries, cache.clone(), meta, 192 ** -0.5, num_splits=splits)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    check(case, 1e-2, ref_dtype=torch.float32, row_tol=3e-2, scale=192 ** -0.5, num_splits=splits)


@pytest.mark.gpu
@gpu_only
def test_gpu_cuda_graph_replay_after_in_place_update():
    N, C, Dr, bs, B, mb = 16, 512, 64, 16, 6, 80
    NB = B * mb + 8
    g = torch.Generator().manual_seed(31)
    dev, dt = "cuda", torch.bfloat16
    cache = torch.randn(NB, bs, C + Dr, generator=g).to(dt).to(dev)

    def step(lens, seed):
        gg = torch.Generator().manual_seed(seed)
        perm = torch.randperm(NB, generator=gg).tolist()
        tables = [perm[i * mb:i * mb + -(-n // bs)] for i, n in enumerate(lens)]
        meta = build_meta([(n - 1, 1) for n in lens], tables, bs, dev, mb=mb)
        ins = [torch.randn(*shape, generator=gg).to(dt).to(dev) for shape in ((B, N, C), (B, N, Dr), (B, C + Dr))]
        return ins, meta

    (q_abs, q_rope, entries), meta = step([5, 100, 1, 700, 16, 33], 1)
    scale = 192 ** -0.5
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        mla_decode_attention(q_abs, q_rope, entries, cache, meta, scale)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mla_decode_attention(q_abs, q_rope, entries, cache, meta, scale)
    for lens, seed in (([1200, 3, 64, 17, 999, 1270], 2), ([1, 1, 2, 1, 1, 1], 3)):
        (q2, r2, e2), m2 = step(lens, seed)
        for dst, src in ((q_abs, q2), (q_rope, r2), (entries, e2), (meta.slot_mapping, m2.slot_mapping),
                         (meta.block_tables, m2.block_tables), (meta.seq_lens, m2.seq_lens),
                         (meta.query_start, m2.query_start)):
            dst.copy_(src)
        graph.replay()
        ref_cache = cache.float()  # already holds the new entries; the twin rewrites the same values
        want = mla_decode_attention_ref(q_abs.float(), q_rope.float(), entries.float(), ref_cache, m2, scale)
        assert torch.equal(cache.float(), ref_cache)
        whole, rows = rel_errors(out, want)
        assert whole <= 1e-2 and rows <= 3e-2, (lens, whole, rows)
        assert torch.equal(out, mla_decode_attention(q_abs, q_rope, entries, cache, m2, scale))
