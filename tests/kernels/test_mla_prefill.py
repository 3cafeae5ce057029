"""`mla_prefill_attention` (MLA prefill in one launch) against causal attention written out in float64: under the
interpreter at awkward widths, sequences with and without a cached prefix, one-row sequences, context rows out of
sequence order; on the GPU at DeepSeek's widths in bf16. And the MLA layer's whole prefill on the Triton backend
against the torch backend's, fresh and after cached prefixes."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.interp  # `make test` runs it with TRITON_INTERPRET=1 (set before triton is imported)
triton = pytest.importorskip("triton")

from moelora.kernels.attention import AttentionConfig  # noqa: E402
from moelora.kernels.mla_prefill import mla_prefill_attention  # noqa: E402
from tests.helpers.attention_cases import rel_errors  # noqa: E402
from tests.helpers.kernel_env import DEV, gpu_only, interp_only, kernel_test  # noqa: E402


def make_case(spec, order, N, nope, rope, v_dim, dtype, device, seed):
    """spec [(cached, q_len)] a sequence; `order`: the sequences' order in the context rows (each sequence's rows
    contiguous, 3 unused rows between them). q [T, N, nope + rope]; kv a column view of wider rows [L, N, nope +
    v_dim]; k_rope a column slice of the latents' rows [L, rope], as the layer hands them."""
    g = torch.Generator().manual_seed(seed)
    starts, row = [0] * len(spec), 3
    for b in order:
        starts[b] = row
        row += sum(spec[b]) + 3
    T = sum(n for _, n in spec)
    q = torch.randn(T, N, nope + rope, generator=g)
    kv = torch.randn(row, N, nope + v_dim + 5, generator=g)[..., :nope + v_dim]
    k_rope = torch.randn(row, 9 + rope, generator=g)[:, 9:]
    qs = [0]
    for _, n in spec:
        qs.append(qs[-1] + n)
    i32 = dict(dtype=torch.int32, device=device)
    meta = (torch.tensor([c + n for c, n in spec], **i32), torch.tensor(qs, **i32), torch.tensor(starts, **i32))
    return [t.to(dtype).to(device) for t in (q, kv, k_rope)], meta, starts


def reference(q, kv, k_rope, spec, starts, nope, scale):
    """Each sequence's query rows over its context rows 0 .. position, in float64."""
    T, N, _ = q.shape
    out = torch.zeros(T, N, kv.shape[2] - nope, dtype=torch.float64)
    q, kv, k_rope = q.double().cpu(), kv.double().cpu(), k_rope.double().cpu()
    q0 = 0
    for (ctx, n), k0 in zip(spec, starts, strict=True):
        L = ctx + n
        keys = torch.cat((kv[k0:k0 + L, :, :nope], k_rope[k0:k0 + L, None].expand(-1, N, -1)), dim=-1)
        s = torch.einsum("ind,lnd->nil", q[q0:q0 + n], keys) * scale
        visible = torch.arange(L)[None, :] <= (ctx + torch.arange(n))[:, None]
        p = s.masked_fill(~visible, float("-inf")).softmax(-1)
        out[q0:q0 + n] = torch.einsum("nil,lnd->ind", p, kv[k0:k0 + L, :, nope:])
        q0 += n
    return out


def run(case, spec, nope, scale=0.3, config=None):
    (q, kv, k_rope), (seq_lens, qstart, kvstart), starts = case
    before = [t.clone() for t in (q, kv, k_rope)]
    got = mla_prefill_attention(q, kv, k_rope, seq_lens, qstart, kvstart, nope, scale,
                                max([n for _, n in spec] + [0]), config)
    assert all(torch.equal(a, b) for a, b in zip((q, kv, k_rope), before, strict=True))  # inputs only read
    return got, reference(q, kv, k_rope, spec, starts, nope, scale)


# fresh prompts longer than a tile (both loops), extends with a cached prefix (30: the first tile's last key
# block without a mask ends one key before its first row's position, at 16- and 32-key blocks), a one-row
# (decode-like) sequence
MIXED = [(0, 37), (21, 5), (0, 1), (40, 19), (30, 20), (6, 1)]


@kernel_test
@pytest.mark.parametrize("N,nope,rope,v_dim", [(3, 12, 8, 10), (2, 16, 5, 16), (1, 8, 16, 24)])
@pytest.mark.parametrize("order", ["step", "reversed"])
def test_mixed_sequences_equal_float64(N, nope, rope, v_dim, order):
    perm = list(range(len(MIXED))) if order == "step" else list(reversed(range(len(MIXED))))
    case = make_case(MIXED, perm, N, nope, rope, v_dim, torch.float32, DEV, seed=N * 7 + nope)
    got, want = run(case, MIXED, nope)
    assert got.shape == (sum(n for _, n in MIXED), N, v_dim)
    whole, rows = rel_errors(got.cpu(), want)
    assert whole <= 1e-5 and rows <= 1e-5, (whole, rows)


