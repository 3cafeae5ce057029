"""fused_moe on FP8 (e4m3) expert weights vs its twin: dequantize the weights, then fused_moe_ref (contract 10).

W8A16 (weights upcast in the kernel) equals the twin on the dequantized weights; W8A8 (activations quantized
per token and 1 x 128 group in the kernel, e4m3 MMA) equals the twin with the same activation rounding
(`quant.fp8.fake_quantize_groups`) and stays within tests/helpers/fp8_bounds.py's bound of the W8A16 twin. The Triton
interpreter (3.9) loads float8_e4m3fn, upcasts it and runs e4m3 dots exactly, and the activation quantization
rounds to the e4m3 grid itself (`fp8_quant._round_e4m3`: the interpreter's own fp32 -> e4m3 cast is wrong
across a binade), so both modes run on the CPU under TRITON_INTERPRET=1: in fp32 at 1e-4 (there only: CUDA runs fp32
dots in TF32) and in fp16 (`test_fp8_paths_in_fp16`, on CUDA too). The `gpu` cases run the Qwen3-30B-A3B and
DeepSeek-V2-Lite expert shapes in bf16 (E scaled down where the fp64 bound is slow) against the fp32 twin.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import pytest
import torch

pytestmark = pytest.mark.interp  # `make test` runs it with TRITON_INTERPRET=1 (set before triton is imported)
triton = pytest.importorskip("triton")

from moelora.kernels.fp8_moe import FP8ExpertScales, fp8_tiles  # noqa: E402
from moelora.kernels.fused_moe import fused_moe  # noqa: E402
from moelora.kernels.moe_config import GemmTile  # noqa: E402
from moelora.kernels.reference import ExpertLoRAArgs, fused_moe_ref  # noqa: E402
from moelora.quant.fp8 import (  # noqa: E402
    dequantize_blocks,
    dequantize_channels,
    dequantize_segments,
    fake_quantize_groups,
    quantize_blocks,
    quantize_channels,
    quantize_segments,
)
from tests.helpers.fp8_bounds import experts_bound  # noqa: E402
from tests.helpers.kernel_env import DEV, gpu_only, graph_replayed, interp_only, kernel_test, rel_err  # noqa: E402
from tests.helpers.moe_cases import make_case, tiny_config  # noqa: E402

FP8_TILE = GemmTile(32, 128, 4, 2)


def fp8_weights(w_gu, w_d, block: bool):
    """(q_gu, q_d, scales-without-mode, dequantized gu, dequantized d), the gate and up halves blocked apart."""
    inter = w_d.shape[2]
    if block:
        (q_gu, s_gu), (q_d, s_d) = quantize_segments(w_gu, (inter, inter)), quantize_blocks(w_d)
        deq = dequantize_segments(q_gu, s_gu, (inter, inter)), dequantize_blocks(q_d, s_d)
    else:
        (q_gu, s_gu), (q_d, s_d) = quantize_channels(w_gu), quantize_channels(w_d)
        deq = dequantize_channels(q_gu, s_gu), dequantize_channels(q_d, s_d)
    return q_gu, q_d, (s_gu.contiguous(), s_d.contiguous()), *deq


def twin(x, w_gu, w_d, wts, ids, lora, act_quant: bool, dtype=torch.float64):
    """fused_moe_ref on the dequantized weights, in `dtype`; act_quant: the W8A8 rounding of both GEMM inputs."""
    up = lambda t: t.to(dtype)  # noqa: E731
    lr = None if lora is None else ExpertLoRAArgs(up(lora.gate_up_a), up(lora.gate_up_b), up(lora.down_a),
                                                  up(lora.down_b), lora.token_slots, lora.gate_up_ranks,
                                                  lora.down_ranks, lora.active)
    kw = {"act_quant": partial(fake_quantize_groups, group=128)} if act_quant else {}
    return fused_moe_ref(up(x), up(w_gu), up(w_d), up(wts), ids, lora=lr, **kw)


def dequantized_twin(case, deq_gu, deq_d, act_quant: bool, dtype=torch.float64):
    x, _, _, wts, ids, lora = case
    return twin(x, deq_gu, deq_d, wts, ids, lora, act_quant, dtype)


def lora_terms(x, lora):
    """experts_bound's per-token LoRA terms of `lora` (None: no adapter), on each slot's own rank."""
    if lora is None:
        return None
    ranks = lora.down_ranks.tolist()
    per_slot = {}
    for s, r in enumerate(ranks):
        ga, gb = lora.gate_up_a[s, :, :r].double(), lora.gate_up_b[s, :, :, :r].double()
        da, db = lora.down_a[s, :, :r].double().abs(), lora.down_b[s, :, :, :r].double().abs()
        per_slot[s] = (torch.einsum("eri,ehr->eih", da, db), ga, gb)
    terms = []
    for t, s in enumerate(lora.token_slots.tolist()):
        if s < 0 or ranks[s] == 0:
            terms.append(None)
            continue
        ab, ga, gb = per_slot[s]
        terms.append((ab, torch.einsum("k,erk,eor->eo", x[t].double(), ga, gb)[:, None, :]))
    return terms


def check_w8a8_within_bound(got, case, deq_gu, deq_d, tol):
    """|W8A8 - W8A16 twin| <= the activation rounding's bound, plus `tol` (norm-relative) beyond it."""
    x, _, _, wts, ids, lora = case
    want = twin(x, deq_gu, deq_d, wts, ids, lora, act_quant=False)
    bound = experts_bound(x, deq_gu, deq_d, wts, ids, 128, lora_terms(x, lora)).to(want.device)
    excess = ((got.double() - want).abs() - bound).clamp(min=0)
    assert excess.norm() / want.norm() <= tol, (excess.norm() / want.norm()).item()
    assert (got.double() - want).abs().max() > 0  # the activations were rounded


