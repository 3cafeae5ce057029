"""The one-launch decode router (`router_topk`) vs its twin, `softmax_topk_ref` of x W^T rounded to the weight's
dtype (x's, or fp32: DeepSeek-V2's "greedy" router, its weights then times the routed scaling factor).

Shape legend: T tokens, H hidden, E experts, K top-k. The interpreter runs fp16 at tiny sizes (H split in 1, 3
and 16 programs, E off the power-of-two grid, T = 0..16); the `gpu` cases the Qwen3-30B-A3B, Qwen2-57B-A14B and
OLMoE router shapes in bf16 under sync-debug mode. The kernel and the twin sum H in different orders, so a
logit may round to the other neighbour: ids are compared on rows whose top K + 1 probabilities are apart by more
than that can move them, weights within the dtype's rounding of a logit.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.interp  # `make test` runs it with TRITON_INTERPRET=1 (set before triton is imported)
triton = pytest.importorskip("triton")

from moelora.kernels.checks import next_pow2  # noqa: E402
from moelora.kernels.reference import softmax_topk_ref  # noqa: E402
from moelora.kernels.router_topk import (  # noqa: E402
    MAX_EXPERTS,
    MAX_FP32_EXPERTS,
    MAX_ROWS,
    NoAux,
    router_topk,
    router_topk_fits,
)
from tests.helpers.kernel_env import DEV, gpu_only, kernel_test  # noqa: E402

ULP = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}


def inputs(T, H, E, dtype, device, seed, w_dtype=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype).to(device)
    w = (torch.randn(E, H, generator=g) * H ** -0.5 * 3).to(w_dtype or dtype).to(device)
    return x, w


def grid_inputs(T, H, E, dtype, device, seed, w_dtype=None):
    """x small integers and w sparse in {-1, 0, 1} / 8: every product and partial sum is exact in fp32 and every
    logit exact in the weight's dtype, whatever the summation order; the kernel's logits are then the twin's, bit
    for bit (ties included, which this grid makes common). An fp32 weight is the grid times 1 + 2^-12, which no
    16-bit format nor TF32 holds (a kernel rounding it moves every logit by 2^-12 relative) and fp32 still sums
    exactly (~20 significant bits)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-2, 3, (T, H), generator=g).to(dtype).to(device)
    w = torch.randint(-1, 2, (E, H), generator=g) * (torch.rand(E, H, generator=g) < 32 / H) / 8
    if w_dtype == torch.float32:
        w = w * (1 + 2.0 ** -12)
    return x, w.to(w_dtype or dtype).to(device)


def check_exact(x, w, K, renorm, got, scaling=1.0):
    """`grid_inputs`: the experts' logits those of `softmax_topk_ref`'s (ids equal but for the order of tied
    logits), the weights its own (times `scaling`) to fp32 rounding."""
    logits = x.double() @ w.double().t()
    assert torch.equal(logits.to(w.dtype).double(), logits)  # the grid holds: every logit exact
    weights, ids = got
    w_ref, ids_ref = softmax_topk_ref(logits.to(w.dtype), K, renorm)
    w_ref = w_ref * scaling
    lg = logits.cpu()
    assert torch.equal(lg.gather(1, ids.long().cpu()), lg.gather(1, ids_ref.long().cpu()))
    assert all(len(set(row.tolist())) == K for row in ids.cpu())
    torch.testing.assert_close(weights.cpu(), w_ref.cpu(), rtol=1e-5, atol=1e-7)


