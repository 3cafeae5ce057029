"""The small fused kernels vs their torch twins: rms_norm / add_rms_norm, qk_norm_rope, softmax_topk,
silu_mul (shape legend: T tokens, D width, Nq / Nk heads, Dr rotary dims, E experts, K top-k, I inter).

Interpreter tests (tiny, fp16/fp32) run when TRITON_INTERPRET=1 or on CUDA: fresh random inputs,
strided input views, outputs poisoned with NaN (through `out=`) and inputs checked unchanged,
awkward sizes (non-power-of-two widths, T = 0 and 1, partial rotary, odd head counts). The twins
are also checked bit-exact against the layers' torch paths they stand for. `gpu` tests run
Qwen3-30B-A3B shapes in bf16 against an fp32 reference (relative error <= 1e-2) and all four ops in
one CUDA graph under sync-debug mode.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.interp  # `make test` runs it with TRITON_INTERPRET=1 (set before triton is imported)
triton = pytest.importorskip("triton")

from moelora.kernels.norm import add_rms_norm, rms_norm  # noqa: E402
from moelora.kernels.reference import add_rms_norm_ref, qk_norm_rope_ref, rms_norm_ref, silu_mul_ref, softmax_topk_ref  # noqa: E402
from moelora.kernels.rotary import qk_norm_rope  # noqa: E402
from moelora.kernels.silu_mul import silu_mul  # noqa: E402
from moelora.kernels.softmax_topk import softmax_topk  # noqa: E402
from moelora.layers.norm import RMSNorm  # noqa: E402
from moelora.layers.rotary import RotaryEmbedding, apply_rotary  # noqa: E402
from moelora.layers.router import softmax_topk as router_softmax_topk  # noqa: E402
from tests.helpers.kernel_env import DEV, gpu_only, kernel_test  # noqa: E402

# Tolerances against the twin: fp32 only differs in summation order / rsqrt; fp16 rounds at the same
# places as the twin, so at most an ulp or two apart (fp16 ulp at 1 is ~1e-3).
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3)}
DTYPES = [torch.float32, torch.float16]


def rand(*shape, dtype=torch.float32, device=DEV, seed=0, scale=1.0, wide=0):
    """Random [..., n] tensor; wide > 0 returns a view of a [..., n + wide] buffer (a strided row)."""
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(*shape[:-1], shape[-1] + wide, generator=g) * scale
    return full.to(dtype).to(device)[..., :shape[-1]]


def poisoned(*shape, dtype, device=DEV):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def near_one(n, seed):  # a norm weight: fp32, near 1, every element different
    return (1.0 + 0.2 * torch.randn(n, generator=torch.Generator().manual_seed(seed))).to(DEV)


def unchanged(*pairs):
    return all(torch.equal(a, b) for a, b in pairs)


# ---- rms_norm / add_rms_norm ----------------------------------------------------------------------

@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,D,wide", [(7, 48, 0), (5, 100, 3), (1, 300, 0), (3, 1, 2), (0, 24, 0)])
def test_rms_norm(dtype, T, D, wide):
    x, w = rand(T, D, dtype=dtype, seed=T + D, scale=3.0, wide=wide), near_one(D, D)
    x0 = x.clone()
    out = poisoned(T, D, dtype=dtype)
    got = rms_norm(x, w, 1e-6, out=out)
    assert got is out and unchanged((x, x0))
    torch.testing.assert_close(got, rms_norm_ref(x, w, 1e-6), **TOL[dtype])
    torch.testing.assert_close(rms_norm(x, w, 1e-6), got, rtol=0, atol=0)  # a fresh output: same values


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,D,wide", [(9, 48, 0), (4, 72, 5), (1, 130, 0), (0, 16, 0)])
def test_add_rms_norm(dtype, T, D, wide):
    x = rand(T, D, dtype=dtype, seed=1, scale=2.0, wide=wide)
    delta, w = rand(T, D, dtype=dtype, seed=2, scale=0.5, wide=2 * wide), near_one(D, 3)
    x0, d0 = x.clone(), delta.clone()
    out = (poisoned(T, D, dtype=dtype), poisoned(T, D, dtype=dtype))
    h, y = add_rms_norm(x, delta, w, 1e-5, out=out)
    assert h is out[0] and y is out[1] and unchanged((x, x0), (delta, d0))
    h_ref, y_ref = add_rms_norm_ref(x, delta, w, 1e-5)
    assert torch.equal(h, h_ref)  # one rounding of an exact fp32 sum, as torch's add
    torch.testing.assert_close(y, y_ref, **TOL[dtype])


@kernel_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("T,D,wide", [(9, 48, 0), (3, 130, 4), (0, 16, 0)])
def test_add_rms_norm_with_two_deltas_rounds_their_sum_first(dtype, T, D, wide):
    """delta2 (an MoE block's routed and shared outputs, added by the next norm): h and y equal the one-delta launch
    on torch's d + d2 (the inner sum rounded to the dtype first), and h torch's x + (d + d2). The inputs are scaled
    so that adding the three in fp32 and rounding once differs from that (checked): a kernel skipping the inner
    rounding fails."""
    x = rand(T, D, dtype=dtype, seed=4, scale=4.0, wide=wide)
    d = rand(T, D, dtype=dtype, seed=5, scale=1.0, wide=wide)
    d2 = rand(T, D, dtype=dtype, seed=6, scale=1e-2)
    w = near_one(D, 7)
    x0, d0, d20 = x.clone(), d.clone(), d2.clone()
    out = (poisoned(T, D, dtype=dtype), poisoned(T, D, dtype=dtype))
    h, y = add_rms_norm(x, d, w, 1e-5, out=out, delta2=d2)
    assert h is out[0] and y is out[1] and unchanged((x, x0), (d, d0), (d2, d20))
    settled = d + d2
    h1, y1 = add_rms_norm(x, settled, w, 1e-5)  # the one-delta kernel on torch's rounded sum
    assert torch.equal(h, h1) and torch.equal(y, y1)
    if dtype != torch.bfloat16 or DEV == "cuda":  # the interpreter's bf16 casts do not round to nearest
        assert torch.equal(h, x + settled)
    if dtype != torch.float32 and T:  # the inner rounding matters on these inputs
        assert not torch.equal(x + settled, (x.float() + d.float() + d2.float()).to(dtype))


@kernel_test
def test_norm_launchers_reject_bad_arguments():
    x, w = rand(4, 8), near_one(8, 0)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, near_one(9, 0), 1e-6)
    with pytest.raises(ValueError, match="delta"):
        add_rms_norm(x, rand(4, 8, dtype=torch.float16), w, 1e-6)
    with pytest.raises(ValueError, match="delta2"):
        add_rms_norm(x, x.clone(), w, 1e-6, delta2=rand(4, 9))
    with pytest.raises(ValueError, match="storage"):
        rms_norm(x, w, 1e-6, out=x)  # contract 2: never into an input
    with pytest.raises(ValueError, match="unit stride"):
        rms_norm(rand(8, 4).t(), near_one(8, 0), 1e-6)


# ---- qk_norm_rope -------------------------------------------------------------------------------------

def rope_case(T, NQ, NK, D, DR, dtype, seed, wide=0):
    """q, k as head views of projection outputs ([T, N*D (+ wide)]), cos/sin of random positions."""
    q = rand(T, NQ * D, dtype=dtype, seed=seed, scale=2.0, wide=wide)
    k = rand(T, NK * D, dtype=dtype, seed=seed + 1, scale=2.0, wide=wide)
    q, k = q.unflatten(1, (NQ, D)), k.unflatten(1, (NK, D))
    positions = torch.randint(0, 4096, (T,), generator=torch.Generator().manual_seed(seed)).to(DEV)
    cos, sin = RotaryEmbedding(DR, 10000.0).to(DEV)(positions)
    return q, k, cos, sin


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,NQ,NK,D,DR,norm,wide", [
    (5, 4, 2, 16, 16, True, 0),  # Qwen3: per-head norm, full rotary
    (3, 6, 3, 24, 12, True, 7),  # GLM: per-head norm, partial rotary, strided rows
    (4, 5, 1, 20, 8, False, 0),  # no norm, partial, non-power-of-two D
    (1, 3, 3, 32, 32, False, 0),  # one token, MHA
    (0, 4, 2, 16, 16, True, 0)])
def test_qk_norm_rope(dtype, T, NQ, NK, D, DR, norm, wide):
    q, k, cos, sin = rope_case(T, NQ, NK, D, DR, dtype, seed=T * 10 + D, wide=wide)
    qw, kw = (near_one(D, 1), near_one(D, 2)) if norm else (None, None)
    q0, k0 = q.clone(), k.clone()
    out = (poisoned(T, NQ, D, dtype=dtype), poisoned(T, NK, D, dtype=dtype))
    gq, gk = qk_norm_rope(q, k, cos, sin, qw, kw, 1e-6, out=out)
    assert gq is out[0] and gk is out[1] and unchanged((q, q0), (k, k0))
    wq, wk = qk_norm_rope_ref(q, k, cos, sin, qw, kw, 1e-6)
    torch.testing.assert_close(gq, wq, **TOL[dtype])
    torch.testing.assert_close(gk, wk, **TOL[dtype])
    if not norm:  # without the norm's rsqrt every rounding matches torch's: bit-exact
        assert torch.equal(gq, wq) and torch.equal(gk, wk)


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,NQ,NK,D,DR,norm,wide", [
    (5, 4, 2, 16, 16, True, 0), (3, 6, 3, 24, 12, True, 7), (4, 5, 1, 20, 8, False, 0), (0, 4, 2, 16, 16, True, 0)])
def test_qk_norm_rope_into_the_cache_equals_rope_then_store(dtype, T, NQ, NK, D, DR, norm, wide):
    """`kv_store`: the rotated k and v land in the paged cache at each token's slot, bit for bit the k_out and v
    the unfused path would store there; a slot < 0 stores nothing; every other cache row keeps its bits."""
    from moelora.kernels.rotary import KVStore

    q, k, cos, sin = rope_case(T, NQ, NK, D, DR, dtype, seed=T * 10 + D, wide=wide)
    v = rand(T, NK * D, dtype=dtype, seed=T + 77, wide=wide).unflatten(1, (NK, D))
    qw, kw = (near_one(D, 1), near_one(D, 2)) if norm else (None, None)
    NB, BS = 3, 4
    k_cache = rand(NB, BS, NK, D, dtype=dtype, seed=5)
    v_cache = rand(NB, BS, NK, D, dtype=dtype, seed=6)
    slots = torch.tensor([7, -1, 0, 11, 5][:T], dtype=torch.int64, device=DEV)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    wq, wk = qk_norm_rope(q, k, cos, sin, qw, kw, 1e-6)  # the unfused path: rope, then the store kernel's copy
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            want_k.view(NB * BS, NK, D)[slot] = wk[t]
            want_v.view(NB * BS, NK, D)[slot] = v[t]
    q0, k0, v0 = q.clone(), k.clone(), v.clone()
    gq, gk = qk_norm_rope(q, k, cos, sin, qw, kw, 1e-6, kv_store=KVStore(v, k_cache, v_cache, slots))
    assert gk is None and unchanged((q, q0), (k, k0), (v, v0))
    assert torch.equal(gq, wq)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


@kernel_test
def test_qk_norm_rope_rejects_bad_arguments():
    q, k, cos, sin = rope_case(2, 2, 1, 16, 16, torch.float32, 0)
    with pytest.raises(ValueError, match="both"):
        qk_norm_rope(q, k, cos, sin, near_one(16, 0), None, 1e-6)
    with pytest.raises(ValueError, match="Dr"):
        qk_norm_rope(q, k, cos[:, :7], sin[:, :7], None, None, 1e-6)
    with pytest.raises(ValueError, match="cos"):
        qk_norm_rope(q, k, cos.half(), sin, None, None, 1e-6)
    from moelora.kernels.rotary import KVStore

    cache = torch.zeros(2, 4, 1, 16, device=DEV)
    slots = torch.zeros(2, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match="share storage"):
        qk_norm_rope(q, k, cos, sin, None, None, 1e-6, kv_store=KVStore(k, cache, cache, slots))
    with pytest.raises(ValueError, match=r"kv_store.v_cache must be contiguous \[NB, BS, Nk=1, D=16\]"):
        qk_norm_rope(q, k, cos, sin, None, None, 1e-6, kv_store=KVStore(k, cache, cache.half(), slots))
    with pytest.raises(ValueError, match="slot_mapping"):
        qk_norm_rope(q, k, cos, sin, None, None, 1e-6, kv_store=KVStore(k, cache, cache.clone(), slots[:1]))


# ---- softmax_topk -------------------------------------------------------------------------------------

def router_logits(T, E, dtype, seed, wide=0):
    """Distinct logits (a shuffled ladder plus noise), so no two probabilities tie in fp16 either."""
    g = torch.Generator().manual_seed(seed)
    ladder = torch.stack([torch.randperm(E, generator=g) for _ in range(T)]).float() if T else torch.zeros(0, E)
    logits = 8.0 * ladder / E - 4.0 + 0.2 / E * torch.rand(T, E, generator=g)
    full = torch.cat((logits, torch.randn(T, wide, generator=g)), dim=1)
    return full.to(dtype).to(DEV)[:, :E]


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,E,K,renorm,wide", [
    (13, 6, 2, True, 0), (7, 5, 1, False, 3), (1, 128, 8, True, 0), (9, 200, 16, False, 0),
    (3, 60, 4, True, 5), (0, 8, 2, True, 0), (2, 4, 4, False, 0)])
def test_softmax_topk(dtype, T, E, K, renorm, wide):
    logits = router_logits(T, E, dtype, seed=T + E + K, wide=wide)
    l0 = logits.clone()
    out = (poisoned(T, K, dtype=torch.float32), torch.full((T, K), -7, dtype=torch.int32, device=DEV))
    w, ids = softmax_topk(logits, K, renorm, out=out)
    assert w is out[0] and ids is out[1] and unchanged((logits, l0))
    w_ref, ids_ref = softmax_topk_ref(logits, K, renorm)
    assert ids.dtype == torch.int32 and torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-7)


@kernel_test
def test_softmax_topk_tie_rule():
    """Equal probabilities: the lowest expert id first, so a tie at the k-th place keeps the lowest ids
    (as torch.topk on CUDA does; see the kernel's docstring)."""
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, -1.0], [2.0] * 6, [3.0, 5.0, 3.0, 3.0, 1.0, 3.0]], device=DEV)
    w, ids = softmax_topk(logits, 3, False)
    assert ids.tolist() == [[1, 2, 4], [0, 1, 2], [1, 0, 2]]
    assert torch.equal(w[0], w[0, :1].expand(3)) and torch.allclose(w[1], torch.full_like(w[1], 1 / 6))


