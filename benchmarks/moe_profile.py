"""Per-kernel device time of one fused_moe call (torch.profiler, eager, warm; not L2-flushed).

Shape legend: M tokens; shapes and LoRA variants as in moe_lora_layer.py.
Usage: python benchmarks/moe_profile.py [shape:M:variant[~order][:shrink mode] ...]  (default: a few
       decode/prefill points; the order: the rows' slots as `make_lora`'s, interleaved unless given; the mode: the
       routed-LoRA path instead of the tuned config's, at every pool width)
Prints, per point, each kernel's mean device time in microseconds: where the layer's time goes.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from moe_bench_common import SHAPES, make_inputs, make_layer, make_lora, moe_call  # noqa: E402

from moelora.kernels.moe_config import tuned_fused_moe_config  # noqa: E402

DEFAULT = ["qwen3_30b_a3b:1:off", "qwen3_30b_a3b:1:8ad_r16", "qwen3_30b_a3b:32:8ad_r16",
           "qwen3_30b_a3b:512:off", "qwen3_30b_a3b:512:8ad_r16", "mixtral_8x7b:1:off"]


def main(points):
    layers = {}
    for point in points:
        sname, m, var, *mode = point.split(":")
        var, _, order = var.partition("~")
        layer = layers.setdefault(sname, make_layer(SHAPES[sname], pool_ranks=(16, 64, 8)))
        x, wts, ids = make_inputs(layer, int(m))
        shape = SHAPES[sname]
        cfg = tuned_fused_moe_config(shape["E"], shape["H"], shape["I"], int(m), shape["K"], torch.bfloat16,
                                     torch.cuda.get_device_name())
        if mode:
            cfg = cfg.on_path(mode[0])
        fn = moe_call(layer, x, wts, ids, make_lora(layer, int(m), var, order or "interleaved"), cfg)
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        reps = 20
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                fn()
            torch.cuda.synchronize()
        per = defaultdict(float)
        for ev in prof.key_averages():
            if ev.self_device_time_total > 0:
                per[ev.key.split("(")[0][:40]] += ev.self_device_time_total / reps
        total = sum(per.values())
        parts = "  ".join(f"{k} {v:.1f}" for k, v in sorted(per.items(), key=lambda kv: -kv[1]))
        print(f"{point:28s} total {total:7.1f} us | {parts}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or DEFAULT)
