"""The one-launch decode router (`router_topk`) vs its twin, `softmax_topk_ref` of x W^T rounded to x's dtype.

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

from moelora.kernels.reference import softmax_topk_ref  # noqa: E402
from moelora.kernels.router_topk import MAX_ROWS, router_topk, router_topk_fits  # noqa: E402
from tests.helpers.kernel_env import DEV, gpu_only, kernel_test  # noqa: E402

ULP = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}


def inputs(T, H, E, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype).to(device)
    w = (torch.randn(E, H, generator=g) * H ** -0.5 * 3).to(dtype).to(device)
    return x, w


def grid_inputs(T, H, E, dtype, device, seed):
    """x small integers and w sparse in {-1, 0, 1} / 8: every product and partial sum is exact in fp32 and every
    logit exact in x's dtype, whatever the summation order; the kernel's logits are then the twin's, bit for bit
    (ties included, which this grid makes common)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-2, 3, (T, H), generator=g).to(dtype).to(device)
    w = torch.randint(-1, 2, (E, H), generator=g) * (torch.rand(E, H, generator=g) < 32 / H) / 8
    return x, w.to(dtype).to(device)


def check_exact(x, w, K, renorm, got):
    """`grid_inputs`: the experts' logits those of `softmax_topk_ref`'s (ids equal but for the order of tied
    logits), the weights its own to fp32 rounding."""
    logits = x.double() @ w.double().t()
    assert torch.equal(logits.to(x.dtype).double(), logits)  # the grid holds: every logit exact
    weights, ids = got
    w_ref, ids_ref = softmax_topk_ref(logits.to(x.dtype), K, renorm)
    lg = logits.cpu()
    assert torch.equal(lg.gather(1, ids.long().cpu()), lg.gather(1, ids_ref.long().cpu()))
    assert all(len(set(row.tolist())) == K for row in ids.cpu())
    torch.testing.assert_close(weights.cpu(), w_ref.cpu(), rtol=1e-5, atol=1e-7)


def check(x, w, K, renorm, got):
    """Every row: K distinct experts that are a top k of the exact logits rounded once to x's dtype (up to one more
    rounding of a logit: the kernel sums in another order), in descending order, weighted by their softmax
    probabilities (renormalised); rows whose top k + 1 logits stand clear of each other: `softmax_topk_ref`'s
    experts exactly."""
    logits = (x.double() @ w.double().t()).to(x.dtype)  # exact sum, one rounding
    weights, ids = got
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    lg, picked = logits.double().cpu(), ids.long().cpu()
    assert all(len(set(row.tolist())) == K for row in picked)
    slack = 2 * ULP[x.dtype] * lg.abs().amax(dim=1, keepdim=True).clamp(min=1)
    chosen = lg.gather(1, picked)
    rest = lg.scatter(1, picked, float("-inf")).amax(dim=1, keepdim=True)
    assert (chosen >= rest - slack).all()  # no expert left out that beats a chosen one by more than a rounding
    assert (chosen[:, :-1] >= chosen[:, 1:] - slack).all()  # descending, as torch.topk orders them
    want = torch.softmax(lg, dim=1).gather(1, picked)
    if renorm:
        want = want / want.sum(dim=1, keepdim=True)
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
def test_router_topk_refusals():
    x, w = inputs(3, 64, 8, torch.float16, DEV, seed=0)
    assert router_topk_fits(x, w) and not router_topk_fits(x.float(), w.float())
    assert not router_topk_fits(torch.cat([x] * 6), w)  # more than MAX_ROWS rows
    with pytest.raises(ValueError, match="router_topk takes"):
        router_topk(torch.cat([x] * (MAX_ROWS // 3 + 1)), w, 2, True)
    with pytest.raises(ValueError, match="top_k"):
        router_topk(x, w, 9, True)


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


@kernel_test
@pytest.mark.parametrize("T", [5, MAX_ROWS + 1])
def test_sparse_moe_takes_it_on_decode_rows_and_matches_the_two_launches(T, monkeypatch):
    """A SparseMoE on the Triton backend in fp16 routes decode rows (T <= MAX_ROWS) through `router_topk` and
    gets the output of the router GEMM + `softmax_topk` (within fp16: a logit may round to its neighbour);
    more rows take the two launches."""
    import moelora.kernels.router_topk as kernels
    from moelora.layers.moe import SparseMoE
    from moelora.layers.options import LayerOptions
    from moelora.layers.router import route

    H, inter, E, K = 64, 32, 8, 2
    moe = SparseMoE(H, inter, E, K, True, max_loras=0, max_rank=0, options=LayerOptions(kernel_backend="triton"),
                    dtype=torch.float16)
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
    weights, ids = route(moe.gate(x), moe.routing, None, "triton")
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
