"""lora_linear (cuBLAS base + Triton LoRA delta: split, splitk and planned paths) vs lora_linear_ref (torch twin).

Interpreter tests (tiny, fp16/fp32) run when TRITON_INTERPRET=1 or on CUDA; `gpu` tests run real
shapes in bf16 against an fp32 reference (relative error <= 1e-2), under CUDA graphs too.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytestmark = pytest.mark.interp  # `make test` runs it with TRITON_INTERPRET=1 (set before triton is imported)
triton = pytest.importorskip("triton")

from moelora.kernels.args import DenseLoRAArgs  # noqa: E402
from moelora.kernels.dense_lora import MODES as DENSE_MODES  # noqa: E402
from moelora.kernels.dense_lora.concat import split_prefill_config  # noqa: E402
from moelora.kernels.dense_lora.planned import row_plan  # noqa: E402
from moelora.kernels.dense_policy import CONCAT_MIN_ROWS, PLANNED_MAX_ROWS, DenseLoRAPolicy  # noqa: E402
from moelora.kernels.lora_linear import LoRALinearConfig, default_lora_linear_config, lora_linear  # noqa: E402
from moelora.kernels.reference import lora_linear_ref  # noqa: E402
from tests.helpers.kernel_env import CUDA, DEV, INTERP, gpu_only, graph_replayed, kernel_test, rel_err  # noqa: E402,F401
from tests.helpers.linear_cases import TINY, call_without_sync, make_case, named_config, rows_off_exact  # noqa: E402

MODES = tuple(DENSE_MODES)
assert set(TINY) == set(MODES), "every registered dense mode needs its tiny config here"


def reference(case, ref_dtype):
    x, w, b, lora = case
    up = lambda t: None if t is None else t.to(ref_dtype)  # noqa: E731
    lr = lora and DenseLoRAArgs(up(lora.a), up(lora.b), lora.token_slots, lora.slot_ranks, lora.active)
    return lora_linear_ref(up(x), up(w), up(b), lr), lora_linear_ref(up(x), up(w), up(b), None)


def check(case, tol, config=None, ref_dtype=torch.float64, delta_tol=None):
    """Whole output within `tol` of the reference, and the LoRA delta alone (output minus this
    launcher's own base GEMM) within `delta_tol` of the reference delta."""
    x, w, b, lora = case
    want, want_base = reference(case, ref_dtype)
    x_before = x.clone()
    out = torch.full((x.shape[0], w.shape[0]), float("nan"), dtype=x.dtype, device=x.device)
    got = lora_linear(x, w, b, lora, out=out, config=config)
    assert got is out and torch.equal(x, x_before)
    assert not torch.isnan(got).any()
    assert rel_err(got, want) <= tol
    base = lora_linear(x, w, b, None, config=config)  # this mode's own base GEMM (splitk: not cuBLAS)
    if lora is not None and delta_tol is not None:
        assert rel_err(got.to(ref_dtype) - base.to(ref_dtype), want - want_base) <= delta_tol
    rows_off = (lora.token_slots < 0) if lora is not None else torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
    if bool(rows_off.any()):
        if not rows_off_exact(config) and lora is not None:
            # the GEMM carries the delta (beta = 1 onto written zeros, or concat's longer K): another GEMM call
            # than the base's, so these rows are held to the reference, not to the base's bits
            assert rel_err(got[rows_off], want[rows_off]) <= tol
        else:  # rows on no adapter get exactly the base GEMM
            assert torch.equal(got[rows_off], base[rows_off])
    return got


@kernel_test
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.float16, 1e-2)])
def test_mixed_slots_ranks_below_max(mode, dtype, tol):
    case = make_case(37, 40, 72, (24, 5, 0, 17), 24, dtype=dtype, device=DEV, seed=1,
                     slots=[0, -1, 1, 2, 1, 3] * 6 + [-1])
    check(case, tol, TINY[mode], delta_tol=tol * 5)


