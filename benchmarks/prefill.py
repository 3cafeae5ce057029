"""Whole-engine prefill throughput of a Qwen3-30B-A3B- or DeepSeek-V2-Lite-shaped model (random bf16 weights).

The model of `benchmarks/decode.py` (`model_with_adapters`; --layers N keeps a run short; --quantization fp8
[--no-fp8-activation-quant]: its projections in FP8, as decode.py's) and its no-LoRA twin over the same weights, each in
an engine with prefix caching off and, by default, the engine's default graphs (--cuda-graphs piecewise: the decode
graphs and the piecewise graphs, which replay steps of up to --piecewise-tokens, default the engine's 2048, within the
chunk; decode: the decode graphs only, which the --itl decodes replay; off: eager). At each prompt length (--prompts,
default 512 / 2048 / 8192), `--tokens` prompt tokens a run (--tokens / length random prompts, fresh ones every run) are
prefilled with one token each, chunked as the scheduler chunks them (--chunk: max_num_batched_tokens, default 2048, the
engine's own below 70 GiB of GPU memory, 8192 above; a list: an engine pair each, over the same weights): no LoRA, 1
adapter, and 8 adapters of rank 16 spread over the requests. After an untimed warm-up run of each, the three run in
turns for --repeats rounds (median; `moelora.bench.time_prefill`: wall clock from adding the requests to the last token,
one device sync at the end). Prints tokens/s, the % of the bf16 matmul peak measured here, and LoRA's ratio to no LoRA;
writes a CSV.

FLOPs of a prompt token (`prefill_flops`, the base model only, so a LoRA run's % is lower by what LoRA
costs): per layer the attention projections (`decode.attention_shapes`), attention itself (a token at
position i attends to i + 1 keys: over a prompt of P, N (D_qk + D_v) (P + 1) a token, causal), the routed
experts (K 3 H I 2) and the router (2 H E) plus the shared experts on sparse layers, the dense MLP on dense
layers; and the LM head of the one sampled row a prompt (2 H V / P). Norms, rotary and the softmax are left
out (< 1%).

--itl N: afterwards, `benchmarks/prefill_itl.py` at each --itl-chunk (default --chunk): N requests decode
while --itl-prompts prompts of --itl-len arrive; the decodes' inter-token latency (p50 / p99) and the prefill's
tokens/s beside them, no LoRA and 8 adapters (the default chunk size's evidence; a CSV OUT_itl.csv).

--profile: afterwards, `benchmarks/prefill_profile.py` over a few prefill steps at --profile-len (default
2048; --profile-tokens, default 4096, prompt tokens a run; the first --chunk) of each workload: GPU time by
kernel category, host time vs GPU time per forward, syncs, the middle layer kernel by kernel, the host's hot
functions.

usage: python benchmarks/prefill.py OUT.csv [--model qwen3_30b|dsv2_lite] [--layers N] [--quantization fp8]
       [--prompts 512,2048,8192] [--tokens 16384] [--chunk 2048[,8192]] [--repeats 2] [--no-async-scheduling]
       [--no-overlap-lora] [--cuda-graphs piecewise|decode|off [--piecewise-tokens 2048]]
       [--moe-table TABLE.json] [--plan-max-routes 16384]
       [--itl 32 [--itl-chunk 2048,4096,8192] [--itl-len 8192] [--itl-prompts 4] [--itl-decode-len 256]
       [--itl-quiet 10]]
       [--profile [--profile-len 2048] [--profile-tokens 4096] [--profile-workloads "8 adapters"]
       [--profile-out OUT.txt] [--trace DIR]]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, __file__.rsplit("/", 2)[0])
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from decode import (  # noqa: E402
    MODELS,
    add_quant_args,
    attention_shapes,
    engine,
    model_with_adapters,
    no_lora_twin,
    quant_from_args,
    quant_name,
    tee,
)
from moe_bench_common import matmul_tflops, write_rows  # noqa: E402

from moelora.bench import random_prompts, time_prefill  # noqa: E402
from moelora.config import ModelConfig  # noqa: E402
from moelora.engine.config import EngineConfig  # noqa: E402

RANK = 16
WORKLOADS = ("no LoRA", "1 adapter", "8 adapters")


def attention_flops(cfg: ModelConfig, prompt_len: int) -> float:
    """FLOPs of one layer's attention itself (scores and values) per token of a causal prompt of prompt_len."""
    if cfg.attention == "mla":
        d_qk, d_v = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    else:
        d_qk = d_v = cfg.head_dim
    return cfg.num_heads * (d_qk + d_v) * (prompt_len + 1)


