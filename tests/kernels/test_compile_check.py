"""scripts/compile_check.py: a kernel the interpreter runs but the sm_90 compiler refuses is reported."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compile_check compiles; under the interpreter @triton.jit makes no compilable kernel",
                allow_module_level=True)
import triton.language as tl  # noqa: E402

from tests.helpers.scripts import load_script  # noqa: E402

Compiler = load_script("scripts/compile_check.py").Compiler


@triton.jit
def _loop_carried_reshaped(x_ptr, n, B: tl.constexpr):
    xs = tl.zeros([B, B], tl.float32)
    i = 0
    while i < n:  # the interpreter runs this; the compiler refuses xs changing shape in the loop
        xs = tl.zeros([B, 16], tl.float32)
        i += 1
    tl.store(x_ptr + tl.arange(0, B), tl.sum(xs, 1))


@triton.jit
def _loop_carried_same(x_ptr, n, B: tl.constexpr):
    xs = tl.zeros([B, B], tl.float32)
    i = 0
    while i < n:
        xs = xs + 1.0
        i += 1
    tl.store(x_ptr + tl.arange(0, B), tl.sum(xs, 1))


@triton.jit
def _dot_loop(a_ptr, idx_ptr, out_ptr, n, GATHER: tl.constexpr):
    """acc += A[rows] @ A[rows]^T over row tiles: rows affine, or (GATHER) each tile's rows read from idx in
    the same step, as the paged attention kernels read their block table."""
    offs = tl.arange(0, 64)
    acc = tl.zeros((64, 64), tl.float32)
    for j0 in range(0, n, 64):
        rows = j0 + offs
        if GATHER:
            rows = tl.load(idx_ptr + rows)
        a = tl.load(a_ptr + rows[:, None] * 64 + offs[None, :])
        acc = tl.dot(a, tl.trans(a), acc)
    tl.store(out_ptr + offs[:, None] * 64 + offs[None, :], acc)


def test_loop_waits_finds_the_gathered_loop():
    """`--loops`: at 3 stages a loop whose tile addresses come from a load of the same step waits on every copy in
    flight each step (async_wait num 0); affine tiles keep one step's copies in flight (num 1 or more)."""
    loop_waits = load_script("scripts/compile_check.py").loop_waits
    a, idx, out = torch.zeros(256, 64, dtype=torch.bfloat16), torch.zeros(256, dtype=torch.int32), torch.zeros(64, 64)
    with Compiler(resources=False) as comp:
        for gather in (False, True):
            _dot_loop[(1,)](a, idx, out, 256, GATHER=gather, num_stages=3)
    assert comp.failures == []
    got = {dict(consts)["GATHER"]: loop_waits(k.asm["ttgir"]) for (_, consts), k in comp.kernels.items()}
    assert len(got[False]) == len(got[True]) == 1, got
    assert got[False][0][1] >= 1 and got[True][0][1] == 0, got


def test_compile_error_reported_and_clean_kernel_passes():
    x = torch.zeros(32)
    with Compiler(resources=False) as comp:
        _loop_carried_same[(1,)](x, 3, B=32)
        assert comp.failures == [] and len(comp.seen) == 1
        _loop_carried_reshaped[(1,)](x, 3, B=32)
    assert len(comp.failures) == 1
    assert "_loop_carried_reshaped" in comp.failures[0] and "Loop-carried" in comp.failures[0]
    assert x.eq(0).all()  # compiled, never run


@pytest.mark.parametrize("gpu", ["NVIDIA H200", "NVIDIA H100 80GB HBM3"])
def test_table_entries_compile_for_sm90(tmp_path, monkeypatch, gpu):
    """Every launch the Qwen3-shape entries of the GPU's table make (LoRA off, 1 adapter r16, 8 adapters r64)
    compiles for sm_90 (TMA entries without TMA: their descriptors need a GPU)."""
    import compile_check

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # compile, not read last run's cubins
    assert compile_check.main(["--shapes", "qwen3_30b_a3b", "--picks", "--gpu", gpu]) == 0


def _element_loads(kernel) -> int:
    """bf16/fp16 global loads of one element each in the kernel's PTX (a vector or cp.async load is not one)."""
    import re

    return len(re.findall(r"ld\.global(?:\.\w+)*\.b16 ", kernel.asm["ptx"]))