@kernel_test
@pytest.mark.parametrize("mode", MODES)
def test_width_of_the_batch_in_a_wide_pool(mode):
    """`DenseLoRAArgs.width` (the batch's largest rank): slots of rank <= 8 in a rank-64 pool tile at 16
    columns, equal to the twin and to the pool's width."""
    dtype, tol = (torch.float16, 1e-2) if mode == "splitk" else (torch.float32, 1e-4)
    case = make_case(37, 40, 72, (8, 5, 0, 3), 64, dtype=dtype, device=DEV, seed=3,
                     slots=[0, -1, 1, 2, 1, 3] * 6 + [-1])
    x, w, b, lora = case
    wide = check(case, tol, TINY[mode], delta_tol=tol * 5)
    narrow = check((x, w, b, replace(lora, width=8)), tol, TINY[mode], delta_tol=tol * 5)
    assert rel_err(narrow, wide.to(torch.float64)) <= tol / 10


@kernel_test
@pytest.mark.parametrize("mode", MODES)
def test_one_slot_per_row_block_and_empty_blocks(mode):
    # rows 0-15: slot 1 only; 16-31: no adapter; 32-47: slot 0 rank 3 in a pool of max rank 40; 48-52 mixed
    slots = [1] * 16 + [-1] * 16 + [0] * 16 + [1, -1, 0, 0, 1]
    case = make_case(53, 33, 50, (3, 40), 40, device=DEV, seed=5, slots=slots)
    check(case, 1e-4, TINY[mode], delta_tol=1e-4)


@kernel_test
def test_planned_reads_the_callers_row_plan():
    """The engine's path: the rows grouped by slot once (`DenseLoRAArgs.row_plan`) and read by the
    site, bit-identical to the grouping the launcher builds itself; slots spanning several blocks;
    a grouping of other rows or slots is refused."""
    slots = [2] * 21 + [-1, 0, 2, 1] * 5 + [0] * 17
    x, w, b, lora = make_case(len(slots), 45, 40, (16, 3, 9), 16, dtype=torch.float16, device=DEV, seed=11,
                              slots=slots)
    cfg = TINY["planned"]
    own = check((x, w, b, lora), 1e-2, cfg, delta_tol=2e-2)
    given = lora_linear(x, w, b, replace(lora, row_plan=row_plan(lora.token_slots, 3, cfg.block_m)), config=cfg)
    assert torch.equal(given, own)
    for bad in (row_plan(lora.token_slots[:-1], 3, 16), row_plan(lora.token_slots, 4, 16)):
        with pytest.raises(ValueError, match="row_plan"):
            lora_linear(x, w, b, replace(lora, row_plan=bad), config=cfg)


@kernel_test
@pytest.mark.parametrize("slot_lanes", [1, 2, 3, 8])
def test_slot_lanes_fewer_and_more_than_distinct_slots(slot_lanes):
    """Six slots interleaved (up to 6 distinct per block): lanes below that make the last lane loop."""
    slots = [0, 1, 2, 3, 4, 5, -1, 5, 3] * 4 + [2, 2]
    case = make_case(38, 45, 40, (16, 3, 9, 16, 1, 12), 16, dtype=torch.float16, device=DEV, seed=9, slots=slots)
    cfg = LoRALinearConfig("split", 16, 32, 16, split_k=2, slot_lanes=slot_lanes)
    check(case, 1e-2, cfg, delta_tol=2e-2)


@kernel_test
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.float16, 1e-2)])
@pytest.mark.parametrize("bias", [True, False])
def test_expand_first_writes_every_row(dtype, tol, bias):
    """split's expand_first: the delta (+ bias) written over a NaN-filled output, the GEMM adding onto it: row
    blocks of one slot, of none, mixed, a ragged tail; and no LoRA at all (segments: test_lora_segments)."""
    cfg = LoRALinearConfig("split", 16, 32, 16, split_k=3, slot_lanes=1, expand_first=True)
    slots = [1] * 16 + [-1] * 16 + [0, 2, -1, 1] * 5 + [2] * 3
    check(make_case(len(slots), 40, 72, (24, 5, 17), 24, dtype=dtype, device=DEV, seed=4, slots=slots, bias=bias),
          tol, cfg, delta_tol=tol * 5)
    check(make_case(20, 40, 24, (), 0, dtype=dtype, device=DEV, seed=2, bias=bias), tol, cfg)


