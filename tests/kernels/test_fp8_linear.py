"""FP8 dense linear (+ multi-LoRA) and the per-token-group activation quantization vs their twins.

Twins: `lora_linear_ref` on the dequantized weight (W8A16; W8A8 with `fake_quantize_groups` on the base GEMM's
input, and within tests/helpers/fp8_bounds.py's `gemm_bound` of the W8A16 twin), and `quant.fp8.quantize_groups`
(bit for bit). The Triton interpreter (3.9) loads, upcasts and multiplies float8_e4m3fn exactly; its fp32 ->
e4m3 cast is wrong across a binade (-125.9 -> -64), which the quantization kernel never relies on (it rounds
to the e4m3 grid itself, `fp8_quant._round_e4m3`), so everything runs under TRITON_INTERPRET=1 at tiny sizes;
the `gpu` cases at the Qwen3-30B-A3B and DeepSeek-V2-Lite projection shapes, M = 1, 8, 64, 512.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

pytestmark = pytest.mark.interp  # `make test` runs it with TRITON_INTERPRET=1 (set before triton is imported)
triton = pytest.importorskip("triton")

from moelora.kernels.args import FP8Rows, split_k_counters  # noqa: E402
from moelora.kernels.fp8_linear import (  # noqa: E402
    Tiles,
    cublas_shapes,
    default_tiles,
    fp8_linear,
    fp8_lora_linear,
    use_cublas,
)
from moelora.kernels.fp8_quant import per_token_group_quant  # noqa: E402
from moelora.kernels.reference import DenseLoRAArgs, lora_linear_ref  # noqa: E402
from moelora.quant.fp8 import (  # noqa: E402
    dequantize_channels,
    dequantize_segments,
    fake_quantize_groups,
    quantize_channels,
    quantize_groups,
    quantize_segments,
)
from tests.helpers.fp8_bounds import gemm_bound  # noqa: E402
from tests.helpers.kernel_env import DEV, gpu_only, interp_only, kernel_test, rel_err  # noqa: E402
from tests.helpers.linear_cases import make_case  # noqa: E402


def fp8_weight(w, segments, block):
    if block:
        q, s = quantize_segments(w, segments)
        return q, s.contiguous(), dequantize_segments(q, s, segments)
    q, s = quantize_channels(w)
    return q, s, dequantize_channels(q, s)


def twin(case, w_deq, act, dtype=torch.float64):
    x, _, b, lora = case
    up = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    lr = lora and DenseLoRAArgs(up(lora.a), up(lora.b), lora.token_slots, lora.slot_ranks, lora.active)
    return lora_linear_ref(up(x), up(w_deq), up(b), lr, partial(fake_quantize_groups, group=128) if act else None)


def run(case, segments, block, act, no_sync=False):
    """The FP8 linear on the case's weight quantized; no_sync: the call under sync debug mode "error"."""
    x, w, b, lora = case
    q, s, w_deq = fp8_weight(w, segments, block)
    x_before = x.clone()
    if no_sync:
        torch.cuda.set_sync_debug_mode("error")  # contract 5
    try:
        got = fp8_lora_linear(x, q, s, b, lora, segments=segments, block=block, quantize_activations=act)
    finally:
        if no_sync:
            torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(x, x_before) and not torch.isnan(got).any()
    return got, w_deq


@interp_only  # fp32 at 1e-5: on the H200 the W8A16 and LoRA dots of fp32 inputs run in TF32 (5e-4..8e-4 seen)
@pytest.mark.parametrize("act", [False, True], ids=["w8a16", "w8a8"])
@pytest.mark.parametrize("block", [True, False], ids=["block", "channel"])
@pytest.mark.parametrize("segments", [(200,), (72, 40, 40)])
@pytest.mark.parametrize("T,ranks", [(9, (8, 0, 3)), (1, ()), (24, (4, 8, 0)), (40, (8, 4))])
def test_fp8_linear_equals_twin(block, segments, T, ranks, act):
    """N_in and segments off the 128 grid (partial scale blocks, each segment blocked on its own), bias,
    mixed adapters with rows on no adapter, ranks below the pool's (40 rows: the default "split" LoRA; 24 rows:
    32-row tiles, where W8A8 runs transposed)."""
    case = make_case(T, 136, sum(segments), ranks, 8, dtype=torch.float32, device=DEV, seed=T)
    got, w_deq = run(case, segments, block, act)
    assert rel_err(got, twin(case, w_deq, act)) <= 1e-5
    if act:  # within the activation rounding's bound of the W8A16 twin
        exact = twin(case, w_deq, False)
        assert torch.all((got.double() - exact).abs() <= gemm_bound(case[0].double(), w_deq.double(), 128) + 1e-5)