def check(x, w, K, renorm, got, scaling=1.0):
    """Every row: K distinct experts that are a top k of the exact logits rounded once to the weight's dtype (up
    to one more rounding of a logit: the kernel sums in another order; for an fp32 weight up to fp32 summation's
    bound, H u sum |x w|), in descending order, weighted by their softmax probabilities (renormalised) times
    `scaling`; rows whose top k + 1 logits stand clear of each other: `softmax_topk_ref`'s experts exactly."""
    logits = (x.double() @ w.double().t()).to(w.dtype)  # exact sum, one rounding
    weights, ids = got
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    lg, picked = logits.double().cpu(), ids.long().cpu()
    assert all(len(set(row.tolist())) == K for row in picked)
    if w.dtype == torch.float32:
        magnitude = (x.double().abs() @ w.double().abs().t()).amax(dim=1, keepdim=True).cpu()
        slack = 2 * x.shape[1] * 2.0 ** -24 * magnitude
    else:
        slack = 2 * ULP[x.dtype] * lg.abs().amax(dim=1, keepdim=True).clamp(min=1)
    chosen = lg.gather(1, picked)
    rest = lg.scatter(1, picked, float("-inf")).amax(dim=1, keepdim=True)
    assert (chosen >= rest - slack).all()  # no expert left out that beats a chosen one by more than a rounding
    assert (chosen[:, :-1] >= chosen[:, 1:] - slack).all()  # descending, as torch.topk orders them
    want = torch.softmax(lg, dim=1).gather(1, picked)
    if renorm:
        want = want / want.sum(dim=1, keepdim=True)
    want = want * scaling
    # each logit moved by at most slack / 2: a probability by at most slack relative, a renormalised one 2 slack
    assert ((weights.double().cpu() - want).abs() <= 2 * slack * want + 1e-6).all()
    top = lg.topk(min(K + 1, lg.shape[1]), dim=1).values
    clear = (top[:, :-1] - top[:, 1:] > slack).all(dim=1) if top.shape[1] > 1 else torch.ones(len(lg), dtype=bool)
    _, ids_ref = softmax_topk_ref(logits, K, renorm)
    assert torch.equal(ids.cpu()[clear], ids_ref.cpu()[clear])


@kernel_test
@pytest.mark.parametrize("T,H,E,K,renorm,splits", [
    (5, 600, 64, 8, True, None), (16, 256, 128, 8, False, None), (4, 2048, 60, 4, True, 16), (9, 300, 6, 2, False, 2),
    (0, 128, 8, 2, True, None)])
@pytest.mark.parametrize("grid", [False, True], ids=["random", "grid"])
def test_router_topk_equals_twin(T, H, E, K, renorm, splits, grid):
    x, w = (grid_inputs if grid else inputs)(T, H, E, torch.float16, DEV, seed=T + H + E)
    x0 = x.clone()
    counter = torch.zeros(1, dtype=torch.int32, device=DEV)  # shared by both calls, as a layer's is
    got = router_topk(x, w, K, renorm, splits=splits, counter=counter)
    assert torch.equal(x, x0)
    if T:
        (check_exact if grid else check)(x, w, K, renorm, got)
    assert counter.item() == 0  # zero again: one left behind would skip the next call's sum
    again = router_topk(x, w, K, renorm, splits=splits, counter=counter)  # same bits: summed in split order
    assert torch.equal(again[0], got[0]) and torch.equal(again[1], got[1])
    assert counter.item() == 0


@kernel_test
@pytest.mark.parametrize("T,H,E,K,scaling,splits", [
    (5, 600, 64, 6, 1.0, None), (16, 256, 64, 6, 2.5, None), (3, 2048, MAX_FP32_EXPERTS, 8, 16.0, 16),
    (9, 300, 6, 2, 1.0, 2)])
@pytest.mark.parametrize("grid", [False, True], ids=["random", "grid"])
def test_router_topk_fp32_router_equals_twin(T, H, E, K, scaling, splits, grid):
    """DeepSeek-V2's greedy router: an fp32 weight, fp32 logits, no renormalisation, weights times the routed
    scaling factor."""
    x, w = (grid_inputs if grid else inputs)(T, H, E, torch.float16, DEV, seed=T + H + E, w_dtype=torch.float32)
    got = router_topk(x, w, K, False, scaling=scaling, splits=splits)
    (check_exact if grid else check)(x, w, K, False, got, scaling)