@kernel_test
def test_prefill_rows_default_config():
    """Above "planned"'s rows: the default config on prompt runs of one slot, a run on none, and an interleaved
    ragged tail: "concat" on a shape 4x as wide as deep (kv_b-like), split's expand first on one less wide."""
    T = PLANNED_MAX_ROWS + 45
    slots = [2] * 300 + [-1] * 200 + [0] * 520 + [0, 1, 2, -1] * 12 + [1]
    for n_in, mode in ((18, "concat"), (40, "split")):
        case = make_case(T, n_in, 72, (16, 5, 9), 16, device=DEV, seed=12, slots=slots)
        cfg = default_lora_linear_config(T, n_in=n_in, n_out=72)
        assert cfg.mode == mode
        check(case, 1e-4, cfg, delta_tol=5e-4)


def test_expand_first_is_splits_one_lane():
    for bad in (dict(slot_lanes=2), dict(mode="planned", slot_lanes=1)):
        with pytest.raises(ValueError, match="expand_first"):
            LoRALinearConfig(**{"mode": "split", **bad, "expand_first": True})


@kernel_test
@pytest.mark.parametrize("slot_lanes", [1, 3, 8])
def test_splitk_mode_fp16(slot_lanes):
    """"splitk": split-K partials (chunks that do not divide N_in) reduced with bias and the expand;
    more distinct slots per row block than lanes, rows on no slot, one token, no LoRA, no bias."""
    cfg = LoRALinearConfig("splitk", 16, 16, 16, split_k=2, slot_lanes=slot_lanes, gemm_block_n=16,
                           gemm_block_k=16, gemm_split_k=4)
    slots = [0, 1, 2, 3, 4, 5, -1, 5, 3] * 4 + [2, 2]
    h = dict(dtype=torch.float16, device=DEV)
    check(make_case(38, 97, 40, (16, 3, 9, 16, 1, 12), 16, seed=9, slots=slots, **h), 1e-2, cfg, delta_tol=2e-2)
    check(make_case(1, 40, 24, (16, 8), 16, seed=3, slots=[1], **h), 1e-2, cfg, delta_tol=2e-2)
    check(make_case(9, 40, 24, (), 0, bias=False, seed=2, **h), 1e-2, cfg)
    check(make_case(18, 40, 24, (16, 4), 16, bias=False, seed=3, slots=[-1] * 18, **h), 1e-2, cfg)


def test_lane_count_capped_by_rows():
    """A grid's slot lanes: at most the pool's slots, the config's lanes and the rows of a row block."""
    from moelora.kernels.lora_tiles import lane_count

    assert [lane_count(8, T, 16, 8) for T in (1, 2, 5, 8, 16, 64)] == [1, 2, 5, 8, 8, 8]
    assert lane_count(3, 64, 16, 8) == 3 and lane_count(8, 64, 16, 1) == 1 and lane_count(8, 64, 4, 8) == 4