@kernel_test
@pytest.mark.parametrize("act", [False, True], ids=["w8a16", "w8a8"])
@pytest.mark.parametrize("split", [2, 3, 8])
@pytest.mark.parametrize("T", [5, 40])
def test_split_k_equals_one_pass_and_repeats_bit_for_bit(T, split, act):
    """Decode's split-K (5 scale blocks in 3 splits leaves a short last one; 8 asks for more splits than blocks):
    one pass over K up to fp32 reassociation, and the same bits on every call into a NaN-filled output (the
    last split sums the partials in split order); the caller's arrival counters, shared by the calls, are back
    at zero after each (one left behind would skip the sum of the next call, leaving its output unwritten). 40
    rows: three row tiles, each with its own counters."""
    x, w, b, _ = make_case(T, 520, 200, (), 8, dtype=torch.float32, device=DEV, seed=split)
    q, s, _ = fp8_weight(w, (136, 64), True)
    counters = torch.zeros(3 * 7, dtype=torch.int32, device=DEV)  # a counter a 16 x 32 tile
    kw = dict(segments=(136, 64), quantize_activations=act, counters=counters)
    one = fp8_linear(x, q, s, b, tiles=Tiles(16, 32, 4, 3, 1), **kw)
    got = [fp8_linear(x, q, s, b, out=torch.full_like(one, float("nan")), tiles=Tiles(16, 32, 4, 3, split), **kw)
           for _ in range(3)]
    assert rel_err(got[0], one) <= 1e-6
    assert all(torch.equal(g, got[0]) for g in got[1:])
    assert counters.count_nonzero() == 0


@kernel_test
def test_group_quant_scales_and_values():
    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(7, 300, generator=g, device=DEV) * torch.logspace(-3, 2, 300, device=DEV)
    x[2] = 0  # an all-zero row: scale 1
    x[3, :4] = torch.tensor([-1e-7, 1e-7, -0.0, 0.0])  # below half the least subnormal: zeros keeping the sign
    q, s = per_token_group_quant(x)
    q_ref, s_ref = quantize_groups(x, 128)
    assert s.shape == (7, 3) and torch.equal(s, s_ref)
    assert q[3, :4].view(torch.uint8).tolist() == [0x80, 0, 0x80, 0]  # -0.0, +0.0 in e4m3 bits
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@kernel_test
def test_group_quant_padded_rows_and_column_major_scales():
    """cuBLAS's layout (`fp8_linear`'s cuBLAS path): rows padded to a multiple as all-zero rows (q 0, s 1), scales
    column-major; the real rows bit for bit the plain call's."""
    g = torch.Generator(device=DEV).manual_seed(1)
    x = torch.randn(7, 300, generator=g, device=DEV) * 5
    q, s = per_token_group_quant(x)
    qp, sp = per_token_group_quant(x, row_multiple=4, col_major_scales=True)
    assert qp.shape == (8, 300) and sp.shape == (8, 3) and sp.stride() == (1, 8)
    assert torch.equal(qp[:7].view(torch.uint8), q.view(torch.uint8)) and torch.equal(sp[:7], s)
    assert qp[7].view(torch.uint8).count_nonzero() == 0 and torch.equal(sp[7], torch.ones(3, device=DEV))


def test_cublas_shapes():
    """The rule `fp8_linear` routes to cuBLAS by: block-scaled W8A8 bf16 prefill rows, whole 128-column K blocks,
    segment bounds on 128-row blocks."""
    ok = dict(T=129, n_in=2048, n_out=5120, segments=(4096, 512, 512), block=True, quantize_activations=True,
              dtype=torch.bfloat16)
    assert cublas_shapes(**ok)
    assert cublas_shapes(**{**ok, "n_out": 2112, "segments": (1536, 576)})  # the last segment may be partial
    assert cublas_shapes(**{**ok, "n_in": 512}) and cublas_shapes(**{**ok, "n_in": 7168})
    for change in (dict(T=128), dict(n_in=576), dict(n_in=2816), dict(n_out=200, segments=(200,)),
                   dict(segments=(4000, 608, 512)), dict(block=False), dict(quantize_activations=False),
                   dict(dtype=torch.float16)):
        assert not cublas_shapes(**{**ok, **change}), change


