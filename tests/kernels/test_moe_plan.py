"""Routing plan kernel vs its torch twin (bit-identical), plus the plan's invariants.

Interpreter tests run when TRITON_INTERPRET=1 (set before triton is imported: `make test` runs
the kernel tests in their own pytest process) or on CUDA; `gpu` tests need CUDA.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.interp  # `make test` runs it with TRITON_INTERPRET=1 (set before triton is imported)
triton = pytest.importorskip("triton")

from moelora.kernels.moe_plan import build_routing_plan  # noqa: E402
from moelora.kernels.reference import build_routing_plan_ref, plan_capacity  # noqa: E402

CUDA = torch.cuda.is_available()
INTERP = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cuda" if CUDA and not INTERP else "cpu"
kernel_test = pytest.mark.skipif(not (INTERP or CUDA), reason="needs TRITON_INTERPRET=1 or CUDA")
gpu = [pytest.mark.gpu, pytest.mark.skipif(not CUDA or INTERP, reason="needs CUDA (not the interpreter)")]


def _topk_ids(T, K, E, dtype=torch.int64, device="cpu", gen=None):
    if T == 0:
        return torch.empty(0, K, dtype=dtype, device=device)
    scores = torch.rand(T, E, generator=gen)
    return scores.topk(K, dim=1).indices.to(dtype).to(device)


def _check_plan(ids, E, bm):
    plan = build_routing_plan(ids, E, bm)
    ref = build_routing_plan_ref(ids, E, bm)
    for f in ("sorted_route_ids", "expert_of_block", "num_padded"):
        got, want = getattr(plan, f), getattr(ref, f)
        assert got.dtype == torch.int32 and got.shape == want.shape, f
        assert torch.equal(got.cpu(), want.cpu()), f
    # invariants: every route exactly once, padding is the sentinel, blocks hold one expert
    T, K = ids.shape
    n = T * K
    sid = plan.sorted_route_ids.cpu().long()
    npad = int(plan.num_padded.cpu()[0])
    assert npad % bm == 0 and sid.shape[0] == plan_capacity(n, E, bm)[0] >= npad
    assert torch.equal(torch.sort(sid[sid < n]).values, torch.arange(n))
    assert bool((sid[npad:] == n).all())
    eob = plan.expert_of_block.cpu().long()
    flat = ids.reshape(-1).cpu().long()
    for b in range(eob.shape[0]):
        rows = sid[b * bm:(b + 1) * bm]
        real = rows[rows < n]
        if b * bm >= npad:
            assert eob[b] == -1
        else:
            assert bool((flat[real] == eob[b]).all())
    return plan


# The last seven: either side of each launcher threshold: the per-expert kernel's warps (n 1024 / 1025)
# and its route limit (n 4096 / 4098); chunked path: n not a multiple of the chunk, E not a power of two,
# more chunks (of 128) than one scan tile (E=100: 69 chunks, tiles of 64; E=1000: 38 chunks, tiles of 8)
@kernel_test
@pytest.mark.parametrize("T,K,E,bm", [(0, 2, 4, 16), (1, 1, 3, 16), (1, 8, 128, 16), (5, 3, 7, 16),
                                      (37, 4, 6, 32), (300, 8, 16, 16), (700, 6, 64, 64),
                                      (128, 8, 128, 64), (205, 5, 100, 32), (512, 8, 128, 64), (683, 6, 60, 16),
                                      (1100, 8, 100, 128), (150, 32, 1000, 16), (2500, 2, 3, 64)])
def test_plan_matches_twin(T, K, E, bm):
    gen = torch.Generator().manual_seed(T * 131 + E)
    _check_plan(_topk_ids(T, K, E, gen=gen, device=DEV), E, bm)


@kernel_test
@pytest.mark.parametrize("n", [4096, 5000])
def test_plan_one_expert_takes_every_route(n):
    ids = torch.full((n, 1), 5, dtype=torch.int64, device=DEV)
    plan = _check_plan(ids, 6, 128)
    assert int(plan.num_padded.cpu()[0]) == -(-n // 128) * 128


@kernel_test
@pytest.mark.parametrize("T,K,E,bm", [(1100, 8, 100, 128), (683, 6, 60, 16)])
def test_plan_scan_columns_in_several_steps(monkeypatch, T, K, E, bm):
    """The scan programs' column of chunk bases in steps of 16 chunks (69 / 33 chunks: 5 / 3 steps, the last
    partial), where the launcher's step covers every chunk of a prefill at once."""
    import moelora.kernels.moe_plan as moe_plan

    monkeypatch.setattr(moe_plan, "_SCAN_COLS", 16)
    gen = torch.Generator().manual_seed(T * 7 + E)
    _check_plan(_topk_ids(T, K, E, gen=gen, device=DEV), E, bm)