@kernel_test
@pytest.mark.parametrize("mode", ["split", "splitk"])
@pytest.mark.parametrize("T", [1, 2, 3, 5])
def test_fewer_rows_than_lanes(mode, T):
    """Decode's few rows, each on its own slot (lanes = the rows, one slot each) or some on none: every row gets
    its own slot's delta with 8 lanes configured."""
    cfg = LoRALinearConfig(mode, 16, 16, 16, split_k=2, slot_lanes=8, gemm_block_n=16, gemm_block_k=16,
                           gemm_split_k=2)
    h = dict(dtype=torch.float16, device=DEV)
    check(make_case(T, 40, 24, (16, 3, 9, 16, 1, 12), 16, seed=T, slots=[5, 0, 3, 1, 2][:T], **h), 1e-2, cfg,
          delta_tol=2e-2)
    check(make_case(T, 40, 24, (16, 3, 9), 16, seed=T + 7, slots=[-1, 2, -1, 0, 2][:T], **h), 1e-2, cfg,
          delta_tol=2e-2)


def test_default_mode_by_shape():
    """The default takes "splitk" only where it measured faster: LoRA rows, T <= 16 on wide shapes,
    T <= 64 on o-like ones (the router's 2048->128 included); "concat" for LoRA rows above CONCAT_MIN_ROWS on
    shapes at least as wide as deep, above PLANNED_MAX_ROWS on those 4x as wide."""
    assert default_lora_linear_config(8, n_in=4096, n_out=2048).mode == "splitk"
    assert default_lora_linear_config(16, n_in=2048, n_out=5120).mode == "splitk"  # merged q/k/v
    assert default_lora_linear_config(1, n_in=4096, n_out=2048).mode == "splitk"
    assert default_lora_linear_config(64, n_in=4096, n_out=2048).mode == "splitk"  # o: to 64 rows
    assert default_lora_linear_config(65, n_in=4096, n_out=2048).mode == "split"
    assert default_lora_linear_config(17, n_in=2048, n_out=5120).mode == "split"  # rows not grouped by slot
    grouped = dict(row_plan=True)  # the caller grouped the rows by slot (the engine)
    assert default_lora_linear_config(17, n_in=2048, n_out=5120, **grouped).mode == "planned"
    assert default_lora_linear_config(1024, n_in=2048, n_out=5120, **grouped).mode == "planned"
    assert default_lora_linear_config(1025, n_in=2048, n_out=5120, **grouped).mode == "split"  # prefill, fewer rows
    assert default_lora_linear_config(CONCAT_MIN_ROWS, n_in=2048, n_out=5120).mode == "split"
    assert default_lora_linear_config(CONCAT_MIN_ROWS + 1, n_in=2048, n_out=5120).mode == "concat"
    assert default_lora_linear_config(CONCAT_MIN_ROWS + 1, n_in=2048, n_out=2048).mode == "concat"  # as wide
    assert default_lora_linear_config(1025, n_in=512, n_out=4096).mode == "concat"  # kv_b: 4x as wide
    assert default_lora_linear_config(1025, n_in=1024, n_out=4095).mode == "split"
    assert default_lora_linear_config(1025, n_in=2048, n_out=5120, has_lora=False).mode == "split"
    assert default_lora_linear_config(1025, n_in=4096, n_out=2048, **grouped).mode == "split"  # deeper than wide
    assert default_lora_linear_config(256, n_in=2048, n_out=5120, has_lora=False, **grouped).mode == "split"
    assert default_lora_linear_config(128, n_in=4096, n_out=2048, **grouped).mode == "split"  # o: from 129 rows
    assert default_lora_linear_config(129, n_in=4096, n_out=2048, **grouped).mode == "planned"
    assert default_lora_linear_config(64, n_in=2816, n_out=2048, **grouped).mode == "split"  # deeper than wide
    assert default_lora_linear_config(64, n_in=2048, n_out=2816, **grouped).mode == "planned"
    assert default_lora_linear_config(16, n_in=2048, n_out=5120, **grouped).mode == "splitk"
    assert default_lora_linear_config(256, n_in=2048, n_out=512, **grouped).mode == "split"  # narrower: not measured
    assert default_lora_linear_config(8, n_in=4096, n_out=2048, has_lora=False).mode == "split"  # cuBLAS
    assert default_lora_linear_config(64, n_in=2048, n_out=128).mode == "splitk"  # bf16 router
    assert default_lora_linear_config(65, n_in=2048, n_out=128).mode == "split"
    assert default_lora_linear_config(8, n_in=2048, n_out=64).mode == "split"  # narrower: not measured
    assert default_lora_linear_config(8, n_in=512, n_out=128).mode == "split"
    assert default_lora_linear_config(8, n_in=2048, n_out=1536).mode == "splitk"  # wide, T <= 16
    assert default_lora_linear_config(32, n_in=2048, n_out=1536).mode == "split"  # neither o-like nor T <= 16
    assert default_lora_linear_config(8).mode == "split"