def run_fp8(case, config, block, act, no_sync=False):
    """fused_moe on the case's weights quantized; no_sync: the call under sync debug mode "error" (contract 5)."""
    x, w_gu, w_d, wts, ids, lora = case
    q_gu, q_d, (s_gu, s_d), deq_gu, deq_d = fp8_weights(w_gu, w_d, block)
    scales = FP8ExpertScales(s_gu, s_d, block=block, quantize_activations=act)
    x_before = x.clone()
    out = torch.full_like(x, float("nan"))
    if no_sync:
        torch.cuda.set_sync_debug_mode("error")
    try:
        got = fused_moe(x, q_gu, q_d, wts, ids, lora=lora, out=out, config=config, fp8=scales)
    finally:
        if no_sync:
            torch.cuda.set_sync_debug_mode("default")
    assert got is out and torch.equal(x, x_before)
    assert not torch.isnan(got).any()
    return got, deq_gu, deq_d


def tiny_fp8_config(shrink="separate", bm=16):
    return replace(tiny_config(shrink, bm=bm), gate_up=FP8_TILE, down=FP8_TILE)


PATH_CASES = [(True, p) for p in ("off", "separate", "route", "block", "stacked", "spread")] + [
    (False, "off"), (False, "route")]  # channel scales: the same loops, one scale row a column


PATH_IDS = [f"{'block' if b else 'channel'}-{p}" for b, p in PATH_CASES]


def path_config(shrink):
    """The tiny FP8 config of a PATH_CASES shrink ("off": the base loops, LoRA fields of "separate")."""
    return tiny_fp8_config("separate" if shrink == "off" else shrink)


def awkward_case(shrink, dtype):
    """H and I off the 128 grid; with LoRA (shrink not "off") mixed adapters, rows on no adapter, ranks below R."""
    ranks = () if shrink == "off" else (8, 0, 3, 8)
    return make_case(9, 200, 136, 5, 2, ranks=ranks, R=8, dtype=dtype, device=DEV, seed=3)


def one_token_cases(dtype):
    """One token; six tokens with every route on expert 2."""
    return (make_case(1, 130, 64, 4, 2, dtype=dtype, device=DEV, seed=5),
            make_case(6, 130, 64, 4, 2, dtype=dtype, device=DEV, seed=6, one_expert=2))


@interp_only  # fp32 at 1e-4; on CUDA (H100) tl.dot takes fp32 inputs as TF32: 3e-3 (test_fp8_paths_in_fp16)
@pytest.mark.parametrize("act", [False, True], ids=["w8a16", "w8a8"])
@pytest.mark.parametrize("block,shrink", PATH_CASES, ids=PATH_IDS)
def test_fp8_experts_equal_twin(block, act, shrink):
    """Awkward sizes: H and I off the 128 grid (partial scale blocks, a gate half of 3 grid rows), mixed
    adapters with rows on no adapter and ranks below the pool's."""
    case = awkward_case(shrink, torch.float32)
    got, deq_gu, deq_d = run_fp8(case, path_config(shrink), block, act)
    assert rel_err(got, dequantized_twin(case, deq_gu, deq_d, act)) <= 1e-4
    if act:
        check_w8a8_within_bound(got, case, deq_gu, deq_d, 1e-5)


