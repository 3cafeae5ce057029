"""What one prefill forward launches, counted on the CPU: Triton launches, ATen ops and host time, per layer
and per step, with no LoRA, 1 adapter and 8 adapters.

A prefill step of the whole engine at 2048-token chunks is bound by the host (docs/performance.md): each
Triton launch costs ~50-100 us of Python on the host, each ATen op ~5-20 us. The counts are the same on the
CPU under the Triton interpreter as on the GPU, so this measures them where no GPU is: a tiny Qwen3-MoE-shaped
model (`--model dsv2`: DeepSeek-V2-Lite-shaped, MLA and shared experts; random weights, fp32) on
`kernel_backend="triton"`, one engine with 8 adapter slots of rank `--rank`
and its no-LoRA twin; `--prompts` prompts of `--len` tokens prefilled in one chunk. The rows are not grouped by
slot (`group_lora_rows=False`: a 2048-row step is past the 1024 rows the dense policy groups, and the tiny
shapes take the "split" dense mode as the real ones do at 2048 rows), so a few rows launch what 2048 do on the
GPU and the interpreter stays quick (more than `split.ROWS_MAX` rows: up to it the dense LoRA takes decode's
row kernels).
The MoE takes the H200 table's pick for Qwen3-30B-A3B (DeepSeek-V2-Lite) at `--moe-m` tokens (a table for the
tiny shape is written with that entry), so the routed-LoRA path is the one the GPU runs.

Counted inside `runner.run` of the prefill's forward (the first step): Triton launches by kernel
(`JITFunction.run`, or the interpreter's `InterpretedFunction.run`), ATen ops by name outside those launches
(a `TorchDispatchMode`; what the interpreter does inside a launch is not counted), and the host's time outside
the launches (under the interpreter the launches themselves run the kernels: that time says nothing). Each is
split between the decoder layers (per layer: the mean over layers) and the rest of the step (embedding, the
step's LoRA plan, the LM head).

--piecewise: the same step also through the piecewise graphs (`engine/piecewise_graphs.py`, their replays stubbed):
the launches the host still makes (each layer's attention, eager between the pieces) and its host time beside the
eager runner's on that step.

usage: TRITON_INTERPRET=1 python benchmarks/launch_count.py [--model qwen3|dsv2] [--prompts 4] [--len 40]
       [--layers 2] [--rank 16] [--moe-m 4096] [--top 12] [--piecewise] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, __file__.rsplit("/", 2)[0])
sys.path.insert(0, __file__.rsplit("/", 1)[0])

from moelora.config import ModelConfig  # noqa: E402
from moelora.engine.config import EngineConfig  # noqa: E402
from moelora.engine.engine import LLMEngine  # noqa: E402
from moelora.engine.request import SamplingParams  # noqa: E402
from moelora.kernels.moe_config import CONFIG_DIR, shape_key  # noqa: E402
from moelora.models.registry import model_class  # noqa: E402

# --model: the tiny model (random weights, fp32) and the H200 table's shape whose entry its MoE takes
TINY = {
    "qwen3": (dict(family="qwen3_moe", vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=16, intermediate_size=128, moe_intermediate_size=32, num_experts=8, top_k=2,
                   norm_topk_prob=True, qk_norm="per_head", max_position_embeddings=4096, dtype="float32"),
              "E=128,H=2048,I=768,dtype=bfloat16"),
    # DeepSeek-V2-Lite's layout: MLA without q_lora, greedy top k, two shared experts; every layer MoE
    "dsv2": (dict(family="deepseek_v2", vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4,
                  head_dim=24, intermediate_size=128, moe_intermediate_size=32, num_experts=8, top_k=2,
                  norm_topk_prob=False, attention="mla", q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
                  qk_rope_head_dim=8, v_head_dim=16, topk_method="greedy", routed_scaling_factor=1.0,
                  n_shared_experts=2, first_k_dense_replace=0, rope_interleave=True, max_position_embeddings=4096,
                  dtype="float32"),
             "E=64,H=2048,I=1408,dtype=bfloat16"),
}
WORKLOADS = ("no LoRA", "1 adapter", "8 adapters")


class Tally:
    """Counts of one forward, split by scope ("layer" inside a decoder layer, else "step")."""

    def __init__(self):
        self.launches = {"layer": Counter(), "step": Counter()}
        self.ops = {"layer": Counter(), "step": Counter()}
        self.host_s = {"layer": 0.0, "step": 0.0}
        self.calls = {"layer": 0, "step": 0}  # Python and C function calls outside the launches
        self.scope, self.in_launch, self.launch_s, self.active = "step", False, 0.0, False


class _Ops(TorchDispatchMode):
    def __init__(self, tally: Tally):
        super().__init__()
        self.tally = tally

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        t = self.tally
        if t.active and not t.in_launch:
            t.ops[t.scope][func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting_launches(tally: Tally, run_kernels: bool = True):
    """While open, every Triton launch (JITFunction.run, InterpretedFunction.run) is counted and timed;
    `run_kernels` False: counted and skipped (the host path is the same: no host branch on a tensor value)."""
    import triton.runtime.interpreter as interp
    import triton.runtime.jit as jit

    patched = []
    for cls in (jit.JITFunction, getattr(interp, "InterpretedFunction", None)):
        if cls is None or "run" not in vars(cls):
            continue
        real = cls.run

        def run(self, *a, _real=real, **kw):
            if not tally.active or tally.in_launch:
                return _real(self, *a, **kw)
            name = getattr(getattr(self, "fn", None), "__name__", None) or getattr(self, "__name__", "?")
            tally.launches[tally.scope][name] += 1
            tally.in_launch, t0 = True, time.perf_counter()
            try:
                return _real(self, *a, **kw) if run_kernels else None
            finally:
                tally.launch_s += time.perf_counter() - t0
                tally.in_launch = False

        cls.run = run
        patched.append((cls, real))
    try:
        yield
    finally:
        for cls, real in patched:
            cls.run = real


@contextlib.contextmanager
def layer_scopes(model, tally: Tally):
    """Mark the decoder layers' calls as scope "layer" and add their host time outside launches."""
    state = {}

    def pre(mod, args):
        tally.scope = "layer"
        state["t"], state["l"] = time.perf_counter(), tally.launch_s

    def post(mod, args, out):
        tally.host_s["layer"] += time.perf_counter() - state["t"] - (tally.launch_s - state["l"])
        tally.scope = "step"

    hooks = [h for layer in model.model.layers for h in (layer.register_forward_pre_hook(pre),
                                                             layer.register_forward_hook(post))]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def count_forward(eng, prompts, names, run_kernels: bool = True, ops: bool = True) -> Tally:
    """The tally of the first forward of prefilling `prompts` (one chunk) on adapters `names` in turn
    (`run_kernels` False: the Triton kernels are skipped, so the host time is the launchers' Python alone;
    `ops` False: ATen ops not counted, the dispatch mode's own cost kept out of that time)."""
    tally = Tally()
    run = eng.runner.run

    def profile(frame, event, arg):
        if event in ("call", "c_call") and not tally.in_launch:
            tally.calls[tally.scope] += 1

    def counted(*a, **kw):
        if tally.active or tally.host_s["step"]:  # only the first forward
            return run(*a, **kw)
        tally.active, t0, l0 = True, time.perf_counter(), tally.launch_s
        if ops:
            sys.setprofile(profile)
        try:
            return run(*a, **kw)
        finally:
            sys.setprofile(None)
            tally.active = False
            total = time.perf_counter() - t0 - (tally.launch_s - l0)
            tally.host_s["step"] = max(1e-9, total - tally.host_s["layer"])

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    eng.runner.run = counted
    try:
        with counting_launches(tally, run_kernels), layer_scopes(eng.model, tally), \
                (_Ops(tally) if ops else contextlib.nullcontext()):
            reqs = [eng.add_request(p, params, names[i % len(names)]) for i, p in enumerate(prompts)]
            while not all(r.finished for r in reqs):
                eng.step()
    finally:
        eng.runner.run = run
    return tally


