"""lora_linear with output segments (a merged q/k/v projection: one GEMM, one LoRA shrink + expand) vs
its torch twin, and vs each segment run alone as an unsegmented lora_linear on views of the merged
buffers (the unmerged path).

Shape legend: T tokens, N_in in features, segments N_g (G of them, N_out = sum), S slots, R pool rank
per segment. Cases: mixed slots with rows on no adapter, different ranks per segment and slot (0 for a
segment, and for every segment), segment boundaries that expand tiles straddle (N_g not a multiple of
BN, segments narrower than a tile), non-multiple-of-block T and N_in. Interpreter tests run tiny fp32 /
fp16 shapes; `gpu` tests run Qwen3-30B's q/k/v (2048 -> 4096 + 512 + 512) in bf16.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytestmark = pytest.mark.interp  # `make test` runs it with TRITON_INTERPRET=1 (set before triton is imported)
triton = pytest.importorskip("triton")

from moelora.kernels.args import DenseLoRAArgs, SlotRows  # noqa: E402
from moelora.kernels.dense_policy import CONCAT_MIN_ROWS  # noqa: E402
from moelora.kernels.lora_linear import LoRALinearConfig, default_lora_linear_config, lora_linear  # noqa: E402
from moelora.kernels.reference import lora_linear_ref  # noqa: E402
from tests.helpers.kernel_env import DEV, gpu_only, kernel_test, rel_err  # noqa: E402
from tests.helpers.linear_cases import TINY as LINEAR_TINY  # noqa: E402
from tests.helpers.linear_cases import call_without_sync, named_config, rows_off_exact, step_slots  # noqa: E402

# fp32 relative tolerance: exact-ish under the interpreter; on CUDA Triton's fp32 dots run in TF32.
F32_TOL = 1e-5 if DEV == "cpu" else 2e-3
# the dense tests' tiny configs (16-column planned programs: tiles straddle no segment bound), plus a
# split path with 16-wide expand tiles and fewer lanes than slots, and split's expand_first
TINY = {**LINEAR_TINY, "split_bn16": LoRALinearConfig("split", 16, 16, 16, split_k=2, slot_lanes=2),
        "split_first": LoRALinearConfig("split", 16, 32, 16, split_k=3, slot_lanes=1, expand_first=True)}


def make_case(T, n_in, segs, ranks, R, *, slots=None, dtype=torch.float32, device="cpu", seed=0, bias=True):
    """(x, w, bias, lora, clean): `lora` has NaN in A rows / B columns beyond each segment's rank for each
    slot (a kernel must not read them); `clean` is the same with zeros there (what loading leaves), for the
    twin, which reads every segment up to the slot's largest rank. ranks: [G][S]."""
    g = torch.Generator().manual_seed(seed)
    G, S, n_out = len(segs), len(ranks[0]), sum(segs)

    def rn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    x, w = rn(T, n_in), rn(n_out, n_in, scale=n_in ** -0.5)
    b = rn(n_out) if bias else None
    a, bb = rn(S, G * R, n_in, scale=n_in ** -0.5), rn(S, n_out, R, scale=R ** -0.5)
    off = 0
    for seg, n in enumerate(segs):
        for s in range(S):
            r = ranks[seg][s]
            a[s, seg * R + r:(seg + 1) * R] = float("nan")
            bb[s, off:off + n, r:] = float("nan")
        off += n
    if slots is None:
        slots = torch.randint(-1, S, (T,), generator=g, dtype=torch.int32)
    slots = torch.as_tensor(slots, dtype=torch.int32)
    top = [max(ranks[seg][s] for seg in range(G)) for s in range(S)]  # the adapter's (global) rank
    active = tuple(SlotRows(s, top[s], (slots == s).nonzero().squeeze(1).to(device))
                   for s in range(S) if top[s] > 0 and bool((slots == s).any()))
    lora = DenseLoRAArgs(a.to(device), bb.to(device), slots.to(device),
                         torch.tensor(ranks, dtype=torch.int32, device=device), active, tuple(segs),
                         slots=step_slots(active, device))
    clean = replace(lora, a=lora.a.nan_to_num(0.0), b=lora.b.nan_to_num(0.0))
    return x.to(device), w.to(device), None if b is None else b.to(device), lora, clean



def segment_alone(x, w, b, lora, seg):
    """Segment `seg` as its own unsegmented lora_linear, on views of the merged tensors (the unmerged path)."""
    R = lora.a.shape[1] // len(lora.segments)
    lo = sum(lora.segments[:seg])
    rows = slice(lo, lo + lora.segments[seg])
    args = DenseLoRAArgs(lora.a[:, seg * R:(seg + 1) * R], lora.b[:, rows], lora.token_slots, lora.slot_ranks[seg],
                         lora.active, slots=lora.slots)
    return rows, w[rows], None if b is None else b[rows], args


