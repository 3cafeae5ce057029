"""Benchmark: MLA's kv_b_proj LoRA kernels (`kernels.mla_lora`) at DeepSeek-V2-Lite's decode shapes, every tile.

Shape legend: T tokens (one a request in decode), N = 16 heads, Dn = Dv = 128, C = 512 latent columns, 8 adapter
slots of rank 16 (pool width 16), row t on slot t % 8. For each T, each side (absorb: q_abs += (q_nope B_uk) A,
expand: out += (o_lat A^T) B_uv^T) is timed at every tile: 1, 2, 4 heads a program (register sums) and 16 (dots),
each with 1, 2 and 4 output splits; "default" marks `mla_lora.tiles`' pick.

Timing as decode runs it: one CUDA graph of `--layers` launches, each layer on its own LoRA pool (HBM, not L2),
replayed under triton's do_bench (median); the per-launch us is the replay over the launches.

usage: python benchmarks/mla_lora.py [OUT.csv] [--ts 1,8,64,128,256] [--layers 27]
Writes the CSV to the path, else $OUT/mla_lora.csv, else ./mla_lora.csv.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_bench_common import graph_time_ms, write_rows  # noqa: E402

from moelora.kernels.mla_lora import mla_absorb_lora_, mla_expand_lora_, tiles  # noqa: E402

N, DN, DV, C, SLOTS, R = 16, 128, 128, 512, 8, 16
TILES = [(h, s) for h in (1, 2, 4, 16) for s in (1, 2, 4)]


def side_call(side: str, T: int, layers: int, heads: int | None, splits: int | None):
    """A function launching `side` on each of `layers` pools (bf16) for T rows."""
    bf, dev = torch.bfloat16, "cuda"
    pools = [(torch.randn(SLOTS, R, C, dtype=bf, device=dev) * C ** -0.5,
              torch.randn(SLOTS, N * (DN + DV), R, dtype=bf, device=dev) * 0.1) for _ in range(layers)]
    ranks = torch.full((SLOTS,), R, dtype=torch.int32, device=dev)
    slots = (torch.arange(T, device=dev) % SLOTS).to(torch.int32)
    if side == "absorb":
        x, y = torch.randn(T, N, DN, dtype=bf, device=dev), torch.zeros(T, N, C, dtype=bf, device=dev)
        return lambda: [mla_absorb_lora_(y, x, a, b, ranks, slots, R, heads=heads, splits=splits) for a, b in pools]
    x, y = torch.randn(T, N, C, dtype=bf, device=dev), torch.zeros(T, N, DV, dtype=bf, device=dev)
    return lambda: [mla_expand_lora_(y, x, a, b, DN, ranks, slots, R, heads=heads, splits=splits) for a, b in pools]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?")
    ap.add_argument("--ts", default="1,8,64,128,256")
    ap.add_argument("--layers", type=int, default=27)
    args = ap.parse_args(argv)
    rows = []
    for T in (int(t) for t in args.ts.split(",")):
        for side in ("absorb", "expand"):
            pick, times = tiles(T, N, side), {}
            for heads, splits in TILES:
                us = graph_time_ms(side_call(side, T, args.layers, heads, splits)) * 1e3 / args.layers
                times[(heads, splits)] = us
                rows.append(dict(T=T, side=side, heads=heads, splits=splits, us=round(us, 3),
                                 default=(heads, splits) == pick))
            best = min(times, key=times.get)
            print(f"T={T:4d} {side:6s} default {pick} {times[pick]:6.2f} us; best {best} {times[best]:6.2f} us; "
                  + " ".join(f"{h}h/{s}s {t:.2f}" for (h, s), t in times.items()), flush=True)
    out = args.out or os.path.join(os.environ.get("OUT", "."), "mla_lora.csv")
    write_rows(out, rows)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
