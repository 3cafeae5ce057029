"""kernels.mla_lora (kv_b_proj's LoRA terms of the absorbed MLA decode) vs the torch twin in layers.mla
(`absorb_query` / `expand_output` with `_SlotSelect`: every slot's product, the token's picked by a mask).

Interpreter tests (tiny, awkward sizes: heads past one program's 16, Dn / Dv / C off the kernels' steps)
run when TRITON_INTERPRET=1 or on CUDA; the `gpu` test runs DeepSeek-V2-Lite's sizes in bf16 against the
twin in fp32. Slots hold zeros past their rank, as `Linear.set_lora_slot` leaves them; rows on no slot and
on a slot of rank 0 must come back untouched, bit for bit.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.interp  # `make test` runs it with TRITON_INTERPRET=1 (set before triton is imported)
triton = pytest.importorskip("triton")

from moelora.kernels.mla_lora import mla_absorb_lora_, mla_expand_lora_  # noqa: E402
from moelora.layers.mla import _SlotSelect, absorb_query, expand_output  # noqa: E402
from tests.helpers.kernel_env import DEV, gpu_only, kernel_test  # noqa: E402


def make_case(T, N, nope, dv, C, ranks, R, slots, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    S = len(ranks)
    a, b = rn(S, R, C) * C ** -0.5, rn(S, N * (nope + dv), R) * 0.5
    for s, r in enumerate(ranks):
        a[s, r:], b[s, :, r:] = 0, 0
    q = rn(T, N, nope + 24)  # q_nope is a slice of the wider query, as the layer passes it
    kv_b = SimpleNamespace(lora_a=a.to(dtype).to(device), lora_b=b.to(dtype).to(device), has_lora=True,
                           in_features=C, bias=None, weight=(rn(N * (nope + dv), C) * C ** -0.5).to(dtype).to(device))
    lora = SimpleNamespace(token_slots=torch.tensor(slots, dtype=torch.int32, device=device), skips=lambda m: False)
    return (q.to(dtype).to(device)[..., :nope], (rn(T, N, C)).to(dtype).to(device), kv_b, lora,
            torch.tensor(ranks, dtype=torch.int32, device=device))


def twin(q_nope, o_lat, kv_b, lora, nope, dtype=None):
    """The torch path's absorbed query and output (in `dtype`, default the inputs')."""
    if dtype is not None:
        up = lambda t: t.to(dtype)  # noqa: E731
        kv_b = SimpleNamespace(**{**vars(kv_b), "lora_a": up(kv_b.lora_a), "lora_b": up(kv_b.lora_b),
                                  "weight": up(kv_b.weight)})
        q_nope, o_lat = up(q_nope), up(o_lat)
    sel = _SlotSelect.of(kv_b, lora)
    return absorb_query(q_nope, kv_b.weight, sel), expand_output(o_lat, kv_b.weight, nope, sel)


def kernels(q_nope, o_lat, kv_b, lora, ranks, nope, width=None):
    q_abs, out = absorb_query(q_nope, kv_b.weight, None), expand_output(o_lat, kv_b.weight, nope, None)
    base = q_abs.clone(), out.clone()
    assert mla_absorb_lora_(q_abs, q_nope, kv_b.lora_a, kv_b.lora_b, ranks, lora.token_slots, width) is q_abs
    assert mla_expand_lora_(out, o_lat, kv_b.lora_a, kv_b.lora_b, nope, ranks, lora.token_slots, width) is out
    return q_abs, out, base


@kernel_test
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 1e-2)])
@pytest.mark.parametrize("N,nope,dv,C", [(5, 12, 10, 20), (19, 40, 24, 72)])
@pytest.mark.parametrize("R", [8, 24])  # rank tiles of 16 and 32 columns (other head-column steps)
def test_lora_terms_equal_twin(dtype, tol, N, nope, dv, C, R):
    # slot 0 full rank, slot 1 rank 3, slot 2 empty (rank 0), rows on no slot
    slots = [0, -1, 1, 2, 0, 1, -1]
    q_nope, o_lat, kv_b, lora, ranks = make_case(len(slots), N, nope, dv, C, (R, 3, 0), R, slots, dtype, DEV,
                                                 seed=N + R)
    q_abs, out, (q_base, out_base) = kernels(q_nope, o_lat, kv_b, lora, ranks, nope)
    want_q, want_out = twin(q_nope, o_lat, kv_b, lora, nope, torch.float64)
    for got, want in ((q_abs, want_q), (out, want_out)):
        assert ((got.double() - want).norm() / want.norm()).item() <= tol
    untouched = torch.tensor([s in (-1, 2) for s in slots], device=q_abs.device)
    assert torch.equal(q_abs[untouched], q_base[untouched]) and torch.equal(out[untouched], out_base[untouched])
    assert not torch.equal(q_abs[~untouched], q_base[~untouched])  # the adapters really moved the rest
    assert not torch.equal(out[~untouched], out_base[~untouched])


@kernel_test
def test_narrow_width_and_zero_tokens():
    """A rank-64 pool of rank <= 8 slots tiled at the batch's width (16 columns) equals the pool's width."""
    slots = [1, 0, 1, -1]
    q_nope, o_lat, kv_b, lora, ranks = make_case(4, 3, 8, 8, 16, (8, 5), 64, slots, torch.float32, DEV, seed=3)
    wide = kernels(q_nope, o_lat, kv_b, lora, ranks, 8)
    narrow = kernels(q_nope, o_lat, kv_b, lora, ranks, 8, width=8)
    assert torch.allclose(wide[0], narrow[0], atol=1e-6) and torch.allclose(wide[1], narrow[1], atol=1e-6)
    empty = kernels(q_nope[:0], o_lat[:0], kv_b, SimpleNamespace(token_slots=lora.token_slots[:0]), ranks, 8)
    assert empty[0].shape == (0, 3, 16) and empty[1].shape == (0, 3, 8)


@kernel_test
@pytest.mark.parametrize("heads", [1, 2, 4, 16])
def test_every_head_tile_equals_twin(heads):
    """Register sums of 1, 2 or 4 heads a program and 16 heads on dots (heads past one block, uneven sizes)."""
    slots = [0, -1, 1, 2, 0, 1]
    q_nope, o_lat, kv_b, lora, ranks = make_case(6, 19, 40, 24, 72, (24, 3, 0), 24, slots, torch.float32, DEV,
                                                 seed=11)
    q_abs, out = absorb_query(q_nope, kv_b.weight, None), expand_output(o_lat, kv_b.weight, 40, None)
    base = q_abs.clone(), out.clone()
    mla_absorb_lora_(q_abs, q_nope, kv_b.lora_a, kv_b.lora_b, ranks, lora.token_slots, heads=heads)
    mla_expand_lora_(out, o_lat, kv_b.lora_a, kv_b.lora_b, 40, ranks, lora.token_slots, heads=heads)
    want_q, want_out = twin(q_nope, o_lat, kv_b, lora, 40, torch.float64)
    for got, want in ((q_abs, want_q), (out, want_out)):
        assert ((got.double() - want).norm() / want.norm()).item() <= 1e-5
    untouched = torch.tensor([s in (-1, 2) for s in slots], device=q_abs.device)
    assert torch.equal(q_abs[untouched], base[0][untouched]) and torch.equal(out[untouched], base[1][untouched])


def test_tiles_pick_the_fewest_register_heads_within_the_grid_limit():
    from moelora.kernels.mla_lora import tiles

    # DeepSeek-V2-Lite's 16 heads: 1 head a program up to 32 rows, 2 at 64, then the absorb side 4 up to 256 rows
    # and the expand side 16 on dots
    Ts = (1, 8, 32, 64, 128, 256, 512)
    assert [tiles(T, 16, "absorb") for T in Ts] == [(1, 1)] * 3 + [(2, 1), (4, 1), (4, 1), (16, 1)]
    assert [tiles(T, 16, "expand") for T in Ts] == [(1, 1)] * 3 + [(2, 1), (16, 1), (16, 1), (16, 1)]
    assert tiles(8, 128, "expand") == (2, 1) and tiles(2048, 128, "absorb") == (16, 1)  # V3's 128 heads
    with pytest.raises(ValueError, match="heads a program"):
        mla_absorb_lora_(torch.zeros(1, 2, 8), torch.zeros(1, 2, 4), torch.zeros(1, 8, 8), torch.zeros(1, 16, 8),
                         torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), heads=8)


@kernel_test
@pytest.mark.parametrize("heads", [1, 16])
@pytest.mark.parametrize("splits", [2, 3, 4])
def test_output_splits_change_no_column(heads, splits):
    """Each side's output columns split over programs (C for absorb, Dv for expand; uneven last chunks) give the
    unsplit result bit for bit, and the default split of a one-row step is one of them."""
    from moelora.kernels.mla_lora import default_splits

    slots = [1, 0, -1]
    q_nope, o_lat, kv_b, lora, ranks = make_case(3, 5, 24, 40, 200, (8, 5), 8, slots, torch.float32, DEV, seed=7)
    base_q, base_out = absorb_query(q_nope, kv_b.weight, None), expand_output(o_lat, kv_b.weight, 24, None)
    results = []
    for n in (1, splits):
        q_abs, out = base_q.clone(), base_out.clone()
        mla_absorb_lora_(q_abs, q_nope, kv_b.lora_a, kv_b.lora_b, ranks, lora.token_slots, heads=heads, splits=n)
        mla_expand_lora_(out, o_lat, kv_b.lora_a, kv_b.lora_b, 24, ranks, lora.token_slots, heads=heads, splits=n)
        results.append((q_abs, out))
    (q1, o1), (qn, on) = results
    assert torch.equal(q1, qn) and torch.equal(o1, on)
    assert not torch.equal(q1[:2], base_q[:2]) and not torch.equal(o1[:2], base_out[:2])
    assert default_splits(1, 16) == 4 and default_splits(64, 16) == 2 and default_splits(256, 128) == 1


def test_validation_errors():
    q_nope, o_lat, kv_b, lora, ranks = make_case(2, 3, 8, 8, 16, (8,), 8, [0, -1], torch.float32, "cpu")
    q_abs = torch.zeros(2, 3, 16)
    with pytest.raises(ValueError, match="output"):
        mla_absorb_lora_(q_abs[..., :8], q_nope, kv_b.lora_a, kv_b.lora_b, ranks, lora.token_slots)
    with pytest.raises(ValueError, match="b must be"):
        mla_absorb_lora_(q_abs, q_nope, kv_b.lora_a, kv_b.lora_b[:, :5], ranks, lora.token_slots)
    with pytest.raises(ValueError, match="int32"):
        mla_expand_lora_(torch.zeros(2, 3, 8), o_lat, kv_b.lora_a, kv_b.lora_b, 8, ranks.long(), lora.token_slots)
    with pytest.raises(ValueError, match="dtype"):
        mla_expand_lora_(torch.zeros(2, 3, 8).half(), o_lat, kv_b.lora_a, kv_b.lora_b, 8, ranks, lora.token_slots)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("R", [16, 32, 64])  # every rank tile (`mla_lora._head_columns`)
@pytest.mark.parametrize("T", [1, 64, 128, 512])  # 1 / 2 / 4 heads a program in registers, 16 on dots (`tiles`)
def test_gpu_deepseek_v2_lite_sizes_bf16(R, T):
    slots = [0] if T == 1 else torch.randint(-1, 8, (T,), generator=torch.Generator().manual_seed(5)).tolist()
    ranks = (R, 8, R, 0, 4, 16, 12, 8)
    q_nope, o_lat, kv_b, lora, r = make_case(T, 16, 128, 128, 512, ranks, R, slots, torch.bfloat16, "cuda")
    torch.cuda.set_sync_debug_mode("error")  # contract 5: no host sync
    try:
        q_abs, out, _ = kernels(q_nope, o_lat, kv_b, lora, r, 128, width=R)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want_q, want_out = twin(q_nope, o_lat, kv_b, lora, 128, torch.float32)
    for got, want in ((q_abs, want_q), (out, want_out)):
        assert ((got.float() - want).norm() / want.norm()).item() <= 1e-2