def tiny_engines(layers: int, rank: int, moe_m: int, table_dir: str, max_seqs: int, max_len: int,
                 model_name: str = "qwen3"):
    """The LoRA engine (8 slots of `rank`, adapters a0..a7 on every site) and its no-LoRA twin (same weights)."""
    from decode import no_lora_twin, random_adapter

    tiny, table_key = TINY[model_name]
    cfg = ModelConfig(**{**tiny, "num_layers": layers}).resolve()
    table = json.loads((CONFIG_DIR / "fused_moe_nvidia_h200.json").read_text())
    entry = table["configs"][table_key][str(moe_m)]
    entry["tiles"]["use_tma"] = False  # the interpreter has no TMA; the same launches either way
    path = Path(table_dir) / "tiny_table.json"
    path.write_text(json.dumps({"device": "tiny", "configs": {shape_key(8, 64, 32, torch.float32): {"1": entry}}}))
    torch.manual_seed(0)
    model = model_class(cfg)(cfg, max_loras=8, max_rank=rank, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0, 0.3 if name.endswith("mlp.gate.weight") else 0.02)
    model.eval()
    adapters = {f"a{i}": random_adapter(model, f"a{i}", rank, i) for i in range(8)}
    engines = []
    for m, n_slots, ads in ((no_lora_twin(model, cfg), 0, {}), (model, 8, adapters)):
        ecfg = EngineConfig(device="cpu", dtype="float32", kernel_backend="triton", max_loras=n_slots,
                            max_lora_rank=rank if n_slots else 0, max_num_seqs=max_seqs, block_size=16,
                            max_model_len=max_len, max_num_batched_tokens=max(2048, max_seqs * max_len),
                            num_kv_blocks=max_seqs * -(-max_len // 16) + 8,
                            enable_prefix_caching=False, group_lora_rows=False,
                            fused_moe_table=str(path)).resolve(cfg)
        eng = LLMEngine(m.with_options(ecfg.layer_options(m.options)), None, ecfg, lambda n, p, a=ads: a[n])
        for name in ads:
            eng.pool.add(name, name)
        engines.append(eng)
    return cfg, engines[0], engines[1], list(adapters)


def host_times(eng, prompts, names, runs: int, layers: int) -> dict:
    """Median host ms of a layer and of the rest of a forward over `runs` forwards with the kernels skipped."""
    torch.set_flush_denormal(True)  # the skipped kernels leave uninitialized outputs: no slow denormal math on them
    tallies = [count_forward(eng, prompts, names, run_kernels=False, ops=False) for _ in range(runs)]
    return dict(py_layer_ms=statistics.median(t.host_s["layer"] for t in tallies) / layers * 1e3,
                py_step_ms=statistics.median(t.host_s["step"] for t in tallies) * 1e3)


class _NoReplay:
    """A captured piece that replays nothing (`--piecewise`: the host's work around the replays is measured)."""

    def replay(self) -> None:
        pass


def _stubbed_capture():
    return lambda fn: (_NoReplay(), fn())


def piecewise_host(eng, prompts, names, runs: int) -> dict:
    """The prefill step of `prompts` (adapters `names` in turn) through the piecewise graphs (one bucket, the step's
    tokens; `engine/piecewise_graphs.py`) with their replays stubbed and the Triton kernels skipped: the launches
    the host still makes a forward (each layer's attention) and, over `runs` forwards, the median host ms of it
    and of the eager runner on the same step (graph replays, ~10 us of host each on a GPU, not included)."""
    from moelora.engine.piecewise_graphs import PiecewiseGraphs
    from moelora.engine.request import Request, Status
    from moelora.engine.scheduler import ScheduledStep

    alloc, bs = eng.cache.allocator, eng.cache.block_size
    reqs = [Request(f"pw{i}", p, SamplingParams(), names[i % len(names)], status=Status.RUNNING)
            for i, p in enumerate(prompts)]
    for r in reqs:
        r.block_ids = [alloc.allocate() for _ in range(-(-len(r.prompt_ids) // bs))]
    pad = alloc.reserve()
    skipped, counted = Tally(), Tally()  # every launch skipped (an active tally's); one forward's counted
    skipped.active = counted.active = True
    try:
        with counting_launches(skipped, run_kernels=False):
            pieces = PiecewiseGraphs(eng.model, eng.cache, sum(map(len, prompts)), pad, eng.runner.needs,
                                     capture=_stubbed_capture)
            pieces.capture(eng.lora_idle, eng._graph_width)
            inputs = eng.runner.prepare(ScheduledStep(reqs, [len(p) for p in prompts], []),
                                        eng.pool.acquire(r.adapter for r in reqs), eng.pool.slot_ranks)
        with counting_launches(counted, run_kernels=False):
            pieces.run(inputs)
        with counting_launches(skipped, run_kernels=False):
            ms = {}
            for name, fn in (("eager", lambda: eng.runner.run(inputs)), ("piecewise", lambda: pieces.run(inputs))):
                fn()
                times = []
                for _ in range(runs):
                    t0 = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - t0)
                ms[name] = statistics.median(times) * 1e3
    finally:
        for r in reqs:
            for b in r.block_ids:
                alloc.free(b)
    return dict(piecewise_launches=dict(counted.launches["step"]), eager_ms=ms["eager"],
                piecewise_ms=ms["piecewise"])


def report(label: str, tally: Tally, layers: int, top: int, log) -> dict:
    per_layer = {k: sum(c.values()) / layers for k, c in (("launches", tally.launches["layer"]),
                                                          ("ops", tally.ops["layer"]))}
    step = {"launches": sum(tally.launches["step"].values()), "ops": sum(tally.ops["step"].values())}
    calls = tally.calls["layer"] / layers
    log(f"{label}: a layer {per_layer['launches']:.1f} Triton launches, {per_layer['ops']:.1f} ATen ops, {calls:.0f} "
        f"Python calls; the rest of the forward {step['launches']} launches, {step['ops']} ops, "
        f"{tally.calls['step']} calls")
    for scope, div in (("layer", layers), ("step", 1)):
        log(f"  {scope} launches: " + ", ".join(f"{k} {v / div:g}" for k, v in tally.launches[scope].most_common()))
        log(f"  {scope} ops: " + ", ".join(f"{k} {v / div:g}" for k, v in tally.ops[scope].most_common(top)))
    return dict(workload=label, layer_launches=per_layer["launches"], layer_ops=per_layer["ops"], layer_calls=calls,
                step_launches=step["launches"], step_ops=step["ops"], step_calls=tally.calls["step"],
                launches={s: dict(c) for s, c in tally.launches.items()},
                ops={s: dict(c) for s, c in tally.ops.items()})


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3", choices=tuple(TINY))
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--len", type=int, default=40, help="tokens a prompt (all prefilled in one step)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--moe-m", type=int, default=4096, choices=(1, 8, 32, 128, 256, 512, 4096),
                    help="the H200 table's entry (the --model's shape) the tiny MoE takes")
    ap.add_argument("--top", type=int, default=12, help="ATen ops listed a scope")
    ap.add_argument("--host-runs", type=int, default=5, help="forwards timed with the kernels skipped (0: none)")
    ap.add_argument("--piecewise", action="store_true",
                    help="also the step through piecewise graphs (replays stubbed): its launches and host ms")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        raise SystemExit("run under TRITON_INTERPRET=1 on the CPU")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cfg, base, lora, names = tiny_engines(args.layers, args.rank, args.moe_m, tmp, args.prompts, args.len + 8,
                                              args.model)
        g = torch.Generator().manual_seed(1)
        print(f"{args.model}: {args.prompts} prompts of {args.len} tokens in one prefill forward "
              f"({args.prompts * args.len} rows), {args.layers} layers, rank {args.rank}, MoE entry M={args.moe_m}")
        for label, eng, ads in (("no LoRA", base, [None]), ("1 adapter", lora, names[:1]), ("8 adapters", lora, names)):
            count_forward(eng, torch.randint(0, 500, (args.prompts, args.len), generator=g).tolist(), ads)  # warm
            prompts = torch.randint(0, 500, (args.prompts, args.len), generator=g).tolist()
            row = report(label, count_forward(eng, prompts, ads), cfg.num_layers, args.top, print)
            if args.host_runs:
                row.update(host_times(eng, prompts, ads, args.host_runs, cfg.num_layers))
                print(f"  host Python with the kernels skipped (median of {args.host_runs}): a layer "
                      f"{row['py_layer_ms']:.3f} ms, the rest of the forward {row['py_step_ms']:.3f} ms")
            if args.piecewise:
                row.update(piecewise_host(eng, prompts, ads, max(1, args.host_runs)))
                print(f"  piecewise graphs (replays stubbed): launches a forward {row['piecewise_launches']}; host ms "
                      f"a forward with the kernels skipped: eager {row['eager_ms']:.3f}, piecewise "
                      f"{row['piecewise_ms']:.3f}")
            rows.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