@kernel_test
def test_softmax_topk_rejects_bad_arguments():
    with pytest.raises(ValueError, match="top_k"):
        softmax_topk(rand(3, 4), 5, True)
    with pytest.raises(ValueError, match="experts"):
        softmax_topk(rand(3, 2048), 2, True)


# ---- silu_mul -----------------------------------------------------------------------------------------

@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,inter,fused,wide", [(5, 40, False, 0), (3, 1500, False, 9), (1, 72, True, 0),
                                                (4, 7, True, 3), (0, 16, False, 0)])
def test_silu_mul(dtype, T, inter, fused, wide):
    if fused:  # gate and up as the halves of one gate_up tensor: row stride 2I
        gate_up = rand(T, 2 * inter, dtype=dtype, seed=inter, scale=3.0, wide=wide)
        args, saved = (gate_up[:, :inter], gate_up[:, inter:]), (gate_up[:, :inter].clone(), gate_up[:, inter:].clone())
    else:
        gate = rand(T, inter, dtype=dtype, seed=inter, scale=3.0, wide=wide)
        up = rand(T, inter, dtype=dtype, seed=inter + 1, wide=wide)
        args, saved = (gate, up), (gate.clone(), up.clone())
    out = poisoned(T, inter, dtype=dtype)
    got = silu_mul(*args, out=out)
    assert got is out and unchanged(*zip(args, saved, strict=True))
    torch.testing.assert_close(got, silu_mul_ref(*args), **TOL[dtype])


