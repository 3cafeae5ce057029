"""The Triton LoRA kernels skip a slot by the site's own rank: a `Linear` or `Experts` whose site rank is
0 for a slot gives rows of that slot exactly the base output, even when the slot's A/B buffers hold
non-zero garbage and the step's plan gives the slot its adapter's (global) non-zero rank. Rows of the
covered slots still match the torch twin (which uses the global rank). Tiny sizes, fp32/fp16 (interpreter)
or CUDA.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytestmark = pytest.mark.interp  # `make test` runs it with TRITON_INTERPRET=1 (set before triton is imported)
triton = pytest.importorskip("triton")

from moelora.kernels.fused_moe import fused_moe  # noqa: E402
from moelora.kernels.lora_linear import LoRALinearConfig, lora_linear  # noqa: E402
from moelora.kernels.moe_config import FusedMoEConfig, GemmTile  # noqa: E402
from moelora.kernels.moe_lora import PATHS  # noqa: E402
from moelora.kernels.reference import fused_moe_ref, lora_linear_ref  # noqa: E402
from moelora.layers.linear import Linear  # noqa: E402
from moelora.layers.moe import Experts  # noqa: E402
from moelora.layers.options import LayerOptions  # noqa: E402
from moelora.lora.adapter import LoRAWeights  # noqa: E402
from moelora.lora.batch import LoRABatch  # noqa: E402
from tests.helpers.kernel_env import DEV, kernel_test  # noqa: E402

TRITON = LayerOptions(kernel_backend="triton")

S, R = 3, 8
# The plan's adapter-level ranks: slot 1's adapter has rank-8 LoRA on other sites, none on the tested one.
GLOBAL_RANKS = [4, R, 5]
SLOTS = [1, 0, -1, 1, 2, 0, 1, -1, 1, 2, 1]
TOL = {torch.float32: 1e-4, torch.float16: 2e-2}


def rn(g: torch.Generator, *shape, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=g) * scale


def rows_of(slot: int) -> torch.Tensor:
    return torch.tensor([t for t, s in enumerate(SLOTS) if s == slot], device=DEV)


def fill_garbage(bufs: list[torch.Tensor], slot: int, g: torch.Generator) -> None:
    """Non-zero values in `slot` of every buffer (what a kernel that ignored the site rank would read)."""
    with torch.no_grad():
        for buf in bufs:
            buf[slot].copy_(rn(g, *buf[slot].shape).to(buf.dtype))


def zero_slot(bufs: list[torch.Tensor], slot: int) -> None:
    for buf in bufs:
        buf[slot].zero_()


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert not torch.isnan(got).any()
    return ((got.double() - want).norm() / want.norm()).item()


def assert_base_rows(got: torch.Tensor, base: torch.Tensor) -> None:
    """Rows of slot 1 (site rank 0, garbage in its buffers) and of no slot: exactly the base output."""
    for slot in (1, -1):
        rows = rows_of(slot)
        assert torch.equal(got[rows], base[rows]), f"slot {slot}"


LINEAR_CONFIGS = {"default": None, "split": LoRALinearConfig("split", 16, 32, 16, split_k=2),
                  "planned": LoRALinearConfig("planned", 16, 16, 16, plan_cols=16)}


def linear_case(dtype: torch.dtype, g: torch.Generator) -> Linear:
    n_in, n_out = 24, 40
    lin = Linear(n_in, n_out, bias=True, max_loras=S, max_rank=R, options=TRITON, dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(rn(g, n_out, n_in, scale=n_in ** -0.5))
        lin.bias.copy_(rn(g, n_out))
    lin.set_lora_slot(0, LoRAWeights(rn(g, 4, n_in, scale=n_in ** -0.5), rn(g, n_out, 4, scale=0.5)))
    lin.set_lora_slot(1, None)  # the adapter in slot 1 does not cover this site
    lin.set_lora_slot(2, LoRAWeights(rn(g, 5, n_in, scale=n_in ** -0.5), rn(g, n_out, 5, scale=0.5)))
    return lin.requires_grad_(False).to(DEV)


@kernel_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("mode", list(LINEAR_CONFIGS))
def test_linear_skips_slot_of_site_rank_zero(dtype, mode):
    g = torch.Generator().manual_seed(0)
    lin = linear_case(dtype, g)
    assert lin.lora_ranks.tolist() == [4, 0, 5]
    bufs = [lin.lora_a, lin.lora_b]
    fill_garbage(bufs, 1, g)
    x = rn(g, len(SLOTS), lin.in_features).to(dtype).to(DEV)
    batch = LoRABatch.build(SLOTS, GLOBAL_RANKS, DEV)
    config = LINEAR_CONFIGS[mode]

    def run():
        if config is None:
            return lin(x, batch)  # the layer's own path (default config)
        return lora_linear(x, lin.weight, lin.bias, lin.lora_args(batch), config=config)

    got, base = run(), lora_linear(x, lin.weight, lin.bias, None)
    assert_base_rows(got, base)
    zero_slot(bufs, 1)  # the twin reads slot 1 up to its global rank: what set_lora_slot left there
    f64 = lambda t: t.double()  # noqa: E731
    args = lin.lora_args(batch)
    want = lora_linear_ref(f64(x), f64(lin.weight), f64(lin.bias), replace(args, a=f64(args.a), b=f64(args.b)))
    assert rel_err(got, want) <= TOL[dtype]
    # control: given the global rank, the kernel does read the garbage (so the check above has teeth)
    fill_garbage(bufs, 1, g)
    lin.lora_ranks[1] = R
    assert not torch.equal(run()[rows_of(1)], base[rows_of(1)])


def moe_case(dtype: torch.dtype, g: torch.Generator):
    """Experts with slot 0 on both projections (ranks 4 and 3), slot 1 on neither, slot 2 on gate_up only."""
    E, H, inter, K = 4, 32, 24, 2
    ex = Experts(E, H, inter, max_loras=S, max_rank=R, options=TRITON, dtype=dtype)
    with torch.no_grad():
        ex.gate_up_proj.copy_(rn(g, E, 2 * inter, H, scale=H ** -0.5))
        ex.down_proj.copy_(rn(g, E, H, inter, scale=inter ** -0.5))
    for slot, proj, r in ((0, "gate_up", 4), (0, "down", 3), (2, "gate_up", 5)):
        n_in, n_out = (H, 2 * inter) if proj == "gate_up" else (inter, H)
        ex.set_lora_slot(slot, proj, LoRAWeights(rn(g, E, r, n_in, scale=n_in ** -0.5), rn(g, E, n_out, r, scale=0.5)))
    ex.set_lora_slot(1, "gate_up", None)
    ex.set_lora_slot(1, "down", None)
    ex = ex.requires_grad_(False).to(DEV)
    T = len(SLOTS)
    ids = torch.rand(T, E, generator=g).topk(K, dim=1).indices.to(torch.int32).to(DEV)
    weights = (torch.rand(T, K, generator=g) + 0.1).to(DEV)
    return ex, rn(g, T, H).to(dtype).to(DEV), weights, ids


@kernel_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shrink", [*PATHS, "layer"])
def test_experts_skip_slot_of_site_rank_zero(dtype, shrink):
    g = torch.Generator().manual_seed(1)
    ex, x, weights, ids = moe_case(dtype, g)
    assert ex.lora_gate_up_ranks.tolist() == [4, 0, 5] and ex.lora_down_ranks.tolist() == [3, 0, 0]
    bufs = [ex.lora_gate_up_a, ex.lora_gate_up_b, ex.lora_down_a, ex.lora_down_b]
    fill_garbage(bufs, 1, g)
    batch = LoRABatch.build(SLOTS, GLOBAL_RANKS, DEV)
    tile = GemmTile(32, 32, 4, 2)
    cfg = None  # "layer": the layer's own path (default config); a path: 32-deep steps where it has them
    if shrink != "layer":
        cfg = FusedMoEConfig(16, tile, tile).on_path(shrink)
        if hasattr(cfg.lora, "block_k"):
            cfg = cfg.with_lora(replace(cfg.lora, block_k=32))

    def run(lora):
        if cfg is None:
            return ex(x, weights, ids, lora)  # the layer's own path (default config)
        return fused_moe(x, ex.gate_up_proj, ex.down_proj, weights, ids, lora=ex.lora_args(lora), config=cfg)

    got, base = run(batch), run(None)
    zero_slot(bufs, 1)
    assert torch.equal(got, run(batch))  # the garbage in a slot of site rank 0 changes nothing
    fill_garbage(bufs[2:], 2, g)  # slot 2 has gate_up LoRA but none on down: its down slot is not read
    assert torch.equal(got, run(batch))
    zero_slot(bufs[2:], 2)
    if DEV == "cpu":
        assert_base_rows(got, base)
    else:  # the base GEMM compiled with LoRA need not round exactly as without it
        for slot in (1, -1):
            torch.testing.assert_close(got[rows_of(slot)], base[rows_of(slot)], rtol=TOL[dtype], atol=TOL[dtype])
    f64 = lambda t: t.double()  # noqa: E731
    args = ex.lora_args(batch)
    ref_args = replace(args, gate_up_a=f64(args.gate_up_a), gate_up_b=f64(args.gate_up_b),
                       down_a=f64(args.down_a), down_b=f64(args.down_b))
    want = fused_moe_ref(f64(x), f64(ex.gate_up_proj), f64(ex.down_proj), f64(weights), ids, lora=ref_args)
    assert rel_err(got, want) <= TOL[dtype]
    fill_garbage(bufs, 1, g)
    ex.lora_gate_up_ranks[1] = R
    ex.lora_down_ranks[1] = R
    assert not torch.equal(run(batch)[rows_of(1)], base[rows_of(1)])