@interp_only  # fp32 at 1e-4, as above
def test_fp8_one_token_and_all_routes_on_one_expert():
    for case in one_token_cases(torch.float32):
        for act in (False, True):
            got, deq_gu, deq_d = run_fp8(case, tiny_fp8_config(), True, act)
            assert rel_err(got, dequantized_twin(case, deq_gu, deq_d, act)) <= 1e-4


@kernel_test
@pytest.mark.parametrize("act", [False, True], ids=["w8a16", "w8a8"])
@pytest.mark.parametrize("block,shrink", PATH_CASES, ids=PATH_IDS)
def test_fp8_paths_in_fp16(block, act, shrink):
    """The two tests above in fp16, so they hold on CUDA too (fp16 dots, fp32 sums): the fp32 twin within fp16's
    rounding of h and the output (the interpreter: 3e-4..6e-4 W8A16, up to 2.6e-3 W8A8 where a rounded h crosses an
    e4m3 step), and W8A8 within the activation rounding's bound."""
    cases = (awkward_case(shrink, torch.float16),) + (one_token_cases(torch.float16) if shrink == "off" else ())
    for case in cases:
        got, deq_gu, deq_d = run_fp8(case, path_config(shrink), block, act)
        assert rel_err(got, dequantized_twin(case, deq_gu, deq_d, act, torch.float32)) <= (1e-2 if act else 2e-3)
        if act:
            check_w8a8_within_bound(got, case, deq_gu, deq_d, 1e-3)


@kernel_test
def test_fp8_refusals():
    x, w_gu, w_d, wts, ids, _ = make_case(3, 128, 128, 2, 1, dtype=torch.float32, device=DEV, seed=7)
    q_gu, q_d, (s_gu, s_d), _, _ = fp8_weights(w_gu, w_d, True)
    cfg = tiny_fp8_config()
    with pytest.raises(ValueError, match="need their scales"):
        fused_moe(x, q_gu, q_d, wts, ids, config=cfg)
    with pytest.raises(ValueError, match="block_k must be 128"):
        fused_moe(x, q_gu, q_d, wts, ids, config=tiny_config(), fp8=FP8ExpertScales(s_gu, s_d))
    with pytest.raises(ValueError, match="use_tma"):
        fused_moe(x, q_gu, q_d, wts, ids, config=replace(cfg, use_tma=True), fp8=FP8ExpertScales(s_gu, s_d))
    with pytest.raises(ValueError, match=r"fp8.down scale must be"):
        fused_moe(x, q_gu, q_d, wts, ids, config=cfg, fp8=FP8ExpertScales(s_gu, s_d[:, :, :0]))
    with pytest.raises(ValueError, match="float8_e4m3fn for both"):
        fused_moe(x, q_gu, w_d, wts, ids, config=cfg, fp8=FP8ExpertScales(s_gu, s_d))


def test_fp8_tiles_of_a_bf16_entry():
    from moelora.kernels.moe_config import default_fused_moe_config

    cfg = replace(default_fused_moe_config(128, 2048, 768, 512, 8), use_tma=True)
    fp8 = fp8_tiles(cfg)
    assert (fp8.gate_up.block_k, fp8.down.block_k, fp8.use_tma) == (128, 128, False)
    assert (fp8.block_m, fp8.gate_up.block_n, fp8.lora) == (cfg.block_m, cfg.gate_up.block_n, cfg.lora)


