"""Shared pieces of the MoE kernel benchmark and tuner: shapes, inputs, LoRA pools, timing, bounds.

Shape legend: T (= M) tokens, H hidden, I expert intermediate, E experts, K top-k, S slots, R rank.
Timing: CUDA-graph replay of one whole MoE call (plan included), median of triton's do_bench,
which zeroes a 256 MB buffer between runs (L2 flushed). Ceilings measured in the same process.
"""

from __future__ import annotations

import csv
import dataclasses
import sys
from pathlib import Path

import torch
import triton

# the repository's package first (as decode.py does), so the tuner and the MoE benchmarks run from a checkout where
# moelora is not installed (a bare GPU machine): without it tune_fused_moe.py stopped at this module's first import
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from moelora.kernels.args import ExpertLoRAArgs  # noqa: E402
from moelora.kernels.fp8_moe import FP8ExpertScales, fp8_moe_config  # noqa: E402
from moelora.kernels.fused_moe import fused_moe  # noqa: E402
from moelora.kernels.moe_config import tuned_fused_moe_config  # noqa: E402
from moelora.kernels.side_stream import lora_stream  # noqa: E402
from moelora.quant.fp8 import quantize_blocks, quantize_segments  # noqa: E402

SHAPES = {
    "qwen3_30b_a3b": dict(E=128, K=8, H=2048, I=768),
    "dsv2_lite": dict(E=64, K=6, H=2048, I=1408),
    "mixtral_8x7b": dict(E=8, K=2, H=4096, I=14336),
}
MS = (1, 8, 32, 128, 512, 4096)
# name -> (adapters spread over tokens, pool max rank, adapter rank); "_eager": the call carries the batch's
# width (`ExpertLoRAArgs.width`, the engine's `LoRABatch.max_rank`), as the engine's eager forwards (prefill,
# mixed steps) do; without it the kernels tile at the pool's rank, as its captured decode graphs do
LORA_VARIANTS = {
    "off": (0, 0, 0),
    "1ad_r16": (1, 16, 16),
    "8ad_r16": (8, 16, 16),
    "8ad_r64": (8, 64, 64),
    "8ad_r8": (8, 8, 8),
    "8ad_r8_pool64": (8, 64, 8),
    "8ad_r8_pool64_eager": (8, 64, 8),
}
SLOTS = 8


@dataclasses.dataclass
class Layer:
    shape: dict
    w_gu: torch.Tensor
    w_d: torch.Tensor
    pools: dict  # pool max rank -> (gate_up_a, gate_up_b, down_a, down_b)
    route_rows: dict = dataclasses.field(default_factory=dict)  # fused_moe's per-route plan rows, as a layer keeps
    fp8: FP8ExpertScales | None = None  # e4m3 w_gu / w_d with 128 x 128 block scales (`fp8_layer`)


# --dtype of the benchmarks: the weights and, for FP8, whether activations are quantized (W8A8)
DTYPES = {"bf16": None, "fp8": False, "fp8a8": True}


def fp8_layer(layer: Layer, quantize_activations: bool) -> Layer:
    """`layer` with its expert weights quantized to e4m3 in 128 x 128 blocks (gate and up apart), LoRA pools
    shared; W8A8 kernels if quantize_activations, else W8A16."""
    inter = layer.shape["I"]
    q_gu, s_gu = quantize_segments(layer.w_gu, (inter, inter))
    q_d, s_d = quantize_blocks(layer.w_d)
    scales = FP8ExpertScales(s_gu.contiguous(), s_d.contiguous(), block=True, quantize_activations=quantize_activations)
    return dataclasses.replace(layer, w_gu=q_gu, w_d=q_d, route_rows={}, fp8=scales)


def layer_config(layer: Layer, M: int, gpu: str):
    """The config serving picks for this layer's shape, dtype and M (`fused_moe` with config=None)."""
    sh = layer.shape
    if layer.fp8 is not None:
        return fp8_moe_config(sh["E"], sh["H"], sh["I"], M, sh["K"], torch.bfloat16, gpu, None,
                              layer.fp8.quantize_activations)
    return tuned_fused_moe_config(sh["E"], sh["H"], sh["I"], M, sh["K"], torch.bfloat16, gpu, None)


def make_layer(shape: dict, pool_ranks=(8, 16, 64), seed=0, device="cuda") -> Layer:
    g = torch.Generator(device=device).manual_seed(seed)
    E, H, inter = shape["E"], shape["H"], shape["I"]

    def rn(*s, scale):
        return (torch.randn(*s, generator=g, device=device) * scale).to(torch.bfloat16)

    pools = {}
    for r in pool_ranks:
        pools[r] = (rn(SLOTS, E, r, H, scale=H ** -0.5), rn(SLOTS, E, 2 * inter, r, scale=r ** -0.5),
                    rn(SLOTS, E, r, inter, scale=inter ** -0.5), rn(SLOTS, E, H, r, scale=r ** -0.5))
    return Layer(shape, rn(E, 2 * inter, H, scale=H ** -0.5), rn(E, H, inter, scale=inter ** -0.5), pools)