def _mla_lora_launches(R: int) -> None:
    """Both MLA kv_b_proj LoRA launches at DeepSeek-V2-Lite sizes (N 16, Dn = Dv 128, C 512), a rank-R pool."""
    from moelora.kernels.mla_lora import mla_absorb_lora_, mla_expand_lora_

    bf = torch.bfloat16
    a, b = torch.randn(4, R, 512, dtype=bf), torch.randn(4, 16 * 256, R, dtype=bf)
    ranks, slots = torch.tensor([R, 8, 0, 4], dtype=torch.int32), torch.tensor([0, -1, 3], dtype=torch.int32)
    for heads in (1, 2, 4, 16):  # every tile `mla_lora.tiles` picks
        mla_absorb_lora_(torch.randn(3, 16, 512, dtype=bf), torch.randn(3, 16, 128, dtype=bf), a, b, ranks, slots,
                         heads=heads)
        mla_expand_lora_(torch.randn(3, 16, 128, dtype=bf), torch.randn(3, 16, 512, dtype=bf), a, b, 128, ranks,
                         slots, heads=heads)


def test_lora_b_tiles_are_vector_loads(tmp_path, monkeypatch):
    """The LoRA B tiles compile to vector loads for sm_90: a B tile's rank mask changes inside its contiguous
    columns unless it is cut at whole 16-column chunks (`lora_tiles.rank_chunks`); otherwise each B element
    is a 2-byte load. The LoRA kernels that read no gathered scalars (gate_up GEMM, the delta kernels, the
    dense delta kernels) then have no element load at all; each down GEMM as many as its no-LoRA twin (the
    routing weights). Column-masked by choice, so not compiled here: the merged-projection expand
    (`expand_segments`, registers)."""
    import dataclasses

    bench = load_script("benchmarks/moe_bench_common.py")
    SHAPES, make_inputs, make_layer, make_lora = bench.SHAPES, bench.make_inputs, bench.make_layer, bench.make_lora

    from moelora.kernels.args import DenseLoRAArgs
    from moelora.kernels.dense_lora import MODES as DENSE_MODES
    from moelora.kernels.dense_policy import PLANNED_MAX_ROWS
    from moelora.kernels.fused_moe import fused_moe
    from moelora.kernels.lora_linear import default_lora_linear_config, lora_linear
    from moelora.kernels.moe_config import tuned_fused_moe_config
    from moelora.kernels.moe_lora import PATHS

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    shape = SHAPES["qwen3_30b_a3b"]
    layer = make_layer(dict(shape, E=16), pool_ranks=(16, 64), device="cpu")
    T, n_in, n_out, S, R = 64, 256, 384, 4, 64
    dense = DenseLoRAArgs(torch.randn(S, R, n_in, dtype=torch.bfloat16), torch.randn(S, n_out, R, dtype=torch.bfloat16),
                          torch.arange(T, dtype=torch.int32) % S, torch.tensor([8, 16, 64, 24], dtype=torch.int32),
                          None)
    with Compiler(resources=False) as comp:
        for M in (8, 128):
            x, wts, ids = make_inputs(layer, M)
            base = tuned_fused_moe_config(shape["E"], shape["H"], shape["I"], M, shape["K"], torch.bfloat16,
                                          "NVIDIA H200")
            for mode in PATHS:
                cfg = dataclasses.replace(base, use_tma=False).on_path(mode)
                for lora in (None, make_lora(layer, M, "8ad_r16"), make_lora(layer, M, "8ad_r64")):
                    fused_moe(x, layer.w_gu, layer.w_d, wts, ids, lora=lora, out=torch.empty_like(x), config=cfg)
        xd, w = torch.randn(T, n_in, dtype=torch.bfloat16), torch.randn(n_out, n_in, dtype=torch.bfloat16)
        for mode in DENSE_MODES:
            lora_linear(xd, w, None, dense, config=default_lora_linear_config(T, mode))
        tp = PLANNED_MAX_ROWS + 1  # prefill's pick (one lane, expand first, 64-row shrink blocks), + bias
        lora_linear(torch.randn(tp, n_in, dtype=torch.bfloat16), w, torch.randn(n_out, dtype=torch.bfloat16),
                    dataclasses.replace(dense, token_slots=torch.arange(tp, dtype=torch.int32) % S))
        # "concat" with the step's slots (named: at these rows and widths the policy takes split)
        lora_linear(torch.randn(tp, n_in, dtype=torch.bfloat16), w, None,
                    dataclasses.replace(dense, token_slots=torch.arange(tp, dtype=torch.int32) % 2,
                                        slots=torch.arange(2, dtype=torch.int32), width=16),
                    config=default_lora_linear_config(tp, "concat", n_in=n_in, n_out=n_out))
        _mla_lora_launches(16)
    assert comp.failures == []
    names = {key[0] for key in comp.kernels}
    assert {"lora_block_delta_kernel", "lora_route_delta_kernel", "lora_stacked_shrink_kernel", "act_spread_kernel",
            "planned_delta_kernel", "_lora_expand_add_kernel", "_absorb_lora_kernel",
            "_expand_lora_kernel", "_concat_shrink_kernel", "_concat_weight_kernel"} <= names, names
    down_base = {_element_loads(k) for (name, c), k in comp.kernels.items()
                 if name == "down_kernel" and not dict(c)["HAS_LORA"] and not dict(c)["STACKED"]}
    assert len(down_base) == 1
    for (name, consts), kernel in comp.kernels.items():
        if name in ("combine_kernel", "_plan_count_kernel", "_plan_scan_kernel", "_plan_scatter_kernel"):
            continue
        want = next(iter(down_base)) if name == "down_kernel" else 0
        if name in ("_absorb_lora_kernel", "_expand_lora_kernel") and dict(consts)["HB"] == 1:
            want = 1  # a 1-head program's q_nope / out row: 128 elements over 128 threads, one each (B: vectors)
        if name == "_lora_expand_add_kernel" and dict(consts)["HAS_BIAS"]:
            want = 1  # expand_first's bias row: BN = 128 elements over 128 threads, one each (B: vectors)
        if name == "_concat_weight_kernel":
            want = 16  # a thread's 16 elements of the [32, 64] tile: B's lane columns gathered one by one (its lanes
            # start at runtime columns); not the weight copy's bound (11.6 vs 7.1 us of bytes at DSV2's q + kv_a)
        assert _element_loads(kernel) == want, f"{name} {dict(consts)}: {_element_loads(kernel)} element loads"