def check(case, tol, config, ref_dtype=torch.float64, alone_tol=None):
    x, w, b, lora, clean = case
    up = lambda t: None if t is None else t.to(ref_dtype)  # noqa: E731
    want = lora_linear_ref(up(x), up(w), up(b), replace(clean, a=up(clean.a), b=up(clean.b)))
    out = torch.full((x.shape[0], w.shape[0]), float("nan"), dtype=x.dtype, device=x.device)
    x_before = x.clone()
    got = lora_linear(x, w, b, lora, out=out, config=config)
    assert got is out and torch.equal(x, x_before)
    assert not torch.isnan(got).any()
    assert rel_err(got, want) <= tol
    base = lora_linear(x, w, b, None, config=config)  # this mode's own base GEMM (splitk: not cuBLAS)
    slots = lora.token_slots.long()

    def same_as_base(rows, cols=slice(None)):
        """rows on no adapter: exactly the base GEMM; where the GEMM carries the delta (`rows_off_exact`):
        within `tol` of the reference"""
        if not rows_off_exact(config):
            return rel_err(got[rows][:, cols], want[rows][:, cols]) <= tol
        return torch.equal(got[rows][:, cols], base[rows][:, cols])

    assert same_as_base(slots < 0)
    for seg in range(len(lora.segments)):
        rows, w_g, b_g, args = segment_alone(x, w, b, lora, seg)
        # rows whose slot has rank 0 at this segment: its columns exactly the base GEMM
        zero = (slots >= 0) & (lora.slot_ranks[seg].long()[slots.clamp(min=0)] == 0)
        assert same_as_base(zero, rows), f"segment {seg}"
        if alone_tol is not None:
            alone = lora_linear(x, w_g, b_g, args, config=config)
            assert rel_err(got[:, rows], alone.to(ref_dtype)) <= alone_tol, f"segment {seg}"
    return got


# q 24 = BN 16 + 8 (straddled by a tile), k and v 8 each (narrower than a tile: one tile spans all three).
SEGS = (24, 8, 8)
RANKS = [[8, 3, 0, 5, 8],  # q: slot 2 has no LoRA on q
         [0, 3, 8, 2, 8],  # k: slot 0 none
         [4, 0, 8, 1, 8]]  # v: slot 1 none


@kernel_test
@pytest.mark.parametrize("mode", list(TINY))
@pytest.mark.parametrize("dtype,tol", [(torch.float32, F32_TOL), (torch.float16, 1e-2)])
def test_segments_mixed_slots_and_ranks(mode, dtype, tol):
    slots = [0, -1, 1, 2, 3, 4, 1, 0] * 4 + [3, -1, 2, 2, 4]  # T = 37
    case = make_case(37, 40, SEGS, RANKS, 8, slots=slots, dtype=dtype, device=DEV, seed=1)
    check(case, tol, TINY[mode], alone_tol=tol)


@kernel_test
@pytest.mark.parametrize("mode", list(TINY))
def test_segments_width_of_the_batch_in_a_wide_pool(mode):
    """`DenseLoRAArgs.width` 8 over a rank-64 pool: each segment's A rows still start at g * 64, its xa
    columns at g * 16 (BLOCK_R of the width, not of the pool); equal to the twin and each segment alone."""
    dtype, tol = (torch.float16, 1e-2) if mode == "splitk" else (torch.float32, F32_TOL)
    slots = [0, -1, 1, 2, 3, 4, 1, 0] * 4 + [3, -1, 2, 2, 4]
    x, w, b, lora, clean = make_case(37, 40, SEGS, RANKS, 64, slots=slots, dtype=dtype, device=DEV, seed=2)
    check((x, w, b, replace(lora, width=8), clean), tol, TINY[mode], alone_tol=tol)


@kernel_test
@pytest.mark.parametrize("mode", list(TINY))
def test_segments_block_aligned_and_uneven(mode):
    """Boundaries on tile edges (32 + 16 + 16 with BN 16) and uneven ones (33 + 17 + 5), N_in 45."""
    ranks = [[16, 5, 0], [7, 16, 0], [16, 1, 0]]  # slot 2: no LoRA on any segment
    for seed, segs in enumerate(((32, 16, 16), (33, 17, 5))):
        case = make_case(21, 45, segs, ranks, 16, device=DEV, seed=10 + seed)
        check(case, F32_TOL, TINY[mode], alone_tol=F32_TOL)