def make_inputs(layer: Layer, M: int, seed=0):
    dev = layer.w_gu.device
    g = torch.Generator(device=dev).manual_seed(seed + M)
    E, K, H = layer.shape["E"], layer.shape["K"], layer.shape["H"]
    x = torch.randn(M, H, generator=g, device=dev).to(torch.bfloat16)
    logits = torch.randn(M, E, generator=g, device=dev)
    w, ids = torch.softmax(logits, dim=-1).topk(K, dim=-1)
    return x, (w / w.sum(-1, keepdim=True)).to(torch.bfloat16), ids.to(torch.int32)


ORDERS = ("interleaved", "grouped", "last")


def make_lora(layer: Layer, M: int, variant: str, order: str = "interleaved"):
    """The variant's LoRA args over M tokens, n adapters spread evenly (`ORDERS`): interleaved (token t on slot
    t % n, as decode requests arrive in the engine's batches), grouped (t * n // M: rows ordered by adapter, as a
    chunk of n prompts is) or last (every token on the pool's last slot: a prefill chunk of one prompt on the
    adapter loaded last, as most of a many-adapter prefill is)."""
    n_ad, pool_r, rank = LORA_VARIANTS[variant]
    if n_ad == 0:
        return None
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    ga, gb, da, db = layer.pools[pool_r]
    t = torch.arange(M, device=layer.w_gu.device)
    slots = {"interleaved": t % n_ad, "grouped": t * n_ad // M, "last": torch.full_like(t, SLOTS - 1)}[order]
    slots = slots.to(torch.int32)
    ranks = torch.full((SLOTS,), rank, dtype=torch.int32, device=layer.w_gu.device)
    if rank < pool_r:  # the pool's convention: zeros beyond the slot's rank
        ga, gb, da, db = ga.clone(), gb.clone(), da.clone(), db.clone()
        for t in (ga[:, :, rank:], gb[..., rank:], da[:, :, rank:], db[..., rank:]):
            t.zero_()
    return ExpertLoRAArgs(ga, gb, da, db, slots, ranks, ranks, active=(),
                          width=rank if variant.endswith("_eager") else None)


def bytes_bound(layer: Layer, x, ids, lora) -> int:
    """Fewest bytes: distinct experts' weights (1 byte each in FP8, + their fp32 block scales) + distinct
    (adapter, expert) LoRA A/B + x and out."""
    E, H, inter = layer.shape["E"], layer.shape["H"], layer.shape["I"]
    flat = ids.reshape(-1).long()
    per_expert = 3 * H * inter * layer.w_gu.element_size()
    if layer.fp8 is not None:
        per_expert += 4 * (layer.fp8.gate_up[0].numel() + layer.fp8.down[0].numel())
    n = len(torch.unique(flat)) * per_expert + 2 * x.numel() * 2
    if lora is not None:
        tok_slot = lora.token_slots.long().repeat_interleave(ids.shape[1])
        pairs = torch.unique(tok_slot * E + flat)
        rank = int(lora.gate_up_ranks[0])
        n += len(pairs) * rank * (H + 2 * inter + inter + H) * 2
    return n


def graph_time_ms(fn, rep=40) -> float:
    fn()  # compile and warm outside capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return triton.testing.do_bench(g.replay, warmup=5, rep=rep, return_mode="median")


def eager_time_ms(fn, rep=40) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=rep, return_mode="median")


def moe_call(layer: Layer, x, wts, ids, lora, config=None, side_stream=None, pdl: bool = False):
    """The layer call to time; `side_stream`: the LoRA side stream the engine gives it (overlap_lora,
    `side_stream.lora_stream`); `pdl`: launches with programmatic dependent launch, as the engine's (EngineConfig.pdl,
    on by default; off on GPUs without it)."""
    out = torch.empty_like(x)
    return lambda: fused_moe(x, layer.w_gu, layer.w_d, wts, ids, lora=lora, out=out, config=config,
                             side_stream=side_stream, route_rows=layer.route_rows, fp8=layer.fp8, pdl=pdl)


def bench_side_stream(off: bool):
    """The LoRA side stream the engine hands a layer on this GPU (`side_stream.lora_stream`, overlap_lora), or None
    with `--no-side-stream`."""
    return None if off else lora_stream(torch.device("cuda", torch.cuda.current_device()))


def copy_gbps() -> float:
    a = torch.randn(256 * 2 ** 20, device="cuda")  # 1 GiB
    b = torch.empty_like(a)
    t = triton.testing.do_bench(lambda: b.copy_(a), warmup=10, rep=100, return_mode="median")
    return 2 * a.numel() * 4 / (t * 1e-3) / 1e9


def matmul_tflops(n=8192) -> float:
    p = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    t = triton.testing.do_bench(lambda: p @ q, warmup=25, rep=200, return_mode="median")
    return 2 * n ** 3 / (t * 1e-3) / 1e12


def measure_ceilings() -> tuple[float, float]:
    """(copy GB/s counting read + write, bf16 matmul TFLOP/s), both on random data."""
    return copy_gbps(), matmul_tflops()


def write_rows(path, rows: list[dict]) -> None:
    """Rows (dicts of one shape) as a CSV with a header."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