def test_mla_lora_kernels_do_not_spill_at_any_rank_tile(tmp_path, monkeypatch):
    """MLA's kv_b_proj LoRA kernels at DeepSeek-V2-Lite sizes (N 16, Dn = Dv 128, C 512) compile for sm_90
    with no local memory at rank tiles 16, 32 and 64 and 1, 2, 4, 16 heads a program (`mla_lora._head_columns`,
    `_reg_columns`; a fixed 32-column step
    spilled 32-1824 bytes a thread at tiles 32 and 64). Resources come from the local ptxas."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    with Compiler(resources=True) as comp:
        for R in (16, 32, 64):
            _mla_lora_launches(R)
    assert comp.failures == []
    found = {(name, dict(c)["BLOCK_R"], dict(c)["HB"]): res for (name, c), res in comp.seen.items()}
    assert set(found) == {(k, r, h) for k in ("_absorb_lora_kernel", "_expand_lora_kernel") for r in (16, 32, 64)
                          for h in (1, 2, 4, 16)}
    for key, res in found.items():
        assert " stack 0" in res and " local 0" in res, f"{key}: {res}"


def test_fp8_linear_launches_compile_for_sm90(tmp_path, monkeypatch):
    """The FP8 linear's tiles for decode (split-K: the last split's sum, atomics), mid-size and prefill batches,
    W8A8 (with the activation quantization) and W8A16, with and without bias, at the Qwen3 q/k/v (three scale
    segments) and o shapes, compile for the H200 (a split-K variant the interpreter ran failed there)."""
    from moelora.kernels.fp8_linear import default_tiles, fp8_linear
    from moelora.quant.fp8 import quantize_segments

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    with Compiler(resources=False) as comp:
        for n_in, segments in ((2048, (4096, 512, 512)), (4096, (2048,))):
            q, s = quantize_segments(torch.randn(sum(segments), n_in) * 0.02, segments)
            for T in (1, 64, 512):
                x = torch.randn(T, n_in, dtype=torch.bfloat16)
                for act in (True, False):
                    for bias in (None, torch.randn(sum(segments), dtype=torch.bfloat16)):
                        fp8_linear(x, q, s.contiguous(), bias, segments=segments, quantize_activations=act)
    assert comp.failures == []
    compiled = {dict(consts)["SPLIT_K"] for name, consts in comp.seen if name == "_fp8_linear_kernel"}
    assert default_tiles(1, 2048, 4096).split_k > 1 and compiled >= {1, default_tiles(1, 2048, 4096).split_k}


def test_router_topk_launches_compile_for_sm90(tmp_path, monkeypatch):
    """The one-launch decode router at the Qwen3-30B-A3B, Qwen2-57B-A14B and Mixtral router shapes, bf16 and
    fp16, one split and several, compiles for the H200."""
    from moelora.kernels.router_topk import router_topk

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    with Compiler(resources=False) as comp:
        for H, E, K in ((2048, 128, 8), (3584, 64, 8), (4096, 8, 2)):
            for dtype in (torch.bfloat16, torch.float16):
                x, w = torch.randn(8, H, dtype=dtype), torch.randn(E, H, dtype=dtype)
                router_topk(x, w, K, True)
                router_topk(x, w, K, False, splits=1)
    assert comp.failures == [] and len(comp.seen) >= 6


def test_fp32_routers_compile_to_tensor_core_dots(tmp_path, monkeypatch):
    """DeepSeek-V2-Lite's (64 experts of 2048) and DeepSeek-V3's (256 noaux_tc experts of 7168) fp32 routers compile
    for the H200 with their dot on the tensor cores (3xTF32: mma.sync on operands split in two TF32 parts, which
    one-pass TF32 (10 bits of the weight) lacks; no fma.rn.f32 of an FMA-unit dot, which the "ieee" dot was: 1024
    and 2048 a thread) and no local memory."""
    import re

    from moelora.kernels.router_topk import NoAux, router_topk

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    with Compiler(resources=True) as comp:
        router_topk(torch.randn(8, 2048, dtype=torch.bfloat16), torch.randn(64, 2048), 6, False)
        router_topk(torch.randn(8, 7168, dtype=torch.bfloat16), torch.randn(256, 7168), 8, True, scaling=2.5,
                    noaux=NoAux(torch.zeros(256), 8, 4))
    assert comp.failures == [] and len(comp.kernels) == 2
    for key, kernel in comp.kernels.items():
        ptx = kernel.asm["ptx"]
        assert re.search(r"\bmma\.sync\S*\.tf32", ptx) and not re.search(r"fma\.rn\.f32", ptx), dict(key[1])
        assert re.search(r"cvt\.rna\.tf32\.f32", ptx), dict(key[1])  # the operands split in two TF32 parts
    for key, res in comp.seen.items():
        assert " local 0" in res, f"{key}: {res}"


def test_topk_on_logits_compiles_for_sm90(tmp_path, monkeypatch):
    """The routers' top k on logits (prefill rows; decode past `router_topk`'s 256 experts) compiles for the H200
    with no local memory: softmax (Qwen3), DeepSeek-V2-Lite's greedy (scaled), DeepSeek-V3's noaux_tc (256 experts in
    8 groups, 4 kept), GLM-4.5's (160 experts, one group) and a Kimi-K2-like router (384 experts, one group)."""
    from moelora.kernels.softmax_topk import NoAux, softmax_topk

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    with Compiler(resources=True) as comp:
        softmax_topk(torch.randn(64, 128), 8, True)
        softmax_topk(torch.randn(64, 64), 6, False, scaling=16.0)
        softmax_topk(torch.randn(64, 256), 8, True, scaling=2.5, noaux=NoAux(torch.zeros(256), 8, 4))
        softmax_topk(torch.randn(64, 160), 8, True, scaling=2.5, noaux=NoAux(torch.zeros(160), 1, 1))
        softmax_topk(torch.randn(64, 384), 8, True, scaling=2.827, noaux=NoAux(torch.zeros(384), 1, 1))
    assert comp.failures == [] and len(comp.seen) == 5
    for key, res in comp.seen.items():
        assert " local 0" in res, f"{key}: {res}"