def separated_inputs(T, H, E, dtype, device, seed, n_group, topk_group, K):
    """x, an fp32 weight and a bias whose logits are exact (w holds an identity over x's first E columns) and whose
    "noaux_tc" decisions stand clear of ties (every margin > 1e-5 in fp64: ~100x what fp32 sigmoids, bias adds and
    top-2 sums can move a score): the kernel must pick the twin's experts in the twin's order. Seeds are tried from
    `seed` on until one is clear. The logits are distinct multiples of a power-of-two step in [-4, 4), where the
    sigmoid is not flat (at DeepSeek-V3's 256 experts over [-32, 32) most scores sat within 1e-3 of 0 or 1, and
    a margin of 1e-3 over 8 or 16 rows was never met: the GPU test hung in this loop)."""
    from moelora.layers.router import RoutingSpec

    assert H >= E
    step = 8 / next_pow2(2 * E)
    while True:
        g = torch.Generator().manual_seed(seed)
        logits = (torch.stack([torch.randperm(2 * E, generator=g)[:E] for _ in range(T)]).double() - E) * step
        bias = torch.randint(-64, 64, (E,), generator=g).double() / 256
        x = torch.randn(T, H, generator=g).double()
        x[:, :E] = logits
        w = torch.zeros(E, H, dtype=torch.float64)
        w[:, :E] = torch.eye(E, dtype=torch.float64)
        spec = RoutingSpec("noaux_tc", K, True, n_group, topk_group, 1.0)
        if _noaux_margin(logits, bias, spec) > 1e-5:
            return x.to(dtype).to(device), w.float().to(device), bias.float().to(device)
        seed += 1000