@kernel_test
# fp32 bit for bit under the interpreter only: on the H200 the two kernels' fp32 y differed (D = 64 and 256; the
# size of the difference not examined); fp16 stayed bit for bit there
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=interp_only), torch.float16])
@pytest.mark.parametrize("D,with_delta", [(300, True), (256, False), (64, True)])
def test_norm_fp8_is_the_norm_then_the_group_quantization(D, with_delta, dtype):
    """`norm_fp8` (the decoder's RMSNorm writing the W8A8 GEMMs' input already quantized): h and y as
    add_rms_norm / rms_norm give them, and its q / s bit for bit per_token_group_quant(y) (a partial last group
    at D = 300 and 64)."""
    from moelora.kernels.norm import add_rms_norm, norm_fp8, rms_norm

    g = torch.Generator().manual_seed(D)
    x = (torch.randn(6, D, generator=g) * torch.logspace(-2, 1, D)).to(dtype).to(DEV)
    delta = torch.randn(6, D, generator=g).to(dtype).to(DEV) if with_delta else None
    w = (1 + 0.2 * torch.randn(D, generator=g)).to(DEV)
    h, y, rows = norm_fp8(x, delta, w, 1e-6)
    h_ref, y_ref = add_rms_norm(x, delta, w, 1e-6) if with_delta else (x, rms_norm(x, w, 1e-6))
    assert torch.equal(h, h_ref) and torch.equal(y, y_ref)
    q, s = per_token_group_quant(y)
    assert torch.equal(rows.s, s) and torch.equal(rows.q.view(torch.uint8), q.view(torch.uint8))
    if with_delta:  # two deltas (routed, shared): the one-delta call on their sum, rounded to the dtype first
        d2 = (torch.randn(6, D, generator=g) * 0.01).to(dtype).to(DEV)
        h2, y2, rows2 = norm_fp8(x, delta, w, 1e-6, delta2=d2)
        h_ref, y_ref, rows_ref = norm_fp8(x, delta + d2, w, 1e-6)
        assert torch.equal(h2, h_ref) and torch.equal(y2, y_ref) and torch.equal(rows2.s, rows_ref.s)
        assert torch.equal(rows2.q.view(torch.uint8), rows_ref.q.view(torch.uint8))


@kernel_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("T,inter", [(5, 300), (3, 2816), (2, 64), (0, 128)])
def test_silu_mul_fp8_is_silu_mul_then_the_group_quantization(T, inter, dtype):
    """`silu_mul_fp8` (a dense MLP's activation writing the W8A8 down projection's input already quantized): h as
    silu_mul gives it, and its q / s bit for bit per_token_group_quant(h): partial last groups (300, 64), a
    program of 1024 columns ending inside a group (2816), gate and up the halves of one gate_up tensor."""
    check_silu_mul_fp8(T, inter, dtype, DEV)


def check_silu_mul_fp8(T: int, inter: int, dtype: torch.dtype, device) -> None:
    from moelora.kernels.silu_mul import silu_mul, silu_mul_fp8

    g = torch.Generator().manual_seed(inter + T)
    gate_up = (torch.randn(T, 2 * inter, generator=g) * 3 * torch.logspace(-2, 1, 2 * inter)).to(dtype).to(device)
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    h, rows = silu_mul_fp8(gate, up)
    assert torch.equal(h, silu_mul(gate, up))
    q, s = per_token_group_quant(h)
    assert rows.s.shape == s.shape and torch.equal(rows.s, s)
    assert torch.equal(rows.q.view(torch.uint8), q.view(torch.uint8))


@kernel_test
def test_fp8_linear_refusals():
    x, w, b, _ = make_case(3, 130, 64, (), 8, dtype=torch.float32, device=DEV)
    q, s, _ = fp8_weight(w, (64,), True)
    with pytest.raises(ValueError, match="scale must be contiguous fp32"):
        fp8_linear(x, q, s[:, :1], b, segments=(64,))
    with pytest.raises(ValueError, match="segments must be"):
        fp8_linear(x, q, s, b, segments=(32, 16))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_linear(x, w, s, b, segments=(64,))
    with pytest.raises(ValueError, match=r"counters must be int32 \[>= 2\]"):  # 2 tiles of 32 columns
        fp8_linear(x, q, s, b, segments=(64,), tiles=Tiles(16, 32, 4, 3, 2),
                   counters=torch.zeros(1, dtype=torch.int32, device=DEV))