def test_norm_fp8_launches_compile_for_sm90(tmp_path, monkeypatch):
    """The decoder's RMSNorm writing W8A8 rows (`norm_fp8`), with and without the residual add, at the Qwen3 and
    Qwen2-57B hidden sizes (one partial power-of-two block), compiles for the H200."""
    from moelora.kernels.norm import norm_fp8

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    with Compiler(resources=False) as comp:
        for D in (2048, 3584):
            x, w = torch.randn(8, D, dtype=torch.bfloat16), torch.ones(D)
            norm_fp8(x, None, w, 1e-6)
            norm_fp8(x, x.clone(), w, 1e-6)
            norm_fp8(x, x.clone(), w, 1e-6, delta2=x.clone())  # an MoE block's (routed, shared)
    assert comp.failures == [] and len(comp.seen) >= 3


def test_silu_mul_fp8_launches_compile_for_sm90(tmp_path, monkeypatch):
    """A dense MLP's activation writing the W8A8 down projection's rows (`silu_mul_fp8`) at DeepSeek-V2-Lite's
    widths (1024-column programs; 64: one partial group) compiles for the H200 with no local memory."""
    from moelora.kernels.silu_mul import silu_mul_fp8

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    with Compiler(resources=True) as comp:
        for inter in (2816, 64):
            gate_up = torch.randn(8, 2 * inter, dtype=torch.bfloat16)
            silu_mul_fp8(gate_up[:, :inter], gate_up[:, inter:])
    assert comp.failures == [] and len(comp.seen) == 2
    for key, res in comp.seen.items():
        assert " stack 0" in res and " local 0" in res, f"{key}: {res}"