@kernel_test
def test_silu_mul_rejects_bad_arguments():
    with pytest.raises(ValueError, match="gate"):
        silu_mul(rand(2, 7, 1), rand(2, 7))
    with pytest.raises(ValueError, match="up"):
        silu_mul(rand(2, 8), rand(2, 6))


# ---- the twins are the layers' torch paths ----------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_twins_equal_the_layers_torch_paths(dtype):
    """Bit-exact: the kernels' semantics are what the torch backend computes."""
    q, k, cos, sin = rope_case(6, 4, 2, 24, 12, dtype, 3, wide=0)
    q, k, cos, sin = q.cpu(), k.cpu(), cos.cpu(), sin.cpu()
    qn, kn = RMSNorm(24, 1e-6), RMSNorm(24, 1e-6)
    with torch.no_grad():
        qn.weight.copy_(near_one(24, 4)), kn.weight.copy_(near_one(24, 5))
        want = apply_rotary(qn(q), cos, sin), apply_rotary(kn(k), cos, sin)
        got = qk_norm_rope_ref(q, k, cos, sin, qn.weight, kn.weight, 1e-6)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        x, delta = rand(5, 24, dtype=dtype, device="cpu"), rand(5, 24, dtype=dtype, device="cpu", seed=1)
        assert all(torch.equal(a, b) for a, b in zip(qn.add_forward(x, delta), add_rms_norm_ref(x, delta, qn.weight,
                                                                                               1e-6), strict=True))
    logits = router_logits(7, 12, dtype, 0).cpu()
    for renorm in (False, True):
        w, ids = router_softmax_topk(logits, 3, renorm)
        w_ref, ids_ref = softmax_topk_ref(logits, 3, renorm)
        assert torch.equal(w, w_ref) and torch.equal(ids.to(torch.int32), ids_ref)
    assert torch.equal(silu_mul_ref(x, delta), F.silu(x) * delta)