@pytest.mark.parametrize("n_out", [64, 200, 576, 5120, 6144])
def test_layer_counters_cover_every_default_split_k_launch(n_out):
    """A layer's `split_k_counters(n_out)` holds a counter for each tile of every split-K launch `default_tiles`
    picks (a launch finding too few would refuse mid-decode)."""
    have = split_k_counters(n_out).numel()
    for T in range(1, 513):
        for n_in in (128, 512, 2048, 4096):
            t = default_tiles(T, n_out, n_in)
            if t.split_k > 1 and n_in > 128:
                assert -(-T // t.bm) * -(-n_out // t.bn) <= have, (T, n_in, t)


QWEN3 = {"qkv": (2048, (4096, 512, 512)), "o": (4096, (2048,))}
DSV2_LITE = {"q": (2048, (3072,)), "kv_a": (2048, (576,)), "kv_b": (512, (4096,)), "o": (2048, (2048,)),
             "shared_gate_up": (2048, (2816, 2816)), "shared_down": (2816, (2048,))}
SHAPES = [(f"qwen3_{k}", *v) for k, v in QWEN3.items()] + [(f"dsv2_lite_{k}", *v) for k, v in DSV2_LITE.items()]


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("T", [1, 8, 64, 512])
@pytest.mark.parametrize("inter", [1408, 2816, 10944])  # DeepSeek-V2-Lite: an expert, the shared two, layer 0
def test_gpu_silu_mul_fp8_bf16(T, inter):
    """`silu_mul_fp8` compiled for the GPU, bf16: h is silu_mul's and q / s per_token_group_quant(h)'s, bit for
    bit (the compiler must not fold h's rounding away before the quantization reads it)."""
    check_silu_mul_fp8(T, inter, torch.bfloat16, "cuda")


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("T", [1, 8, 24, 64, 131, 512])  # 24: W8A8 transposed; 131, 512: cuBLAS's W8A8
@pytest.mark.parametrize("name,n_in,segments", SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("act", [False, True], ids=["w8a16", "w8a8"])
def test_gpu_fp8_linear(T, name, n_in, segments, act):
    """8 adapters of rank <= 16 (some rows on none), bias on q/k/v; bf16 against the fp32 twin (W8A16), and
    W8A8 within the activation rounding's bound of the W8A16 twin plus the bf16 tolerance."""
    case = make_case(T, n_in, sum(segments), (16, 8, 16, 0, 4, 16, 12, 8), 16, bias=name.endswith("qkv"),
                     dtype=torch.bfloat16, device="cuda", seed=T)
    got, w_deq = run(case, segments, True, act, no_sync=True)
    exact = twin(case, w_deq, False, torch.float32)
    if not act:
        assert rel_err(got, exact) <= 1e-2
        return
    assert rel_err(got, twin(case, w_deq, True, torch.float32)) <= 2e-2
    bound = gemm_bound(case[0].float(), w_deq.float(), 128)
    excess = ((got.float() - exact).abs() - bound).clamp(min=0)
    assert excess.norm() / exact.norm() <= 1e-2


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("T", [129, 130, 131, 132, 1003, 4096])
@pytest.mark.parametrize("name,n_in,segments", [SHAPES[0], SHAPES[3]], ids=[SHAPES[0][0], SHAPES[3][0]])
@pytest.mark.parametrize("given", [False, True], ids=["quantized_here", "x_fp8"])
def test_gpu_fp8_linear_cublas_equals_triton(T, name, n_in, segments, given):
    """The cuBLAS path (no tiles: `use_cublas` holds for these) against the Triton kernel (its tiles named) on the
    same rows, bias on q/k/v: the same sums but for their order; x_fp8 from the producer (transposed scales at a
    multiple of 4 rows, quantized again, padded, elsewhere) or quantized here."""
    g = torch.Generator(device="cuda").manual_seed(T)
    n_out = sum(segments)
    x = torch.randn(T, n_in, generator=g, device="cuda").to(torch.bfloat16)
    q, s = quantize_segments(torch.randn(n_out, n_in, generator=g, device="cuda") * 0.02, segments)
    b = torch.randn(n_out, generator=g, device="cuda").to(torch.bfloat16) if name.endswith("qkv") else None
    kw = dict(segments=segments, quantize_activations=True, x_fp8=FP8Rows(*per_token_group_quant(x)) if given else None)
    assert use_cublas(x, n_out, segments, True, True)
    got = fp8_linear(x, q, s.contiguous(), b, **kw)
    want = fp8_linear(x, q, s.contiguous(), b, tiles=default_tiles(T, n_out, n_in), **kw)
    assert got.shape == (T, n_out) and got.is_contiguous() and not torch.isnan(got).any()
    assert rel_err(got, want) <= 1e-3
    if T % 4 == 0:  # into the caller's out
        out = torch.full_like(want, float("nan"))
        assert fp8_linear(x, q, s.contiguous(), b, out=out, **kw).data_ptr() == out.data_ptr()
        assert torch.equal(out, got)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("T", [1, 8, 64, 512])
def test_gpu_group_quant_bit_exact(T):
    g = torch.Generator(device="cuda").manual_seed(T)
    x = (torch.randn(T, 2112, generator=g, device="cuda") * 3).to(torch.bfloat16)
    q, s = per_token_group_quant(x)
    q_ref, s_ref = quantize_groups(x, 128)
    assert torch.equal(s, s_ref)
    bad = (q.view(torch.uint8) != q_ref.view(torch.uint8)).nonzero()[:8].tolist()
    v = [(float(x[i, j]), float(x[i, j].float() / s[i, j // 128]), float(q[i, j]), float(q_ref[i, j])) for i, j in bad]
    assert not bad, f"(x, x / s, kernel q, twin q) where q differs: {v}"
