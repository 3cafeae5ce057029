"""The routed-expert LoRA delta kernels alone ("route" / "block"), against the bytes they must move.

Shape legend: M tokens, H hidden, I expert intermediate, E experts, K top-k, R rank.
Times one delta launch (gate_up: x [M, H] -> [M*K, 2I]; down: h [P, I] -> [M*K, H]) per config,
CUDA-graph replay, L2 flushed, median, and prints it against two byte counts: the distinct
(adapter, expert) pairs' A and B (what any kernel must read) and the (plan block, adapter) pairs'
(what "block" reads: a pair split over two plan blocks is read twice), plus the delta rows written.
Usage: python benchmarks/moe_lora_delta.py OUT.csv [--shape qwen3_30b_a3b] [--ms 64,256]
                                           [--variants 1ad_r16,8ad_r16]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from moe_bench_common import (  # noqa: E402
    SHAPES,
    copy_gbps,
    graph_time_ms,
    make_inputs,
    make_layer,
    make_lora,
    write_rows,
)

from moelora.kernels.moe_config import tuned_fused_moe_config  # noqa: E402
from moelora.kernels.moe_lora import PATHS, MoECall  # noqa: E402
from moelora.kernels.moe_plan import build_routing_plan  # noqa: E402


def delta_configs() -> dict:
    """name -> the path config of every "route" and "block" trial and refinement the tuner times."""
    out = {}
    for name in ("route", "block"):
        path = PATHS[name]
        for cfg in path.trials(64) + [dataclasses.replace(path.config(), **c) for c in path.refinements]:
            out[name + "/" + ",".join(f"{k}={v}" for k, v in dataclasses.asdict(cfg).items())] = cfg
    return out

def delta_bytes(ids, slots, rank, plan, which, H, inter) -> tuple[int, int]:
    """(distinct (adapter, expert) pairs' A + B bytes, (plan block, adapter) pairs' bytes), bf16,
    plus the delta rows written, for routes on an adapter."""
    M, K = ids.shape
    pair_bytes = 2 * rank * (H + 2 * inter) if which == "gate_up" else 2 * rank * (inter + H)
    n_out = 2 * inter if which == "gate_up" else H
    tok_slot = slots.long().repeat_interleave(K)
    on = tok_slot >= 0
    pairs = torch.unique(torch.stack((tok_slot, ids.reshape(-1).long()))[:, on], dim=1).shape[1]
    n = int(plan.num_padded.item())
    rows = plan.sorted_route_ids[:n].long()
    blk = torch.arange(n, device=rows.device) // plan.block_m
    rslot = tok_slot[rows.clamp(max=M * K - 1)]
    keep = (rows < M * K) & (rslot >= 0)
    block_pairs = torch.unique(torch.stack((blk, rslot))[:, keep], dim=1).shape[1]
    written = int(on.sum()) * n_out * 2
    return pairs * pair_bytes + written, block_pairs * pair_bytes + written


def delta_us(cfg, src, delta, plan, ids, lora, which) -> float:
    """Graph-replay µs of `which`'s delta launch (its kernels only: no base GEMM), rank-16 pools."""
    call = MoECall(src, plan, ids, lora, 16, plan_inter(lora), 64, None)
    path = PATHS[cfg.path](call, cfg)
    return 1e3 * graph_time_ms(lambda: path.delta(src, delta, which), rep=25)


def plan_inter(lora) -> int:
    return lora.down_a.shape[3]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shape", default="qwen3_30b_a3b")
    ap.add_argument("--ms", default="64,256")
    ap.add_argument("--variants", default="1ad_r16,8ad_r16")
    ap.add_argument("--configs", default="", help="';'-separated names of delta_configs() (default: all)")
    ap.add_argument("--rank0", action="store_true", help="also time each launch with every slot's rank 0: "
                    "the same programs, each leaving after its prologue (what launches, lanes and waves cost)")
    ap.add_argument("--orders", default="interleaved", help="row orders of the tokens' slots "
                    "(moe_bench_common.ORDERS): interleaved (decode's, slot t % n), grouped (t * n // M), last")
    args = ap.parse_args(argv)
    shape = SHAPES[args.shape]
    H, inter, E, K = shape["H"], shape["I"], shape["E"], shape["K"]
    bw = copy_gbps()
    configs = delta_configs()
    names = [c for c in args.configs.split(";") if c] or list(configs)
    print(f"# {torch.cuda.get_device_name()}: copy {bw:.0f} GB/s; {args.shape} {shape}", flush=True)
    layer = make_layer(shape, pool_ranks=(16,))
    rows = []
    for M in map(int, args.ms.split(",")):
        base = tuned_fused_moe_config(E, H, inter, M, K, torch.bfloat16, torch.cuda.get_device_name())
        x, _, ids = make_inputs(layer, M)
        plan = build_routing_plan(ids, E, base.block_m)
        P = plan.sorted_route_ids.shape[0]
        h = torch.randn(P, inter, device="cuda").to(torch.bfloat16)
        for variant, order in itertools.product(args.variants.split(","), args.orders.split(",")):
            lora = make_lora(layer, M, variant, order)
            rank = int(lora.gate_up_ranks[0])
            idle = dataclasses.replace(lora, gate_up_ranks=torch.zeros_like(lora.gate_up_ranks),
                                       down_ranks=torch.zeros_like(lora.down_ranks))  # --rank0
            for which, src, n_out in (("gate_up", x, 2 * inter), ("down", h, H)):
                delta = torch.empty(M * K, n_out, dtype=torch.bfloat16, device="cuda")
                pair_b, block_b = delta_bytes(ids, lora.token_slots, rank, plan, which, H, inter)
                for name in names:
                    cfg = configs[name]
                    us = delta_us(cfg, src, delta, plan, ids, lora, which)
                    empty_us = delta_us(cfg, src, delta, plan, ids, idle, which) if args.rank0 else float("nan")
                    bound_us = pair_b / (bw * 1e3)
                    rows.append(dict(shape=args.shape, M=M, variant=variant, order=order, which=which, config=name,
                                     us=us, pair_bytes=pair_b, block_bytes=block_b, bound_us=bound_us,
                                     x_bound=us / bound_us, block_gbps=block_b / (us * 1e3), rank0_us=empty_us))
                    print(f"M={M:4d} {variant:8s} {order[:5]} {which:7s} {name:28s} {us:7.2f} us   "
                          f"pairs {pair_b / 1e6:6.1f} MB "
                          f"(block {block_b / 1e6:6.1f}) bound {bound_us:6.2f} us  x{us / bound_us:5.2f}  "
                          f"{block_b / (us * 1e3):6.0f} GB/s  rank 0: {empty_us:6.2f} us", flush=True)
    write_rows(args.out, rows)


if __name__ == "__main__":
    main()