@kernel_test
def test_two_segments_and_one():
    """G = 2 (a gate/up-style pair) and G = 1 given as segments (ranks [1, S]) equal the twin."""
    check(make_case(19, 24, (20, 12), [[4, 2], [0, 4]], 4, device=DEV, seed=3), F32_TOL, TINY["split"],
          alone_tol=F32_TOL)
    one = make_case(19, 24, (40,), [[4, 2]], 4, device=DEV, seed=4)
    got = check(one, F32_TOL, TINY["split"])
    x, w, b, lora, _ = one
    plain = lora_linear(x, w, b, replace(lora, slot_ranks=lora.slot_ranks[0], segments=()), config=TINY["split"])
    assert torch.equal(got, plain)


@kernel_test
@pytest.mark.parametrize("mode", list(TINY))
def test_segments_one_and_zero_tokens_and_no_adapter(mode):
    cfg = TINY[mode]
    check(make_case(1, 40, SEGS, RANKS, 8, slots=[3], device=DEV, seed=5), F32_TOL, cfg, alone_tol=F32_TOL)
    check(make_case(1, 40, SEGS, RANKS, 8, slots=[2], device=DEV, seed=5, bias=False), F32_TOL, cfg)
    check(make_case(18, 40, SEGS, RANKS, 8, slots=[-1] * 18, device=DEV, seed=6), 1e-6, cfg)
    x, w, b, lora, _ = make_case(0, 40, SEGS, RANKS, 8, slots=[], device=DEV, seed=7)
    assert lora_linear(x, w, b, lora, config=cfg).shape == (0, sum(SEGS))


@kernel_test
@pytest.mark.parametrize("mode", ["split", "splitk"])
@pytest.mark.parametrize("T,bt", [(2, 1), (5, 1), (16, 1), (5, 4), (16, 4)])
def test_rows_segments(mode, T, bt, monkeypatch):
    """The row-gathered shrink and expand (decode's rows, `split.rows_path`; split's launches and splitk's) in blocks
    of `split.ROWS_BT` rows a program (5 rows at 4: a ragged last block): mixed slots, rows on none, ranks 0 on some
    segments, a segment bound straddling a tile; the same as the twin and each segment alone; a wide pool's batch
    width, uneven bounds; a pool of rank 64 read whole (BLOCK_R 64)."""
    from moelora.kernels.dense_lora import split

    monkeypatch.setattr(split, "ROWS_BT", bt)
    assert split.rows_tiles(T, 16, 16).bt == bt and split.rows_tiles(T, 64, 16).bt == bt
    assert split.rows_path(T, 64) and not split.rows_path(split.ROWS_MAX + 1, 16) and not split.rows_path(1, 1024)
    cfg = TINY[mode]
    slots = ([0, -1, 1, 2, 3, 4, 1, 0] * 2)[:T]
    h = dict(dtype=torch.float16, device=DEV)
    check(make_case(T, 40, SEGS, RANKS, 8, slots=slots, seed=20 + T, **h), 1e-2, cfg, alone_tol=1e-2)
    x, w, b, lora, clean = make_case(T, 45, (33, 17, 5), RANKS, 64, slots=slots, seed=30 + T, **h)
    check((x, w, b, replace(lora, width=8), clean), 1e-2, cfg, alone_tol=1e-2)
    wide = [[40, 3, 0, 64, 17], [0, 64, 33, 2, 8], [9, 0, 64, 1, 48]]
    check(make_case(T, 45, (33, 17, 5), wide, 64, slots=slots, seed=40 + T, **h), 1e-2, cfg,
          alone_tol=1e-2)


@kernel_test
def test_default_config_segments():
    for T in (3, 40):
        check(make_case(T, 48, SEGS, RANKS, 8, device=DEV, seed=8 + T), F32_TOL, None)


@kernel_test
def test_rejects_bad_segments():
    x, w, b, lora, _ = make_case(4, 32, SEGS, RANKS, 8, device=DEV)
    with pytest.raises(ValueError, match="segments"):
        lora_linear(x, w, b, replace(lora, segments=(24, 8, 9)))
    with pytest.raises(ValueError, match="segments"):
        lora_linear(x, w, b, replace(lora, a=lora.a[:, :-1]))
    with pytest.raises(ValueError, match="slot_ranks"):
        lora_linear(x, w, b, replace(lora, slot_ranks=lora.slot_ranks[0]))
    with pytest.raises(ValueError, match="slot_ranks"):
        lora_linear(x, w, b, replace(lora, slot_ranks=lora.slot_ranks.t().contiguous().t()))