def test_attention_fp8_rows_compile_for_sm90(tmp_path, monkeypatch):
    """Decode attention writing the o projection's W8A8 rows (Qwen3's 32 / 4 heads of 128), from the split
    kernel (one split) and from the reduce (several), compiles for the H200."""
    from moelora.kernels.attention import paged_attention_fp8
    from tests.helpers.attention_cases import build_meta

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    spec, tables = [(40, 1), (7, 1)], [[0, 1, 2], [3]]
    meta = build_meta(spec, tables, 16, "cpu")
    bf = torch.bfloat16
    q, k, v = torch.randn(2, 32, 128, dtype=bf), torch.randn(2, 4, 128, dtype=bf), torch.randn(2, 4, 128, dtype=bf)
    kc, vc = torch.randn(4, 16, 4, 128, dtype=bf), torch.randn(4, 16, 4, 128, dtype=bf)
    with Compiler(resources=False) as comp:
        for splits in (1, 4):
            paged_attention_fp8(q, k, v, kc, vc, meta, 128 ** -0.5, num_splits=splits)
    assert comp.failures == [] and {"_decode_split_kernel", "decode_reduce_kernel"} <= {n for n, _ in comp.seen}


def test_mla_prefill_attention_compiles_without_local_memory(tmp_path, monkeypatch):
    """MLA prefill attention at DeepSeek's widths (Dn 128, Dr 64, Dv 128; bf16): every tile the default picks
    (16 .. 64 rows for short steps, 128 past 256) compiles for sm_90 with no local memory, on wgmma from 64 rows
    (Hopper's tensor-core MMA; below it Triton takes mma.sync). Resources come from the local ptxas."""
    from moelora.kernels.mla_prefill import mla_prefill_attention

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    bf, i32 = torch.bfloat16, dict(dtype=torch.int32)
    q, kv = torch.randn(8, 16, 192, dtype=bf), torch.randn(8, 16, 256, dtype=bf)
    k_rope = torch.randn(8, 576, dtype=bf)[:, 512:]
    meta = torch.tensor([8], **i32), torch.tensor([0, 8], **i32), torch.tensor([0], **i32)
    with Compiler(resources=True) as comp:
        for max_query_len in (1, 32, 64, 2048):
            mla_prefill_attention(q, kv, k_rope, *meta, 128, 0.1, max_query_len)
    assert comp.failures == []
    found = {dict(c)["BLOCK_M"]: res for (name, c), res in comp.seen.items() if name == "_mla_prefill_kernel"}
    assert set(found) == {16, 32, 64, 128}
    for block_m, res in found.items():
        assert " stack 0" in res and " local 0" in res, f"BLOCK_M {block_m}: {res}"
    wgmma = {dict(c)["BLOCK_M"]: "wgmma.mma_async" in k.asm["ptx"] for (name, c), k in comp.kernels.items()
             if name == "_mla_prefill_kernel"}
    assert wgmma == {16: False, 32: False, 64: True, 128: True}