@kernel_test
@pytest.mark.parametrize("block_m,block_n", [(16, 32), (32, 16), (64, 64)])
def test_tiles_other_than_the_default(block_m, block_n):
    """Tiles wider than a sequence, narrower than the keys of one tile, and the bf16 default's shape."""
    case = make_case(MIXED, range(len(MIXED)), 2, 8, 8, 8, torch.float32, DEV, seed=block_m + block_n)
    got, want = run(case, MIXED, 8, config=AttentionConfig(block_m, block_n))
    whole, rows = rel_errors(got.cpu(), want)
    assert whole <= 1e-5 and rows <= 1e-5, (whole, rows)


@kernel_test
def test_fp16_within_half_precision():
    case = make_case(MIXED, range(len(MIXED)), 2, 16, 8, 16, torch.float16, DEV, seed=5)
    got, want = run(case, MIXED, 16)
    whole, rows = rel_errors(got.cpu(), want)
    assert whole <= 1e-2 and rows <= 3e-2, (whole, rows)


@kernel_test
def test_no_rows():
    case = make_case([(4, 0)], [0], 2, 8, 8, 8, torch.float32, DEV, seed=0)
    got, _ = run(case, [(4, 0)], 8)
    assert got.shape == (0, 2, 8)


def test_refusals():
    (q, kv, k_rope), (seq_lens, qstart, kvstart), _ = make_case([(0, 3)], [0], 2, 8, 4, 8, torch.float32, "cpu", 0)
    call = dict(q=q, kv=kv, k_rope=k_rope, seq_lens=seq_lens, query_start=qstart, kv_start=kvstart, nope=8,
                scale=1.0, max_query_len=3)
    for change, match in ((dict(nope=12), "nope=12 must be"), (dict(kv=kv.half()), "kv must be"),
                          (dict(kv=kv[:, :1]), "kv must be"), (dict(k_rope=k_rope[:, :3]), "k_rope must be"),
                          (dict(k_rope=k_rope[:2]), "k_rope must be"), (dict(q=q.transpose(1, 2)), "q must be"),
                          (dict(query_start=qstart[:1]), r"query_start must be \[2\]"),
                          (dict(kv_start=kvstart.long()), "kv_start must be"),
                          (dict(seq_lens=seq_lens[None]), "seq_lens must be")):
        with pytest.raises(ValueError, match=match):
            mla_prefill_attention(**dict(call, **change))


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("N", [16, 128], ids=["dsv2_lite", "dsv3"])
def test_gpu_deepseek_widths_bf16(N):
    """Dn 128, Dr 64, Dv 128 in bf16 against float64: two 2048-token prompts (the default's 128-row tiles), an
    extend over a 1500-token prefix and two decode-like rows; DeepSeek-V3's 128 heads on shorter prompts."""
    spec = [(0, 2048), (1500, 300), (0, 1), (0, 2048), (700, 1)] if N == 16 else [(0, 600), (300, 200), (0, 1)]
    case = make_case(spec, list(reversed(range(len(spec)))), N, 128, 64, 128, torch.bfloat16, "cuda", seed=N)
    got, want = run(case, spec, 128, scale=192 ** -0.5)
    whole, rows = rel_errors(got.float().cpu(), want)
    assert whole <= 1e-2 and rows <= 3e-2, (whole, rows)


@interp_only  # the projections' fp32 dots run in TF32 on CUDA
@pytest.mark.parametrize("cached,q_lens,slots", [([0, 0, 0], [9, 23, 1], [0, -1, 2]),
                                                 ([0, 7, 30, 4], [17, 5, 21, 1], [1, 0, -1, 2])],
                         ids=["fresh", "extends"])
@pytest.mark.parametrize("attention", ["mla_prefill", "keys_sdpa"])
def test_layer_prefill_on_the_kernel_equals_torch_backend(cached, q_lens, slots, attention, monkeypatch):
    """MLAttention's expanded prefill on the Triton backend (a twin of the layer: its projections' kernels,
    `mla_rope`'s store, its attention: this kernel, or, past `MLA_PREFILL_KERNEL_MAX_Q`, `mla_keys` and SDPA a
    sequence) equals the torch backend's (SDPA a sequence): fresh prompts (the context is the step's rows) and
    extends after cached prefixes (gathered from the cache, sequence after sequence), with LoRA in slots of
    different ranks and rows on none."""
    import moelora.kernels.mla_prefill as kernel
    from moelora.layers import mla
    from tests.helpers.mla import extend_step, mla_layer, run, twin

    real, calls = kernel.mla_prefill_attention, []
    monkeypatch.setattr(kernel, "mla_prefill_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    if attention == "keys_sdpa":
        monkeypatch.setattr(mla, "MLA_PREFILL_KERNEL_MAX_Q", 0)

    layer = mla_layer(seed=8).to(DEV)
    step = extend_step(layer, cached, q_lens, slots, seed=9, device=DEV)
    want, cache_want = run(layer, step, absorbed=False)
    got, cache_got = run(twin(layer, kernel_backend="triton"), step, absorbed=False)
    torch.testing.assert_close(cache_got, cache_want, rtol=1e-5, atol=1e-5)
    assert (got - want).abs().max() <= 1e-4 * max(1.0, want.abs().max().item())
    assert bool(calls) == (attention == "mla_prefill")