@kernel_test
def test_plan_all_routes_one_expert_and_empty_experts():
    ids = torch.full((40, 1), 3, dtype=torch.int32, device=DEV)
    plan = _check_plan(ids, 9, 16)
    assert int(plan.num_padded.cpu()[0]) == 48
    assert plan.expert_of_block.cpu().tolist()[:3] == [3, 3, 3]


@kernel_test
def test_plan_int32_ids_and_rejects_bad_args():
    ids = _topk_ids(9, 2, 5, dtype=torch.int32, device=DEV)
    _check_plan(ids, 5, 16)
    with pytest.raises(ValueError, match="block_m"):
        build_routing_plan(ids, 5, 24)
    with pytest.raises(ValueError, match="topk_ids"):
        build_routing_plan(ids.float(), 5, 16)


@pytest.mark.parametrize("T,K,E,bm", [(1, 8, 128, 16), (33, 6, 64, 16), (4096, 8, 128, 64), (4096, 2, 8, 128)])
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or INTERP, reason="needs CUDA (not the interpreter)")
def test_plan_gpu_real_sizes_no_sync(T, K, E, bm):
    ids = _topk_ids(T, K, E, device="cuda", gen=torch.Generator().manual_seed(T))
    torch.cuda.set_sync_debug_mode("error")
    try:
        plan = build_routing_plan(ids, E, bm)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = build_routing_plan_ref(ids, E, bm)
    for f in ("sorted_route_ids", "expert_of_block", "num_padded"):
        assert torch.equal(getattr(plan, f), getattr(ref, f)), f
    emap = _rank_map(E, E // 2, E // 2, "cuda")  # EP, the second of two ranks: the map's gather syncs nothing either
    torch.cuda.set_sync_debug_mode("error")
    try:
        plan = build_routing_plan(ids, E // 2, bm, expert_map=emap)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = build_routing_plan_ref(ids, E // 2, bm, expert_map=emap)
    for f in ("sorted_route_ids", "expert_of_block", "num_padded", "local_ids"):
        assert torch.equal(getattr(plan, f), getattr(ref, f)), f


def _rank_map(E, first, count, device="cpu"):
    """[E] int32: global expert id -> its id among [first, first + count), -1 elsewhere."""
    ids = torch.arange(E, dtype=torch.int32)
    return torch.where((ids >= first) & (ids < first + count), ids - first, -1).to(torch.int32).to(device)


# an expert map (expert parallelism): the per-expert launch (n <= 4096) and the chunked one; ranks of 2 and 4
@kernel_test
@pytest.mark.parametrize("T,K,E,parts,bm", [(1, 8, 16, 2, 16), (9, 4, 12, 4, 16), (37, 4, 6, 2, 32),
                                            (1100, 4, 8, 2, 32), (700, 6, 64, 4, 64)])
def test_plan_with_expert_map_holds_only_local_routes(T, K, E, parts, bm):
    """Each rank's plan holds exactly the routes to its own experts, each in a block of its local id,
    padded per local expert only (rows counted from the ids, not from the plan builder); the Triton plan
    equals its torch twin bit for bit, and the local ids (-1: another rank's route) ride in the plan."""
    ids = _topk_ids(T, K, E, gen=torch.Generator().manual_seed(T + E), device=DEV)
    flat, n, count = ids.reshape(-1).cpu().long(), T * K, E // parts
    for first in range(0, E, count):
        emap = _rank_map(E, first, count, DEV)
        plan = build_routing_plan(ids, count, bm, expert_map=emap)
        ref = build_routing_plan_ref(ids, count, bm, expert_map=emap)
        for f in ("sorted_route_ids", "expert_of_block", "num_padded", "local_ids"):
            assert torch.equal(getattr(plan, f).cpu(), getattr(ref, f).cpu()), f
        mine = (flat >= first) & (flat < first + count)
        assert torch.equal(plan.local_ids.cpu().reshape(-1).long(), torch.where(mine, flat - first, -1))
        sid = plan.sorted_route_ids.cpu().long()
        assert torch.equal(torch.sort(sid[sid < n]).values, mine.nonzero().squeeze(1))  # local routes, once each
        per_expert = torch.bincount(flat[mine] - first, minlength=count)
        assert int(plan.num_padded.cpu()[0]) == int(((per_expert + bm - 1) // bm * bm).sum())
        eob = plan.expert_of_block.cpu().long()
        for b in range(int(plan.num_padded.cpu()[0]) // bm):
            rows = sid[b * bm:(b + 1) * bm]
            assert bool((flat[rows[rows < n]] - first == eob[b]).all())


def test_expert_map_is_checked():
    ids = _topk_ids(3, 2, 4)
    with pytest.raises(ValueError, match="expert_map"):
        build_routing_plan_ref(ids, 2, 16, expert_map=_rank_map(4, 0, 2).long())