# ---- GPU: real sizes in bf16, and all four under one CUDA graph ----------------------------------------------

def rel_err(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("T", [1, 64, 1000])
def test_gpu_qwen3_30b_shapes_bf16(T):
    H, NQ, NK, D, E, K, inter = 2048, 32, 4, 128, 128, 8, 768
    bf = torch.bfloat16
    x, delta, w = rand(T, H, dtype=bf, seed=1), rand(T, H, dtype=bf, seed=2), near_one(H, 3)
    h, y = add_rms_norm(x, delta, w, 1e-6)
    assert rel_err(h, x.float() + delta.float()) <= 1e-2
    assert rel_err(y, rms_norm_ref(x.float() + delta.float(), w, 1e-6)) <= 1e-2
    assert rel_err(rms_norm(x, w, 1e-6), rms_norm_ref(x.float(), w, 1e-6)) <= 1e-2
    q, k, cos, sin = rope_case(T, NQ, NK, D, D, bf, 4)
    qw, kw = near_one(D, 5), near_one(D, 6)
    got = qk_norm_rope(q, k, cos, sin, qw, kw, 1e-6)
    want = qk_norm_rope_ref(q.float(), k.float(), cos, sin, qw, kw, 1e-6)
    assert all(rel_err(a, b) <= 1e-2 for a, b in zip(got, want, strict=True))
    logits = rand(T, E, dtype=bf, seed=7, scale=2.0)
    weights, ids = softmax_topk(logits, K, True)
    probs = torch.softmax(logits.float(), -1).sort(-1, descending=True).values
    clear = (probs[:, K - 1] - probs[:, K]) > 1e-3  # rows whose k-th and (k+1)-th differ: same experts
    w_ref, ids_ref = softmax_topk_ref(logits.float(), K, True)
    assert rel_err(weights, w_ref) <= 1e-2
    # bf16 logits tie often; torch orders equal probabilities arbitrarily: compare (id, weight) pairs
    by_id, by_id_ref = ids.sort(-1), ids_ref.sort(-1)
    assert torch.equal(by_id.values[clear], by_id_ref.values[clear])
    assert rel_err(weights.gather(1, by_id.indices)[clear], w_ref.gather(1, by_id_ref.indices)[clear]) <= 1e-2
    g, u = rand(T, inter, dtype=bf, seed=8, scale=3.0), rand(T, inter, dtype=bf, seed=9)
    assert rel_err(silu_mul(g, u), silu_mul_ref(g.float(), u.float())) <= 1e-2


@pytest.mark.gpu
@gpu_only
def test_gpu_cuda_graph_replay_no_sync():
    T, H, NQ, NK, D, E = 16, 2048, 32, 4, 128, 128
    bf = torch.bfloat16
    x, delta, w = rand(T, H, dtype=bf, seed=1), rand(T, H, dtype=bf, seed=2), near_one(H, 3)
    q, k, cos, sin = rope_case(T, NQ, NK, D, D, bf, 4)
    logits, qw = rand(T, E, dtype=bf, seed=5), near_one(D, 6)

    def step():
        h, y = add_rms_norm(x, delta, w, 1e-6)
        return h, y, *qk_norm_rope(q, k, cos, sin, qw, qw, 1e-6), *softmax_topk(logits, 8, True), silu_mul(y, h)

    eager = step()  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            captured = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for t in captured:
        t.fill_(-1)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(captured, eager, strict=True))