# Qwen3-30B-A3B's attention input projections, merged.
QKV = (4096, 512, 512)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("segs,n_slots", [((3072, 576), 4), (QKV, 2), (QKV, 1), ((1408, 1408), 1)],
                         ids=["mla_q_kva_4", "qkv_2", "qkv_1", "gate_up_1"])
def test_gpu_prefill_concat_lanes_bf16(segs, n_slots, monkeypatch):
    """Prefill rows, prompts' runs of one slot each (and a run on none), through "concat" itself (up to its 128 lane
    columns: the widest accumulator it launches) at DeepSeek-V2-Lite's q + kv_a and shared gate_up and Qwen3's
    q/k/v widths, against the reference; no host sync."""
    import moelora.kernels.dense_lora.concat as concat

    def no_fallback(*a, **k):
        raise AssertionError("concat fell back to split")

    monkeypatch.setattr(concat.Split, "run", no_fallback)
    T = CONCAT_MIN_ROWS + 37
    run = T // (n_slots + 1)
    slots = sum(([s] * run for s in range(n_slots)), []) + [-1] * (T - n_slots * run)
    ranks = [[16, 8, 16, 4][:n_slots] + [0] * (8 - n_slots)] * len(segs)
    case = make_case(T, 2048, segs, ranks, 16, slots=slots, dtype=torch.bfloat16, device="cuda", seed=n_slots)
    cfg = default_lora_linear_config(T, n_in=2048, n_out=sum(segs))
    assert cfg.mode == "concat"
    call_without_sync(case, cfg)
    check(case, 1e-2, cfg, ref_dtype=torch.float32, alone_tol=1e-2)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("mode", ["split", "splitk", "planned"])
@pytest.mark.parametrize("T", [1, 64, 256])
def test_gpu_qkv_bf16(mode, T):
    """8 slots of rank 16 on q/k/v, rows interleaved over them (decode's worst case), some on no adapter."""
    slots = torch.arange(T, dtype=torch.int32) % 8
    if T > 4:
        slots[torch.randperm(T, generator=torch.Generator().manual_seed(T))[: T // 8]] = -1
    case = make_case(T, 2048, QKV, [[16] * 8] * 3, 16, slots=slots, dtype=torch.bfloat16, device="cuda", seed=T)
    cfg = named_config(T, mode)
    call_without_sync(case, cfg)
    check(case, 1e-2, cfg, ref_dtype=torch.float32, alone_tol=1e-2)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("T", [1, 77, 256])
def test_gpu_qkv_mixed_ranks_bf16(T):
    """Ranks per segment and slot below the pool's 64, 0 for some segments (q-only and k/v-only adapters)."""
    ranks = [[64, 16, 0, 8, 32, 16, 8, 0],
             [64, 0, 16, 8, 0, 16, 8, 0],
             [64, 0, 16, 8, 4, 16, 8, 0]]
    case = make_case(T, 2048, QKV, ranks, 64, dtype=torch.bfloat16, device="cuda", seed=100 + T)
    check(case, 1e-2, None, ref_dtype=torch.float32, alone_tol=1e-2)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("T", [1, 64])
def test_gpu_qkv_cuda_graph_replay(T):
    """Captured once; replayed after new x, slots and per-segment ranks are copied in place."""
    cfg = default_lora_linear_config(T)
    x, w, b, lora, _ = make_case(T, 2048, QKV, [[16, 8, 16, 4]] * 3, 16, dtype=torch.bfloat16, device="cuda", seed=7)
    lora = replace(lora, a=lora.a.nan_to_num(0.0), b=lora.b.nan_to_num(0.0))
    out = torch.empty(T, sum(QKV), dtype=torch.bfloat16, device="cuda")
    lora_linear(x, w, b, lora, out=out, config=cfg)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lora_linear(x, w, b, lora, out=out, config=cfg)
    fresh = make_case(T, 2048, QKV, [[4, 16, 0, 16], [16, 0, 2, 16], [0, 16, 16, 8]], 16, dtype=torch.bfloat16,
                      device="cuda", seed=8)
    fx, _, _, flora, fclean = fresh
    x.copy_(fx)
    for f in ("a", "b", "token_slots", "slot_ranks"):
        getattr(lora, f).copy_(getattr(fclean, f))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    eager = lora_linear(x, w, b, replace(fclean, token_slots=lora.token_slots), config=cfg)
    assert torch.equal(out, eager)