def test_fp8_config_from_the_table(tmp_path):
    """A table's FP8 entry is taken as it is; without one, its bf16 entry on fp8_tiles (LoRA picks kept)."""
    import json

    from moelora.kernels.fp8_moe import fp8_moe_config
    from moelora.kernels.moe_config import FusedMoEConfig, shape_key

    bf16 = FusedMoEConfig(32, GemmTile(64, 256, 4, 3), GemmTile(32, 64, 4, 3), use_tma=True)
    fp8 = FusedMoEConfig(16, GemmTile(128, 128, 8, 2), GemmTile(64, 128, 4, 5))
    table = tmp_path / "t.json"
    key = partial(shape_key, 8, 256, 128)
    table.write_text(json.dumps({"device": "x", "configs": {key(torch.bfloat16): {"64": bf16.to_dict()}}}))
    assert fp8_moe_config(8, 256, 128, 64, 2, torch.bfloat16, "x", str(table)) == fp8_tiles(bf16)
    table2 = tmp_path / "t2.json"
    table2.write_text(json.dumps({"device": "x", "configs": {key(torch.bfloat16): {"64": bf16.to_dict()},
                                                             key(torch.float8_e4m3fn): {"64": fp8.to_dict()}}}))
    assert fp8_moe_config(8, 256, 128, 64, 2, torch.bfloat16, "x", str(table2)) == fp8


QWEN3 = dict(H=2048, I=768, E=128, K=8)
DSV2_LITE = dict(H=2048, I=1408, E=64, K=6)


def gpu_case(shape, T, seed, lora: bool, E=None):
    ranks = (16, 8, 16, 0, 4, 16, 12, 8) if lora else ()
    g = torch.Generator().manual_seed(seed)
    slots = torch.randint(-1, len(ranks), (T,), generator=g, dtype=torch.int32) if lora else None
    return make_case(T, shape["H"], shape["I"], E or shape["E"], shape["K"], ranks=ranks, R=16, dtype=torch.bfloat16,
                     device="cuda", seed=seed, slots=slots)


def gpu_config(shape, T, act=False):
    """The package table's entry the engine would run (W8A8's own when act)."""
    from moelora.kernels.fp8_moe import fp8_moe_config

    return fp8_moe_config(shape["E"], shape["H"], shape["I"], T, shape["K"], torch.bfloat16,
                          torch.cuda.get_device_name(), None, act)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("T", [1, 8, 64, 512])
@pytest.mark.parametrize("shape", ["qwen3", "dsv2_lite"])
@pytest.mark.parametrize("lora", [False, True], ids=["base", "lora8"])
def test_gpu_fp8_w8a16_equals_twin(T, shape, lora):
    sh = QWEN3 if shape == "qwen3" else DSV2_LITE
    case = gpu_case(sh, T, seed=T + 7, lora=lora)
    got, deq_gu, deq_d = run_fp8(case, gpu_config(sh, T), True, False, no_sync=True)
    assert rel_err(got, dequantized_twin(case, deq_gu, deq_d, False, torch.float32)) <= 1e-2


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("T", [1, 8, 64, 512])
@pytest.mark.parametrize("shape", ["qwen3", "dsv2_lite"])
@pytest.mark.parametrize("lora", [False, True], ids=["base", "lora8"])
def test_gpu_fp8_w8a8_within_bound(T, shape, lora):
    """E scaled down to 16 (the fp64 bound loops over routes); H, I, K and the tiles are the model's."""
    sh = QWEN3 if shape == "qwen3" else DSV2_LITE
    case = gpu_case(sh, T, seed=T + 11, lora=lora, E=16)
    got, deq_gu, deq_d = run_fp8(case, gpu_config(sh, T, act=True), True, True, no_sync=True)
    assert rel_err(got, dequantized_twin(case, deq_gu, deq_d, True, torch.float32)) <= 2e-2
    check_w8a8_within_bound(got, case, deq_gu, deq_d, 1e-2)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("act", [False, True], ids=["w8a16", "w8a8"])
def test_gpu_fp8_channel_scales_and_graph_replay(act):
    """Per-channel scales (compressed-tensors) at the Qwen3 shape, replayed from a CUDA graph."""
    case = gpu_case(QWEN3, 8, seed=3, lora=True)
    x, w_gu, w_d, wts, ids, lora = case
    q_gu, q_d, (s_gu, s_d), deq_gu, deq_d = fp8_weights(w_gu, w_d, False)
    scales = FP8ExpertScales(s_gu, s_d, block=False, quantize_activations=act)
    cfg = gpu_config(QWEN3, 8, act)
    fused_moe(x, q_gu, q_d, wts, ids, lora=lora, config=cfg, fp8=scales)  # compile outside the capture
    got = graph_replayed(lambda o: fused_moe(x, q_gu, q_d, wts, ids, lora=lora, out=o, config=cfg, fp8=scales),
                         torch.empty_like(x))
    assert rel_err(got, twin(x, deq_gu, deq_d, wts, ids, lora, act_quant=act, dtype=torch.float32)) <= 2e-2
