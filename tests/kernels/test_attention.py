"""paged_attention (Triton store + prefill/extend or split-KV decode) vs paged_attention_ref.

Interpreter tests (tiny, fp16/fp32) run when TRITON_INTERPRET=1 or on CUDA; `gpu` tests run real
shapes in bf16 against an fp32 reference (relative error <= 1e-2), and the decode path under a
CUDA graph replayed after the metadata tensors are updated in place.
Every case uses shuffled (non-contiguous) block ids, random cache contents everywhere (so a read
of a wrong block or slot shows), and block-table padding that points at a random-filled block.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytestmark = pytest.mark.interp  # `make test` runs it with TRITON_INTERPRET=1 (set before triton is imported)
triton = pytest.importorskip("triton")

from moelora.kernels.attention import AttentionConfig, default_num_splits, paged_attention  # noqa: E402
from moelora.kernels.reference import paged_attention_ref  # noqa: E402
from moelora.layers.attention import AttnMetadata  # noqa: E402
from tests.helpers.attention_cases import build_meta, rel_errors, scattered_tables  # noqa: E402
from tests.helpers.kernel_env import CUDA, DEV, INTERP, gpu_only, kernel_test  # noqa: E402,F401

TINY = AttentionConfig(block_m=16, block_n=16)


def make_case(spec, N, n_kv, D, bs, *, dtype=torch.float32, device="cpu", seed=0, spare=3, q_view=False):
    g = torch.Generator().manual_seed(seed)
    tables, NB, _ = scattered_tables([c + n for c, n in spec], bs, spare, g)
    T = sum(n for _, n in spec)

    def rn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)

    q = rn(T, N + 3 if q_view else N, D, scale=1.5)[:, :N]  # q_view: a strided slice of a wider buffer
    k, v = rn(T, n_kv, D), rn(T, n_kv, D)
    k_cache, v_cache = rn(NB, bs, n_kv, D), rn(NB, bs, n_kv, D)
    return q, k, v, k_cache, v_cache, build_meta(spec, tables, bs, device)


def check(case, tol, ref_dtype=torch.float64, row_tol=None, **kw):
    q, k, v, k_cache, v_cache, meta = case
    D = q.shape[-1]
    up = lambda t: t.to(ref_dtype)  # noqa: E731
    kc_ref, vc_ref = up(k_cache), up(v_cache)
    want = paged_attention_ref(up(q), up(k), up(v), kc_ref, vc_ref, meta, D ** -0.5)
    inputs = [t.clone() for t in (q, k, v)]
    torch.full((2 * q.numel() + 64,), float("nan"), dtype=q.dtype, device=q.device)  # freed: poisons the pool
    got = paged_attention(q, k, v, k_cache, v_cache, meta, D ** -0.5, **kw)
    assert got.shape == q.shape and got.dtype == q.dtype
    assert all(torch.equal(a, b) for a, b in zip(inputs, (q, k, v), strict=True)), "inputs were written"
    assert torch.equal(up(k_cache), kc_ref) and torch.equal(up(v_cache), vc_ref), "caches differ from write_kv_ref"
    assert not torch.isnan(got).any()
    whole, rows = rel_errors(got, want)
    assert whole <= tol and rows <= (row_tol or tol), (whole, rows)
    return got


@kernel_test
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.float16, 1e-2)])
def test_mixed_prefill_extend_decode_step(dtype, tol):
    # fresh prefill, single-token decode, extend over a cached prefix spanning q tiles, 3/2 heads
    spec = [(0, 7), (5, 1), (13, 20), (3, 1), (0, 1)]
    check(make_case(spec, 6, 3, 48, 4, dtype=dtype, device=DEV, seed=1), tol, config=TINY)


@kernel_test
@pytest.mark.parametrize("group,D,bs", [(1, 32, 16), (2, 16, 3), (4, 64, 16)])
def test_gqa_groups_block_sizes(group, D, bs):
    spec = [(9, 18), (0, 5), (21, 2)]
    check(make_case(spec, 2 * group, 2, D, bs, device=DEV, seed=group, q_view=True), 1e-4, config=TINY)


@kernel_test
@pytest.mark.parametrize("splits", [1, 3, 4, None])
def test_decode_split_kv(splits):
    # seq_len 1 and 15 leave most splits empty; 69 and 40 are not multiples of the block size
    spec = [(0, 1), (40, 1), (68, 1), (14, 1)]
    check(make_case(spec, 4, 2, 24, 2, device=DEV, seed=7), 1e-4, config=TINY, num_splits=splits)


@kernel_test
def test_longer_context_decode_and_extend():
    # decode: default splits (16 for B * N_kv = 2) over 300 keys; extend: several unmasked key tiles
    check(make_case([(299, 1), (150, 1)], 4, 1, 32, 16, device=DEV, seed=5), 1e-4, config=TINY)
    check(make_case([(100, 40)], 2, 1, 32, 16, dtype=torch.float16, device=DEV, seed=6), 1e-2, config=TINY)


@kernel_test
def test_decode_fp16_gqa4_and_single_token():
    check(make_case([(33, 1), (50, 1)], 8, 2, 32, 16, dtype=torch.float16, device=DEV, seed=8), 1e-2,
          config=TINY, num_splits=2)
    check(make_case([(0, 1)], 3, 1, 16, 16, device=DEV, seed=9), 1e-4, config=TINY)  # T = 1, default splits
    case = make_case([(5, 1)], 2, 2, 16, 4, device=DEV, seed=10)  # one token through the prefill kernel:
    check(case[:5] + (replace(case[5], max_query_len=2),), 1e-4, config=TINY)  # max_query_len may overestimate


@kernel_test
def test_padding_slot_is_not_stored():
    q, k, v, kc, vc, meta = make_case([(6, 1)], 2, 1, 16, 4, device=DEV, seed=11)
    want = paged_attention_ref(q.double(), k.double(), v.double(), kc.double(), vc.double(), meta, 0.25)
    kc0, vc0 = kc.clone(), vc.clone()
    pad = AttnMetadata(torch.tensor([-1], device=DEV), meta.block_tables, meta.seq_lens, meta.query_start,
                       meta.seqs, meta.max_seq_len, 1)
    paged_attention(q, k, v, kc, vc, pad, 0.25, config=TINY)
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0)
    got = paged_attention(q, k, v, kc, vc, meta, 0.25, config=TINY)
    assert rel_errors(got, want)[1] <= 1e-4


@kernel_test
@pytest.mark.parametrize("spec", [[(6, 1), (0, 1), (9, 1)], [(0, 5), (4, 3)]], ids=["decode", "prefill"])
def test_kv_stored_reads_the_cache_as_written(spec):
    """`kv_stored=True` (`qk_norm_rope` wrote k / v into the cache): no store launch, k and v unread (None), and
    the same output as the call that stores them itself, bit for bit."""
    q, k, v, kc, vc, meta = make_case(spec, 4, 2, 16, 4, device=DEV, seed=13)
    kc2, vc2 = kc.clone(), vc.clone()
    want = paged_attention(q, k, v, kc, vc, meta, 0.25, config=TINY)
    flat = lambda c: c.view(-1, *c.shape[2:])  # noqa: E731
    flat(kc2)[meta.slot_mapping] = k  # what the store kernel writes (every slot here is >= 0)
    flat(vc2)[meta.slot_mapping] = v
    assert torch.equal(kc2, kc) and torch.equal(vc2, vc)
    got = paged_attention(q, None, None, kc2, vc2, meta, 0.25, config=TINY, kv_stored=True)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="k must be"):
        paged_attention(q, None, None, kc2, vc2, meta, 0.25, config=TINY)


@kernel_test
def test_zero_tokens():
    q, k, v, kc, vc, _ = make_case([(3, 1)], 2, 1, 16, 4, device=DEV, seed=12)
    meta = build_meta([], [], 4, DEV)
    assert meta.block_tables.shape == (0, 1)
    assert paged_attention(q[:0], k[:0], v[:0], kc, vc, meta, 0.25).shape == (0, 2, 16)


def test_validation_errors():
    q, k, v, kc, vc, meta = make_case([(3, 2)], 4, 2, 16, 4, seed=13)
    bad_meta = AttnMetadata(meta.slot_mapping.int(), meta.block_tables, meta.seq_lens, meta.query_start,
                            meta.seqs, meta.max_seq_len, meta.max_query_len)
    with pytest.raises(ValueError, match="slot_mapping"):
        paged_attention(q, k, v, kc, vc, bad_meta, 0.25)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        paged_attention(q[:, :3], k, v, kc, vc, meta, 0.25)
    with pytest.raises(ValueError, match="k must be"):
        paged_attention(q, k.half(), v, kc, vc, meta, 0.25)
    with pytest.raises(ValueError, match="v_cache"):
        paged_attention(q, k, v, kc, vc[:, :2], meta, 0.25)
    with pytest.raises(ValueError, match="k_cache"):
        paged_attention(q, k, v, kc.transpose(1, 2), vc, meta, 0.25)
    with pytest.raises(ValueError, match="k_cache"):
        paged_attention(q, k, v, kc.half(), vc.half(), meta, 0.25)
    with pytest.raises(ValueError, match="head_dim"):
        paged_attention(*(torch.randn(*t.shape[:-1], 300) for t in (q, k, v)), kc, vc, meta, 0.25)
    with pytest.raises(ValueError, match="num_splits"):
        paged_attention(q, k, v, kc, vc, meta, 0.25, num_splits=0)
    with pytest.raises(ValueError, match="block_m"):
        AttentionConfig(block_m=24)
    assert default_num_splits(1, 8) == 16 and default_num_splits(64, 8) == 1


# ---------------------------------------------------------------------------------------------
# GPU: real shapes, bf16, no host sync, CUDA graph.


def _no_sync_call(case, **kw):
    q, k, v, kc, vc, meta = case
    torch.cuda.set_sync_debug_mode("error")
    try:
        return paged_attention(q, k, v, kc.clone(), vc.clone(), meta, q.shape[-1] ** -0.5, **kw)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("N,n_kv,D,max_q", [(32, 8, 128, 512), (16, 16, 64, 512), (12, 4, 96, 512),
                                           (32, 8, 128, 100), (8, 2, 256, 300), (16, 8, 64, 20)])
def test_gpu_prefill_extend_bf16(N, n_kv, D, max_q):
    # max_q picks the default tile config (BLOCK_M 128 / 64 / 16); D 96 and 256 take the padded / narrow paths
    spec = [(0, 300), (700, 1), (1000, 77), (31, 200), (0, 1), (500, 512), (15, 17)]
    spec = [(c, min(n, max_q)) for c, n in spec]
    case = make_case(spec, N, n_kv, D, 16, dtype=torch.bfloat16, device="cuda", seed=N + D, spare=40)
    _no_sync_call(case)
    check(case, 1e-2, ref_dtype=torch.float32, row_tol=3e-2)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("splits", [None, 1, 7])
def test_gpu_decode_long_context_bf16(splits):
    spec = [(999, 1), (0, 1), (4095, 1), (17, 1), (1500, 1), (2047, 1), (63, 1), (1000, 1)]
    case = make_case(spec, 32, 8, 128, 16, dtype=torch.bfloat16, device="cuda", seed=21, spare=50)
    _no_sync_call(case, num_splits=splits)
    check(case, 1e-2, ref_dtype=torch.float32, row_tol=3e-2, num_splits=splits)


@pytest.mark.gpu
@gpu_only
def test_gpu_decode_cuda_graph_replay_after_in_place_update():
    N, n_kv, D, bs, B, mb = 16, 4, 128, 16, 6, 80
    NB = B * mb + 8
    g = torch.Generator().manual_seed(31)
    dev, dt = "cuda", torch.bfloat16
    kc = torch.randn(NB, bs, n_kv, D, generator=g).to(dt).to(dev)
    vc = torch.randn(NB, bs, n_kv, D, generator=g).to(dt).to(dev)

    def step(lens, seed):
        gg = torch.Generator().manual_seed(seed)
        perm = torch.randperm(NB, generator=gg).tolist()
        tables = [perm[i * mb:i * mb + -(-n // bs)] for i, n in enumerate(lens)]
        meta = build_meta([(n - 1, 1) for n in lens], tables, bs, dev, mb=mb)
        qkv = [torch.randn(B, h, D, generator=gg).to(dt).to(dev) for h in (N, n_kv, n_kv)]
        return qkv, meta

    (q, k, v), meta = step([5, 100, 1, 700, 16, 33], 1)
    scale = D ** -0.5
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        paged_attention(q, k, v, kc, vc, meta, scale)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention(q, k, v, kc, vc, meta, scale)
    for lens, seed in (([1200, 3, 64, 17, 999, 1270], 2), ([1, 1, 2, 1, 1, 1], 3)):
        (q2, k2, v2), m2 = step(lens, seed)
        for dst, src in ((q, q2), (k, k2), (v, v2), (meta.slot_mapping, m2.slot_mapping),
                         (meta.block_tables, m2.block_tables), (meta.seq_lens, m2.seq_lens),
                         (meta.query_start, m2.query_start)):
            dst.copy_(src)
        graph.replay()
        kcf, vcf = kc.float(), vc.float()  # already hold the new k/v; the reference rewrites the same values
        want = paged_attention_ref(q.float(), k.float(), v.float(), kcf, vcf, m2, scale)
        assert torch.equal(kc.float(), kcf) and torch.equal(vc.float(), vcf)
        whole, rows = rel_errors(out, want)
        assert whole <= 1e-2 and rows <= 3e-2, (lens, whole, rows)
        eager = paged_attention(q, k, v, kc, vc, m2, scale)
        assert torch.equal(out, eager)


@kernel_test
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_writes_the_o_projections_fp8_rows(splits):
    """`paged_attention_fp8` on a decode step with D = 128: paged_attention's output, and its rows [T, N * D]
    quantized bit for bit as `per_token_group_quant` quantizes them (a group a head), by the writer (one split)
    or by the reduce (three); a prefill step, or D != 128, gives None (the projection quantizes)."""
    from moelora.kernels.attention import paged_attention_fp8
    from moelora.kernels.fp8_quant import per_token_group_quant

    def run(case, fn):
        q, k, v, kc, vc, meta = case
        return fn(q, k, v, kc.clone(), vc.clone(), meta, q.shape[-1] ** -0.5, config=TINY, num_splits=splits)

    case = make_case([(0, 1), (40, 1), (13, 1)], 4, 2, 128, 16, dtype=torch.float16, device=DEV, seed=3)
    out, rows = run(case, paged_attention_fp8)
    assert torch.equal(out, run(case, paged_attention))
    q8, s8 = per_token_group_quant(out.reshape(3, -1))
    assert torch.equal(rows.s, s8) and torch.equal(rows.q.view(torch.uint8), q8.view(torch.uint8))
    assert run(make_case([(0, 5), (3, 1)], 4, 2, 128, 16, device=DEV, seed=4), paged_attention_fp8)[1] is None
    assert run(make_case([(5, 1)], 2, 1, 64, 16, device=DEV, seed=5), paged_attention_fp8)[1] is None