@kernel_test
def test_concat_falls_back_to_split_expand_first():
    """"concat" without the step's slots (`lora.slots` None) or with more lane columns than CONCAT_MAX_COLS (8
    slots of rank 64 at two segments) runs split's expand_first: the same bits."""
    cfg = LoRALinearConfig("concat", 16, 16, 16)
    first = split_prefill_config(40, 24, 40, False)
    assert (first.mode, first.slot_lanes, first.expand_first) == ("split", 1, True)
    x, w, b, lora = make_case(40, 24, 40, (16, 3, 9), 16, device=DEV, seed=13, slots=[0, 1, 2, -1] * 10)
    no_slots = replace(lora, slots=None)
    assert torch.equal(lora_linear(x, w, b, no_slots, config=cfg), lora_linear(x, w, b, no_slots, config=first))
    x, w, b, lora = make_case(40, 24, 40, (64,) * 8, 64, device=DEV, seed=14, slots=list(range(8)) * 5)
    wide = replace(lora, a=torch.cat([lora.a, lora.a], 1), segments=(24, 16),
                   slot_ranks=torch.stack([lora.slot_ranks, lora.slot_ranks]))
    assert torch.equal(lora_linear(x, w, b, wide, config=cfg), lora_linear(x, w, b, wide, config=first))


def test_default_split_lanes_by_rows():
    """Above "planned"'s rows LoRA takes "concat", and "split" (its fallback) one slot lane (prefill: a prompt's rows
    share a slot; 8 lanes measured slower there, docs/performance.md) with its expand first (measured faster
    there); 8 lanes up to them (decode's rows interleave slots)."""
    for n_in, n_out in ((2048, 5120), (4096, 2048)):
        wide = "concat" if n_out >= n_in else "split"  # o-like shapes: split (concat would copy the wider x)
        assert default_lora_linear_config(PLANNED_MAX_ROWS + 1, n_in=n_in, n_out=n_out, row_plan=True).mode == "split"
        assert default_lora_linear_config(8192, n_in=n_in, n_out=n_out).mode == wide
        big = default_lora_linear_config(PLANNED_MAX_ROWS + 1, "split", n_in=n_in, n_out=n_out)
        assert (big.mode, big.slot_lanes, big.expand_first) == ("split", 1, True)
        small = default_lora_linear_config(PLANNED_MAX_ROWS, n_in=n_in, n_out=n_out)  # rows not grouped: "split"
        assert (small.mode, small.slot_lanes, small.expand_first) == ("split", 8, False)


def test_prefill_shrink_splits_count_its_row_blocks():
    """The shrink's K splits bring its row blocks up to SHRINK_TARGET_PROGRAMS (128, within the expand's budget of
    4 at these tiles), counting blocks of the rows it takes: 64 above PLANNED_MAX_ROWS, 16 up to it. 2048 rows are
    32 blocks of 64: 4 splits (they were counted as 128 blocks of 16: one split, 32 programs of a whole K each)."""
    from moelora.kernels.dense_lora.split import shrink_setup

    for T, n_in, bm, splits in ((2048, 2048, 64, 4), (2048, 4096, 64, 4), (4096, 2048, 64, 2), (8192, 256, 64, 1),
                                (PLANNED_MAX_ROWS, 2048, 16, 2), (256, 2048, 16, 4)):
        x, _, _, lora = make_case(T, n_in, 8, (16, 4), 16, bias=False, dtype=torch.float16, seed=1)
        sh = shrink_setup(x, lora, T, n_in, default_lora_linear_config(T, "split", n_in=n_in, n_out=8))
        assert (sh.block_m, sh.n_split) == (bm, splits), (T, n_in)