def _noaux_margin(logits, bias, spec):
    """The smallest gap, over rows, at the group cut and at the expert cut of "noaux_tc" (fp64)."""
    T, E = logits.shape
    choice = torch.sigmoid(logits) + bias
    groups = choice.view(T, spec.n_group, -1).topk(min(2, E // spec.n_group), dim=-1).values.sum(-1)
    margin = float("inf")
    if spec.n_group > 1 and spec.topk_group < spec.n_group:
        top = groups.topk(spec.topk_group + 1, dim=-1).values
        margin = min(margin, (top[:, -2] - top[:, -1]).min().item())
    best = groups.topk(spec.topk_group, dim=-1).indices
    keep = torch.zeros_like(groups, dtype=torch.bool).scatter(1, best, True)
    keep = keep[:, :, None].expand(T, spec.n_group, E // spec.n_group).reshape(T, E)
    top = choice.masked_fill(~keep, float("-inf")).topk(min(spec.top_k + 1, E), dim=-1).values
    gaps = top[:, :-1] - top[:, 1:]
    return min(margin, gaps[torch.isfinite(gaps)].min().item())


@kernel_test
@pytest.mark.parametrize("T,H,E,K,n_group,topk_group,renorm,scaling,has_bias", [
    (5, 300, 64, 6, 8, 3, True, 2.5, True), (16, 256, 32, 4, 1, 1, True, 1.0, True),
    (3, 2048, 256, 8, 8, 4, True, 2.5, True), (4, 200, 16, 2, 4, 2, False, 1.0, False),
    (6, 64, 12, 3, 3, 2, True, 1.0, True)])  # 12 experts in 3 groups of 4: padding groups in the tile
def test_router_topk_noaux_equals_twin(T, H, E, K, n_group, topk_group, renorm, scaling, has_bias):
    """DeepSeek-V3 / GLM-4-MoE's "noaux_tc" (fp32 router): the twin's experts in the twin's order, its weights
    to fp32 rounding (`layers.router.grouped_topk`, logits clear of ties: `separated_inputs`)."""
    from moelora.layers.router import RoutingSpec, grouped_topk

    x, w, bias = separated_inputs(T, H, E, torch.float16, DEV, T + E, n_group, topk_group, K)
    bias = bias if has_bias else None
    got_w, got_ids = router_topk(x, w, K, renorm, scaling=scaling, noaux=NoAux(bias, n_group, topk_group))
    spec = RoutingSpec("noaux_tc", K, renorm, n_group, topk_group, scaling)
    want_w, want_ids = grouped_topk((x.float() @ w.t()).cpu(), spec, None if bias is None else bias.cpu())
    assert torch.equal(got_ids.cpu().long(), want_ids)
    torch.testing.assert_close(got_w.cpu(), want_w, rtol=2e-6, atol=1e-7)


@kernel_test
@pytest.mark.parametrize("T,E,K,n_group,topk_group,renorm,scaling,has_bias", [
    (37, 64, 6, 8, 3, True, 2.5, True), (5, 32, 4, 1, 1, True, 1.0, True), (20, 256, 8, 8, 4, True, 2.5, True),
    (9, 12, 3, 3, 2, True, 1.0, False)])
def test_softmax_topk_noaux_on_logits_equals_twin(T, E, K, n_group, topk_group, renorm, scaling, has_bias):
    """Prefill's "noaux_tc" (the kernel on logits the router GEMM wrote, more rows than `router_topk` takes, in
    tiles of several rows): `grouped_topk`'s experts in its order, its weights to fp32 rounding."""
    from moelora.kernels.softmax_topk import softmax_topk
    from moelora.layers.router import RoutingSpec, grouped_topk

    x, w, bias = separated_inputs(T, E, E, torch.float16, DEV, T + E, n_group, topk_group, K)
    bias = bias if has_bias else None
    logits = x.float() @ w.t()
    got_w, got_ids = softmax_topk(logits, K, renorm, scaling=scaling, noaux=NoAux(bias, n_group, topk_group))
    spec = RoutingSpec("noaux_tc", K, renorm, n_group, topk_group, scaling)
    want_w, want_ids = grouped_topk(logits.cpu(), spec, None if bias is None else bias.cpu())
    assert got_ids.dtype == torch.int32 and torch.equal(got_ids.cpu().long(), want_ids)
    torch.testing.assert_close(got_w.cpu(), want_w, rtol=2e-6, atol=1e-7)


@kernel_test
@pytest.mark.parametrize("method", ["softmax", "greedy", "noaux_tc", "noaux_tc_odd_groups", "group_limited_greedy"])
def test_route_takes_the_kernel_where_it_fits(method):
    """`route` on the Triton backend: softmax, DeepSeek-V2's greedy (scaled, never renormalised) and noaux_tc in
    groups the kernel takes run `softmax_topk` (int32 ids), the others torch (int64); either way the torch
    backend's experts, and its weights to fp32 rounding (distinct logits: no ties)."""
    from moelora.layers.router import RoutingSpec, route

    T, E, K = 40, 24, 4
    spec = {"softmax": RoutingSpec("softmax", K, True), "greedy": RoutingSpec("greedy", K, True, scaling=2.5),
            "noaux_tc": RoutingSpec("noaux_tc", K, True, 3, 2, 2.5),  # 3 groups of 8
            "noaux_tc_odd_groups": RoutingSpec("noaux_tc", K, True, 4, 2, 2.5),  # groups of 6: torch
            "group_limited_greedy": RoutingSpec("group_limited_greedy", K, False, 4, 2, 1.5)}[method]
    g = torch.Generator().manual_seed(7)
    logits = (torch.randperm(T * E, generator=g).view(T, E).float() / (T * E) * 8 - 4).to(DEV)
    bias = (torch.randint(-64, 64, (E,), generator=g).float() / 256).to(DEV)
    got_w, got_ids = route(logits, spec, bias, "triton")
    want_w, want_ids = route(logits.cpu(), spec, bias.cpu(), "torch")
    kernel = method in ("softmax", "greedy", "noaux_tc")
    assert got_ids.dtype == (torch.int32 if kernel else torch.int64)
    assert torch.equal(got_ids.cpu().long(), want_ids.long())
    torch.testing.assert_close(got_w.cpu(), want_w, rtol=2e-6, atol=1e-7)


@kernel_test
def test_router_topk_refusals():
    x, w = inputs(3, 64, 8, torch.float16, DEV, seed=0)
    assert router_topk_fits(x, w) and not router_topk_fits(x.float(), w.float())
    assert not router_topk_fits(torch.cat([x] * 6), w)  # more than MAX_ROWS rows
    assert router_topk_fits(x, w.float()) and not router_topk_fits(x, w.double())
    assert MAX_FP32_EXPERTS == MAX_EXPERTS  # an fp32 router takes half-deep H steps past 128 experts
    wide = torch.zeros(MAX_EXPERTS + 1, 64, device=DEV)
    assert not router_topk_fits(x, wide) and not router_topk_fits(x, wide.half())
    with pytest.raises(ValueError, match="router_topk takes"):
        router_topk(torch.cat([x] * (MAX_ROWS // 3 + 1)), w, 2, True)
    with pytest.raises(ValueError, match="top_k"):
        router_topk(x, w, 9, True)
    w32 = w.float()
    with pytest.raises(ValueError, match="noaux_tc groups"):
        router_topk(x, w32[:6], 2, True, noaux=NoAux(None, 2, 1))  # groups of 3: not a power of two
    with pytest.raises(ValueError, match="topk_group"):
        router_topk(x, w32, 2, True, noaux=NoAux(None, 2, 3))
    with pytest.raises(ValueError, match="noaux.bias"):
        router_topk(x, w32, 2, True, noaux=NoAux(torch.zeros(7, device=DEV), 2, 1))


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("T", [1, 8, 16])
@pytest.mark.parametrize("H,E,K,renorm", [(2048, 128, 8, True), (3584, 64, 8, False), (2048, 64, 8, False)],
                         ids=["qwen3_30b", "qwen2_57b", "olmoe"])
@pytest.mark.parametrize("grid", [False, True], ids=["random", "grid"])
def test_gpu_router_topk(T, H, E, K, renorm, grid):
    x, w = (grid_inputs if grid else inputs)(T, H, E, torch.bfloat16, "cuda", seed=T)
    torch.cuda.set_sync_debug_mode("error")  # contract 5
    try:
        got = router_topk(x, w, K, renorm)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    (check_exact if grid else check)(x, w, K, renorm, got)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("T", [1, 8, 16])
@pytest.mark.parametrize("grid", [False, True], ids=["random", "grid"])
def test_gpu_router_topk_fp32_router(T, grid):
    """DeepSeek-V2-Lite's router: H 2048, 64 experts, top 6, fp32 weight, bf16 x."""
    x, w = (grid_inputs if grid else inputs)(T, 2048, 64, torch.bfloat16, "cuda", seed=T, w_dtype=torch.float32)
    torch.cuda.set_sync_debug_mode("error")  # contract 5
    try:
        got = router_topk(x, w, 6, False, scaling=1.0)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    (check_exact if grid else check)(x, w, 6, False, got)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("T", [1, 8, 16])
@pytest.mark.parametrize("H,E,K,n_group,topk_group,scaling", [(7168, 256, 8, 8, 4, 2.5), (4096, 128, 8, 1, 1, 1.0)],
                         ids=["deepseek_v3", "glm45_air"])
def test_gpu_router_topk_noaux(T, H, E, K, n_group, topk_group, scaling):
    from moelora.layers.router import RoutingSpec, grouped_topk

    x, w, bias = separated_inputs(T, H, E, torch.bfloat16, "cuda", T, n_group, topk_group, K)
    torch.cuda.set_sync_debug_mode("error")  # contract 5
    try:
        got_w, got_ids = router_topk(x, w, K, True, scaling=scaling, noaux=NoAux(bias, n_group, topk_group))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    spec = RoutingSpec("noaux_tc", K, True, n_group, topk_group, scaling)
    want_w, want_ids = grouped_topk((x.double() @ w.double().t()).float(), spec, bias)
    assert torch.equal(got_ids.long(), want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("method", ["greedy", "noaux_tc"], ids=["deepseek_v2_lite", "deepseek_v3"])
def test_gpu_route_prefill_rows(method):
    """A prefill step's routing (4096 rows) on the Triton backend: DeepSeek-V2-Lite's greedy (64 experts, top 6)
    and DeepSeek-V3's noaux_tc (256 experts, 8 groups, top 4 groups, top 8) equal the torch twin's experts, and its
    weights to fp32 rounding; no host sync."""
    from moelora.layers.router import RoutingSpec, route

    T = 4096
    if method == "greedy":
        spec, E, bias = RoutingSpec("greedy", 6, False, scaling=1.0), 64, None
        g = torch.Generator().manual_seed(3)
        logits = (torch.stack([torch.randperm(E, generator=g) for _ in range(T)]).float() / 8 - 4).cuda()
    else:
        spec, E = RoutingSpec("noaux_tc", 8, True, 8, 4, 2.5), 256
        x, w, bias = separated_inputs(64, E, E, torch.bfloat16, "cuda", 5, 8, 4, 8)  # 64 rows clear of ties ...
        logits = (x.double() @ w.double().t()).float().repeat(T // 64, 1)  # ... in every tile of the 4096
    torch.cuda.set_sync_debug_mode("error")  # contract 5
    try:
        got_w, got_ids = route(logits, spec, bias, "triton")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want_w, want_ids = route(logits, spec, bias, "torch")
    assert got_ids.dtype == torch.int32 and torch.equal(got_ids.long(), want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)


@kernel_test
@pytest.mark.parametrize("T", [5, MAX_ROWS + 1])
@pytest.mark.parametrize("method", ["softmax", "greedy", "noaux_tc"])
def test_sparse_moe_takes_it_on_decode_rows_and_matches_the_two_launches(T, method, monkeypatch):
    """A SparseMoE on the Triton backend in fp16 routes decode rows (T <= MAX_ROWS) through `router_topk` and
    gets the output of the router GEMM + `softmax_topk` (within fp16: a logit may round to its neighbour), or,
    for DeepSeek-V2's greedy router, of the fp32 router GEMM + softmax, top k and the scaling factor in torch;
    more rows take the unfused launches."""
    import moelora.kernels.router_topk as kernels
    from moelora.layers.moe import SparseMoE
    from moelora.layers.options import LayerOptions
    from moelora.layers.router import RoutingSpec, route

    H, inter, E, K = 64, 32, 8, 2
    routing = {"softmax": None, "greedy": RoutingSpec("greedy", K, False, scaling=2.5),
               "noaux_tc": RoutingSpec("noaux_tc", K, True, n_group=2, topk_group=1, scaling=2.5)}[method]
    moe = SparseMoE(H, inter, E, K, True, max_loras=0, max_rank=0, options=LayerOptions(kernel_backend="triton"),
                    dtype=torch.float16, routing=routing, correction_bias=method == "noaux_tc")
    assert moe.gate.weight.dtype == (torch.float16 if method == "softmax" else torch.float32)
    g = torch.Generator().manual_seed(T)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    moe = moe.to(DEV).requires_grad_(False)
    x = torch.randn(T, H, generator=g).to(torch.float16).to(DEV)
    calls = []
    monkeypatch.setattr(kernels, "router_topk", lambda *a, **kw: calls.append(1) or router_topk(*a, **kw))
    got = moe(x)
    assert len(calls) == (T <= MAX_ROWS)
    weights, ids = route(moe.gate(x), moe.routing, getattr(moe.gate, "e_score_correction_bias", None), "triton")
    want = moe.experts(x, weights, ids, None)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-3)


@kernel_test
def test_a_live_router_lora_keeps_the_two_launches():
    """A step whose LoRA batch has the router's site live (an adapter with LoRA on `mlp.gate`) keeps the router
    GEMM with its LoRA delta; the site idle (`LoRABatch.idle`), or no LoRA batch, takes `router_topk`."""
    from moelora.layers.moe import SparseMoE
    from moelora.layers.options import LayerOptions
    from moelora.lora.batch import LoRABatch

    moe = SparseMoE(64, 32, 8, 2, True, max_loras=2, max_rank=4, options=LayerOptions(kernel_backend="triton"),
                    dtype=torch.float16)
    x = torch.zeros(3, 64, dtype=torch.float16)
    live = LoRABatch.build([0, -1, 1], [4, 4], "cpu")
    idle = LoRABatch.build([0, -1, 1], [4, 4], "cpu", idle=frozenset({moe.gate.lora_owner}))
    assert not moe._one_launch_router(x, live)
    assert moe._one_launch_router(x, idle) and moe._one_launch_router(x, None)