def prefill_flops(cfg: ModelConfig, prompt_len: int) -> float:
    """FLOPs a prompt token of a prompt of `prompt_len` costs the base model (see the module docstring)."""
    H, E = cfg.hidden_size, cfg.num_experts
    attn = 2 * sum(i * o for i, o in attention_shapes(cfg)) + attention_flops(cfg, prompt_len)
    shared = cfg.shared_experts_intermediate_size or cfg.shared_expert_intermediate_size or 0
    sparse = 2 * 3 * H * (cfg.top_k * cfg.moe_intermediate_size + shared) + 2 * H * E
    dense = 2 * 3 * H * cfg.intermediate_size
    n_sparse = len(cfg.sparse_layers)
    layers = cfg.num_layers * attn + n_sparse * sparse + (cfg.num_layers - n_sparse) * dense
    return layers + 2 * H * cfg.vocab_size / prompt_len


def plan_runs(prompts: list[int], tokens: int) -> dict[int, int]:
    """Prompt length -> requests a run (`tokens` / length, at least 1)."""
    return {p: max(1, tokens // p) for p in prompts}


# --cuda-graphs: what the engines capture (off: eager, as the prefill measurements before piecewise graphs)
GRAPHS = ("off", "decode", "piecewise")


def graphs_kw(graphs: str, piecewise_tokens: int = EngineConfig.piecewise_graph_tokens) -> dict:
    """The engine config fields of a --cuda-graphs choice."""
    if graphs == "off":
        return dict(enforce_eager=True)
    return dict(enforce_eager=False, piecewise_graph_tokens=piecewise_tokens if graphs == "piecewise" else 0)


def build_engines(name: str, layers: int | None, runs: dict[int, int], chunks: list[int],
                  extra: tuple[int, int] = (0, 0), quant=None, **engine_kw):
    """(model config, chunk -> [(workload, engine, adapter names)]): per chunk size (max_num_batched_tokens)
    the LoRA engine (8 slots of rank 16) and the no-LoRA twin's engine, over one model's weights, each with
    room for the largest run's KV blocks and no decode graphs. (The LoRA engines of two chunk sizes write the
    same slots of the one model: a1..a7 carry a0's tensors, and every engine fills its slots in the same
    order, so each slot holds the same values whichever engine wrote it last.) `extra`: (sequences, KV blocks)
    beyond the largest run (the --itl run's); `quant`: an FP8 scheme (--quantization fp8) or None."""
    longest = max(runs)
    max_len = longest + 16
    cfg, model, adapters = model_with_adapters(name, layers, 8, RANK, max_positions=max_len, distinct=False,
                                               quant=quant)
    twin = no_lora_twin(model, cfg, quant)
    blocks = max(n * -(-(p + 1) // 16) for p, n in runs.items()) + 64 + extra[1]
    seqs = max(runs.values()) + extra[0]
    out = {}
    for chunk in chunks:
        kw = {**dict(max_model_len=max_len, num_kv_blocks=blocks, enable_prefix_caching=False, enforce_eager=True,
                     max_num_batched_tokens=chunk), **engine_kw}  # engine_kw may turn graphs on (--cuda-graphs)
        lora_eng = engine(model, cfg, 8, RANK, seqs, adapters, **kw)
        base_eng = engine(twin, cfg, 0, 0, seqs, {}, **kw)
        out[chunk] = [("no LoRA", base_eng, [None]), ("1 adapter", lora_eng, ["a0"]),
                      ("8 adapters", lora_eng, list(adapters))]
    return cfg, out


def measure(engines, runs: dict[int, int], repeats: int, vocab: int) -> dict[tuple[str, int], tuple[float, int]]:
    """(workload, prompt length) -> (median seconds, steps) of a run; warm-up runs first, then turns."""
    out: dict[tuple[str, int], list[tuple[float, int]]] = {}
    t0 = time.perf_counter()
    for p, n in runs.items():
        print(f"# {time.perf_counter() - t0:.0f} s: {n} prompts of {p}", flush=True)  # progress, not in the table
        for k, (_, eng, names) in enumerate(engines):  # warm-up: compiles, first-use buffers
            time_prefill(eng, random_prompts(n, p, vocab, seed=-1 - p * 10 - k), names)
        for rnd in range(repeats):
            for k, (label, eng, names) in enumerate(engines):
                prompts = random_prompts(n, p, vocab, seed=(p * 1000 + rnd) * 10 + k)
                out.setdefault((label, p), []).append(time_prefill(eng, prompts, names))
    return {key: (statistics.median(t for t, _ in v), v[0][1]) for key, v in out.items()}


def report(cfg: ModelConfig, name: str, runs: dict[int, int], times: dict, peak: float, log) -> list[dict]:
    """The table (logged) and the CSV rows; `times`: chunk -> `measure`'s result."""
    log(f"{'chunk':>5} {'prompt':>6} {'reqs':>4} {'steps':>5} {'workload':<10} {'ms':>9} {'tokens/s':>10} "
        f"{'GFLOP/tok':>9} {'TFLOP/s':>8} {'% peak':>7} {'vs noLoRA':>9}")
    rows = []
    for chunk, by_run in times.items():
        for p, n in runs.items():
            flops = prefill_flops(cfg, p)
            for label in WORKLOADS:
                t, steps = by_run[(label, p)]
                tps = n * p / t
                tflops = tps * flops / 1e12
                ratio = tps / (n * p / by_run[("no LoRA", p)][0])
                log(f"{chunk:>5} {p:>6} {n:>4} {steps:>5} {label:<10} {t * 1e3:9.1f} {tps:10.0f} {flops / 1e9:9.3f} "
                    f"{tflops:8.1f} {100 * tflops / peak:7.1f} {ratio:9.3f}")
                rows.append(dict(model=name, layers=cfg.num_layers, chunk=chunk, prompt_len=p, requests=n,
                                 steps=steps, config=label, ms=t * 1e3, tokens_per_s=tps, gflop_per_token=flops / 1e9,
                                 tflops=tflops, pct_peak=100 * tflops / peak, vs_nolora=ratio))
    return rows


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--model", default="qwen3_30b", choices=list(MODELS))
    ap.add_argument("--layers", type=int, default=0, help="layers of the model to build (0: all)")
    ap.add_argument("--prompts", default="512,2048,8192")
    ap.add_argument("--tokens", type=int, default=16384, help="prompt tokens a run")
    ap.add_argument("--chunk", default="2048", help="max_num_batched_tokens; a list (2048,8192): an engine pair each")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-async-scheduling", action="store_true")
    ap.add_argument("--no-overlap-lora", action="store_true", help="EngineConfig.overlap_lora=False")
    ap.add_argument("--cuda-graphs", default="piecewise", choices=list(GRAPHS),
                    help="the engines' CUDA graphs: decode and piecewise graphs (the engine's default), decode graphs "
                    "only, or off (eager)")
    ap.add_argument("--piecewise-tokens", type=int, default=EngineConfig.piecewise_graph_tokens,
                    help="--cuda-graphs piecewise: EngineConfig.piecewise_graph_tokens (steps up to min(chunk, N))")
    ap.add_argument("--moe-table", default=None, help="EngineConfig.fused_moe_table: a fused-MoE table file")
    ap.add_argument("--plan-max-routes", type=int, default=0, help="A/B hook: the most routes the routing plan "
                    "builds in one launch (kernels.moe_plan; 0: as shipped)")
    ap.add_argument("--itl", type=int, default=0, help="then N requests decode while long prompts arrive: their "
                    "inter-token latency per chunk size (prefill_itl.py; 0: off)")
    ap.add_argument("--itl-chunk", default=None, help="--itl's chunk sizes (default --chunk)")
    ap.add_argument("--itl-len", type=int, default=8192, help="--itl: the arriving prompts' length")
    ap.add_argument("--itl-prompts", type=int, default=4, help="--itl: prompts arriving at once")
    ap.add_argument("--itl-decode-len", type=int, default=256, help="--itl: the decoding requests' prompt length")
    ap.add_argument("--itl-quiet", type=int, default=10, help="--itl: decode steps timed before the prompts arrive")
    ap.add_argument("--profile", action="store_true", help="then profile prefill steps (prefill_profile.py)")
    ap.add_argument("--profile-workloads", default=",".join(WORKLOADS), help="--profile: the workloads profiled")
    ap.add_argument("--profile-len", type=int, default=2048)
    ap.add_argument("--profile-tokens", type=int, default=4096, help="prompt tokens a profiled run")
    ap.add_argument("--profile-out", default=None, help="the profile's text (default: OUT.csv's stem + _profile.txt)")
    ap.add_argument("--trace", default=None, help="--profile: a directory for Chrome traces of the profiled steps")
    add_quant_args(ap)
    args = ap.parse_args()
    args.quant = quant_from_args(ap, args)
    return args


def main() -> None:
    args = parse_args()
    prompts = [int(p) for p in args.prompts.split(",")]
    if min(prompts) < 2 or args.tokens < 1 or args.repeats < 1:
        raise SystemExit("--prompts must be >= 2 tokens each, --tokens and --repeats >= 1")
    runs = plan_runs(prompts, args.tokens)
    if args.profile:
        runs[args.profile_len] = max(runs.get(args.profile_len, 1), args.profile_tokens // args.profile_len)
    profiled = args.profile_workloads.split(",")
    if not set(profiled) <= set(WORKLOADS):
        raise SystemExit(f"--profile-workloads takes {', '.join(WORKLOADS)}")
    chunks = [int(c) for c in args.chunk.split(",")]
    itl_chunks = [int(c) for c in (args.itl_chunk or args.chunk).split(",")]
    extra = (0, 0)
    if args.itl:
        if min(itl_chunks) <= args.itl or min(args.itl_len, args.itl_prompts, args.itl_decode_len, args.itl_quiet) < 1:
            raise SystemExit("--itl needs every chunk above it and positive --itl-len / -prompts / -decode-len "
                             "/ -quiet")
        runs[args.itl_len] = max(runs.get(args.itl_len, 1), args.itl_prompts)
        extra = (args.itl, args.itl * -(-(args.itl_decode_len + 64) // 16))  # the decodes: ~40 tokens each a run
    if args.plan_max_routes:
        import moelora.kernels.moe_plan as moe_plan

        moe_plan._PER_EXPERT_MAX_ROUTES = args.plan_max_routes  # this process only: an A/B of the threshold
    lines, log = tee()
    t0 = time.perf_counter()
    peak = matmul_tflops()
    cfg, by_chunk = build_engines(args.model, args.layers or None, runs, sorted(set(chunks + itl_chunks)), extra,
                                  quant=args.quant, async_scheduling=not args.no_async_scheduling,
                                  overlap_lora=not args.no_overlap_lora,
                                  fused_moe_table=args.moe_table, **graphs_kw(args.cuda_graphs, args.piecewise_tokens))
    print(f"# model and engines built in {time.perf_counter() - t0:.0f} s", flush=True)
    log(f"GPU {torch.cuda.get_device_name()}, bf16 matmul peak {peak:.0f} TFLOP/s; {args.model} shape, "
        f"{cfg.num_layers} layers, {quant_name(args.quant)}; chunk (max_num_batched_tokens) {args.chunk}, "
        f"prefix caching off, {args.repeats} rounds" + (", overlap_lora off" if args.no_overlap_lora else "")
        + (f", fused-MoE table {args.moe_table}" if args.moe_table else "")
        + (f", CUDA graphs {args.cuda_graphs}" if args.cuda_graphs != "off" else "")
        + (f" up to {args.piecewise_tokens} tokens" if args.cuda_graphs == "piecewise" else "")
        + (f", one-launch routing plan up to {args.plan_max_routes} routes" if args.plan_max_routes else ""))
    timed = {p: n for p, n in runs.items() if p in prompts}
    vocab = min(1000, cfg.vocab_size)
    times = {chunk: measure(by_chunk[chunk], timed, args.repeats, vocab) for chunk in chunks}
    write_rows(args.out, report(cfg, args.model, timed, times, peak, log))
    text = args.profile_out or args.out.rsplit(".", 1)[0] + ("_profile.txt" if args.profile else ".txt")
    write_text(text, lines)  # now, and again after each part: a run stopped during one keeps what came before
    if args.itl:
        from prefill_itl import itl_workloads

        rows = itl_workloads({c: by_chunk[c] for c in itl_chunks}, args.itl, args.itl_decode_len, args.itl_len,
                             args.itl_prompts, args.itl_quiet, args.repeats, vocab, log)
        write_rows(args.out.rsplit(".", 1)[0] + "_itl.csv", rows)
        write_text(text, lines)
    if args.profile:
        from prefill_profile import profile_workloads

        if args.trace:
            Path(args.trace).mkdir(parents=True, exist_ok=True)  # the profiler's trace writer does not create it
        profile_workloads([e for e in by_chunk[chunks[0]] if e[0] in profiled], args.profile_len,
                          max(1, args.profile_tokens // args.profile_len),
                          min(1000, cfg.vocab_size), log, args.trace)
        write_text(text, lines)


def write_text(path: str, lines: list[str]) -> None:
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