class _SplitKEverywhere(DenseLoRAPolicy):
    def prefers_splitk(self, num_tokens: int, n_in: int, n_out: int, has_lora: bool) -> bool:
        return has_lora


@kernel_test
def test_injected_policy_picks_the_mode():
    """A caller's policy (`lora_linear(..., policy=)`, the layers' `LayerOptions.dense_lora_policy`) decides
    the mode of a call without a config: splitk, bit for bit, at a tiny shape the shipped policy leaves on
    split; without LoRA its pick stays the base GEMM."""
    policy = _SplitKEverywhere()
    assert default_lora_linear_config(6, n_in=64, n_out=48).mode == "split"
    assert default_lora_linear_config(6, n_in=64, n_out=48, policy=policy).mode == "splitk"
    assert default_lora_linear_config(6, n_in=64, n_out=48, has_lora=False, policy=policy).mode == "split"
    case = make_case(6, 64, 48, (16, 4), 16, dtype=torch.float16, device=DEV, seed=7, slots=[0, -1, 1, 1, 0, -1])
    splitk = check(case, 1e-2, default_lora_linear_config(6, "splitk"), delta_tol=2e-2)
    assert torch.equal(lora_linear(*case, policy=policy), splitk)


@kernel_test
def test_default_config_takes_splitk_with_lora():
    """No config, LoRA and decode rows: the splitk path (bit for bit), and the reference's result."""
    cfg = default_lora_linear_config(6, n_in=2048, n_out=1024)
    assert cfg.mode == "splitk"
    case = make_case(6, 2048, 1024, (16, 4), 16, dtype=torch.float16, device=DEV, seed=5, slots=[0, -1, 1, 1, 0, -1])
    assert torch.equal(lora_linear(*case), check(case, 1e-2, cfg, delta_tol=2e-2))


@kernel_test
@pytest.mark.parametrize("split_k", [0, 1, 2, 7])
def test_shrink_split_over_n_in(split_k):
    """N_in chunks that do not divide it (97 = 3 x 32 + 1 with BK 16) and more chunks than BK steps."""
    case = make_case(20, 97, 40, (16, 7), 16, dtype=torch.float16, device=DEV, seed=6)
    check(case, 1e-2, LoRALinearConfig("split", 16, 16, 16, split_k=split_k), delta_tol=2e-2)


@kernel_test
@pytest.mark.parametrize("mode", MODES)
def test_no_lora_no_bias_one_and_zero_tokens(mode):
    cfg = TINY[mode]
    check(make_case(1, 40, 24, (), 0, bias=False, device=DEV, seed=2), 1e-5, cfg)
    check(make_case(1, 40, 24, (16,), 16, device=DEV, seed=3, slots=[0]), 1e-4, cfg, delta_tol=1e-4)
    check(make_case(1, 40, 24, (16, 8), 16, device=DEV, seed=3, slots=[1]), 1e-4, cfg, delta_tol=1e-4)
    check(make_case(3, 40, 24, (16,), 16, device=DEV, seed=3, slots=[-1, -1, -1]), 1e-5, cfg)
    check(make_case(18, 40, 24, (16, 4), 16, bias=False, device=DEV, seed=3, slots=[-1] * 18), 1e-5, cfg)
    x, w, b, lora = make_case(0, 40, 24, (16,), 16, device=DEV, seed=4)
    assert lora_linear(x, w, b, lora, config=cfg).shape == (0, 24)