@pytest.mark.parametrize("model", ["dsv2_lite", "qwen3_30b", "minimax_m2", "glm47_flash"])
def test_engine_launches_compile_for_sm90_in_fp32_and_fp16(model):
    """Every kernel a Triton engine launches (prefill, decode, a cached prefix; two adapters on every site) compiles
    for the H200 in fp32 and fp16 and fits its shared memory: the GPU tests run bf16 engines, and an fp32 engine died
    at its graph capture on a fused-MoE tile of 240 KiB (42nd session)."""
    import compile_check

    with Compiler(resources=False) as comp:
        for dtype in ("float32", "float16"):
            assert compile_check.engine_launches(model, dtype) >= 4  # prefill, decode steps, the cached prefix
    assert comp.failures == [] and comp.too_big == []
    names = {key[0] for key in comp.seen}
    mla = model in ("dsv2_lite", "glm47_flash")  # GLM-4.7-Flash: heads of nope 192, v 256
    attention = {"_mla_split_kernel", "_mla_prefill_kernel", "_absorb_lora_kernel"} if mla else {
        "_decode_split_kernel", "_prefill_kernel", "_qk_norm_rope_kernel"}  # MiniMax: rotary 64 of 128, no head norm
    assert {"gate_up_kernel", "down_kernel", "lora_shrink_kernel", "_lora_shrink_kernel"} | attention <= names, names
    fp32 = {key[0] for key in comp.seen if "float32" in dict(key[1])["dtypes"]
            and not {"float16", "bfloat16"} & set(dict(key[1])["dtypes"])}
    assert {"gate_up_kernel", "down_kernel"} <= fp32, fp32  # the fp32 engine's fused MoE was checked


@pytest.mark.parametrize("model,modes", [("qwen3_30b", ("w8a8", "w8a16")), ("dsv2_lite", ("w8a8",))])
def test_fp8_engine_launches_compile_for_sm90(model, modes):
    """A bf16 engine on FP8 weights (every projection e4m3, 128 x 128 blocks) compiles for the H200: the dense
    `fp8_linear` launches at decode and prefill rows, the fused MoE's FP8 K loops, the norms writing W8A8 rows. The
    W8A8 dots run Hopper's e4m3 wgmma with no operand upcast wherever they are transposed (below 64 rows: the fused
    MoE from 64 weight columns, `fp8_linear` at its 32-row tiles) or have 64 rows; the dense 16-row tiles keep
    mma.sync on f16 (transposed they measured 3-5 % slower, 62nd session)."""
    import compile_check

    with Compiler(resources=False) as comp:
        for mode in modes:
            assert compile_check.engine_launches(model, "bfloat16", mode) >= 4
    assert comp.failures == [] and comp.too_big == []
    w8a8 = {}
    for (name, consts), kernel in comp.kernels.items():
        c = dict(consts)
        if name in ("gate_up_kernel", "down_kernel", "_fp8_linear_kernel") and c.get("A_FP8"):
            ptx = kernel.asm["ptx"]
            w8a8[(name, c["BM"], c["BN"])] = ("f32.e4m3.e4m3" in ptx, "cvt.rn.f16x2.e4m3x2" in ptx)
    assert {"gate_up_kernel", "down_kernel", "_fp8_linear_kernel"} <= {k[0] for k in w8a8}, w8a8
    for (name, bm, bn), (e4m3_mma, upcast) in w8a8.items():
        moe = name != "_fp8_linear_kernel"
        native = bm >= 64 or (bn >= 64 and (moe or bm == 32))
        assert (e4m3_mma, upcast) == (native, not native), (name, bm, bn, e4m3_mma, upcast)
    assert ("_fp8_linear_kernel", 32, 64) in w8a8 and any(k[1] < 64 and k[0] != "_fp8_linear_kernel" for k in w8a8)


def test_engine_check_fails_a_tile_over_shared_memory(monkeypatch):
    """Without the default fused-MoE config's cut to its shared-memory budget, the fp32 engine's 180-token prefill
    takes 3 stages of the 64 x 128 gate_up tile (240 KiB) and the engine check fails, naming it."""
    import compile_check

    import moelora.kernels.moe_config as moe_config

    monkeypatch.setattr(moe_config, "DEFAULT_SMEM_BUDGET", 10 ** 9)
    moe_config._tuned_config.cache_clear()  # configs picked under the real budget (and, after, under this one)
    try:
        with Compiler(resources=False) as comp:
            compile_check.engine_launches("dsv2_lite", "float32")
        assert compile_check.main(["--engine", "dsv2_lite", "--dtypes", "float32"]) == 1
    finally:
        moe_config._tuned_config.cache_clear()
    assert comp.failures == [] and len(comp.too_big) == 1, comp.too_big
    assert comp.too_big[0].startswith("gate_up_kernel(") and "num_stages=3" in comp.too_big[0], comp.too_big