@kernel_test
def test_default_configs_run():
    for T in (1, 40):
        case = make_case(T, 48, 40, (16, 2), 16, device=DEV, seed=7)
        for mode in MODES:
            check(case, 1e-4, named_config(T, mode), delta_tol=1e-4)
    check(make_case(5, 48, 40, (16, 2), 16, device=DEV, seed=8), 1e-4, delta_tol=1e-4)  # config=None


@kernel_test
def test_rejects_bad_shapes_and_configs():
    x, w, b, lora = make_case(4, 32, 16, (16,), 16, device=DEV)
    with pytest.raises(ValueError, match="weight"):
        lora_linear(x, w[:, :-1], b, lora)
    with pytest.raises(ValueError, match="token_slots"):
        lora_linear(x[:3], w, b, lora)
    with pytest.raises(ValueError, match="mode"):
        LoRALinearConfig("slow")
    with pytest.raises(ValueError, match="block_n"):
        LoRALinearConfig(block_n=48)
    with pytest.raises(ValueError, match="slot_lanes"):
        LoRALinearConfig(slot_lanes=0)


GPU_SHAPES = [(2048, 4096), (2048, 512)]


def gpu_slots(T, n_slots, seed):
    """Requests interleaved over the slots (the decode worst case), a few rows on no adapter."""
    slots = torch.arange(T, dtype=torch.int32) % n_slots
    if T > 4:
        slots[torch.randperm(T, generator=torch.Generator().manual_seed(seed))[: T // 8]] = -1
    return slots


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n_in,n_out", GPU_SHAPES)
@pytest.mark.parametrize("T", [1, 64, 256])
@pytest.mark.parametrize("ranks,R", [((16,) * 8, 16), ((8,) * 8, 64), ((16,), 16)], ids=["8x16", "8x8in64", "1x16"])
def test_gpu_real_shape_bf16(mode, n_in, n_out, T, ranks, R):
    case = make_case(T, n_in, n_out, ranks, R, dtype=torch.bfloat16, device="cuda", seed=T + R,
                     slots=gpu_slots(T, len(ranks), T))
    torch.cuda.set_sync_debug_mode("error")
    try:
        lora_linear(*case, config=named_config(T, mode))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    check(case, 1e-2, named_config(T, mode), ref_dtype=torch.float32, delta_tol=3e-2)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("T", [1, 77, 1000])
def test_gpu_mixed_ranks_bf16(T):
    ranks = (64, 16, 8, 0, 32, 16, 8, 64)
    case = make_case(T, 2048, 5120 + 64, ranks, 64, dtype=torch.bfloat16, device="cuda", seed=T)
    torch.cuda.set_sync_debug_mode("error")
    try:
        lora_linear(*case)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    check(case, 1e-2, ref_dtype=torch.float32, delta_tol=3e-2)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("layout", ["prompts", "interleaved"])
@pytest.mark.parametrize("mode,n_in,n_out", [("concat", 2048, 5120), ("concat", 512, 4096), ("concat", 1408, 2048),
                                             ("split", 2048, 5120)])
def test_gpu_prefill_rows_bf16(bias, layout, mode, n_in, n_out):
    """Above "planned"'s rows: "concat" (the default; q/k/v's, DeepSeek's kv_b and shared down's widths) and split's
    one lane, expand first: prompts' runs of one slot (and a run on none) or 8 slots interleaved, as one segment
    (segments: test_lora_segments); no host sync."""
    T = CONCAT_MIN_ROWS + 37
    slots = ([3] * 700 + [-1] * 300 + [0] * 900 + [5] * (T - 1900)) if layout == "prompts" else gpu_slots(T, 8, 70)
    case = make_case(T, n_in, n_out, (16, 8, 16, 4, 16, 16, 2, 16), 16, dtype=torch.bfloat16, device="cuda",
                     seed=71, slots=slots, bias=bias)
    cfg = default_lora_linear_config(T, mode, n_in=n_in, n_out=n_out)
    assert cfg.mode == mode and (mode == "concat" or cfg.expand_first)
    assert mode != "concat" or default_lora_linear_config(T, n_in=n_in, n_out=n_out) == cfg
    call_without_sync(case, cfg)
    check(case, 1e-2, cfg, ref_dtype=torch.float32, delta_tol=3e-2)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("slot_lanes", [1, 3, 8])
@pytest.mark.parametrize("T", [8, 256])
def test_gpu_many_slots_few_lanes_bf16(slot_lanes, T):
    """24 slots, rows on random slots: more distinct slots per row block than lanes."""
    ranks = tuple((16, 8, 4, 12)[i % 4] for i in range(24))
    case = make_case(T, 2048, 1024, ranks, 16, dtype=torch.bfloat16, device="cuda", seed=50 + T)
    check(case, 1e-2, replace(default_lora_linear_config(T), slot_lanes=slot_lanes), ref_dtype=torch.float32,
          delta_tol=3e-2)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("T", [1, 64, 256])
def test_gpu_cuda_graph_replay(mode, T):
    """Capture once; replay after new x, weights, adapters and token slots are copied in place."""
    ranks, n_in, n_out = (16, 8, 16, 4), 2048, 512
    cfg = named_config(T, mode)
    x, w, b, lora = make_case(T, n_in, n_out, ranks, 16, dtype=torch.bfloat16, device="cuda", seed=40,
                              slots=gpu_slots(T, 4, 40))
    out = torch.empty(T, n_out, dtype=torch.bfloat16, device="cuda")
    lora_linear(x, w, b, lora, out=out, config=cfg)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lora_linear(x, w, b, lora, out=out, config=cfg)
    fresh_slots = torch.randint(-1, 4, (T,), generator=torch.Generator().manual_seed(41), dtype=torch.int32)
    fresh = make_case(T, n_in, n_out, (4, 16, 2, 16), 16, dtype=torch.bfloat16, device="cuda", seed=41,
                      slots=fresh_slots)
    for dst, src in zip((x, w, b), fresh[:3], strict=True):
        dst.copy_(src)
    for f in ("a", "b", "token_slots", "slot_ranks"):
        getattr(lora, f).copy_(getattr(fresh[3], f))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    eager = lora_linear(*fresh, config=cfg)
    assert torch.equal(eager, lora_linear(*fresh, config=cfg))  # no atomics: deterministic
    assert rel_err(out, eager.float()) <= 2e-3
    assert rel_err(out, reference(fresh, torch.float32)[0]) <= 1e-2


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("mode", ["split", "planned"])  # "planned": forks nothing
@pytest.mark.parametrize("T", [8, 256])
def test_gpu_side_stream_shrink_is_bit_exact(T, mode):
    """The shrink on a side stream (concurrent with cuBLAS) equals the one-stream result bit for bit,
    eager and in a graph, with the side stream held back by a sleep queued before the call (a missing
    join would let the expand read xa before the shrink wrote it)."""
    ranks, n_in, n_out = (16, 8, 16, 4), 2048, 5120
    side = torch.cuda.Stream()
    warm = make_case(T, n_in, n_out, ranks, 16, dtype=torch.bfloat16, device="cuda", seed=60, slots=gpu_slots(T, 4, 60))
    case = make_case(T, n_in, n_out, ranks, 16, dtype=torch.bfloat16, device="cuda", seed=61, slots=gpu_slots(T, 4, 61))
    cfg = named_config(T, mode)
    plain = lora_linear(*case, config=cfg)
    assert rel_err(plain, reference(case, torch.float32)[0]) <= 1e-2
    lora_linear(*warm, side_stream=side, config=cfg)  # leaves another input's partials in the allocator's blocks
    with torch.cuda.stream(side):
        torch.cuda._sleep(5_000_000)
    assert torch.equal(lora_linear(*case, side_stream=side, config=cfg), plain)
    out = graph_replayed(lambda o: lora_linear(*case, out=o, side_stream=side, config=cfg), torch.empty_like(plain))
    assert torch.equal(out, plain)
