"""Compile every fused-MoE launch the tuner can try, for an H200 / H100 (sm_90), on a machine with no GPU.

The interpreter tests (TRITON_INTERPRET=1) run the kernels' Python, so they miss what only the compiler
sees: a loop-carried variable whose shape changes, a constexpr misuse, a tile that needs more shared
memory than the chip has, register spills. This script swaps Triton's driver for one that names an
sm_90 target and turns each launch into a compile (Triton's warmup), then calls fused_moe on CPU
tensors over every registered routed-LoRA path's trials and refinements (moelora.kernels.moe_lora.PATHS,
what benchmarks/tune_fused_moe.py times) on each table entry's tiles, so a kernel that cannot build fails
here before it costs device time.

Usage: python scripts/compile_check.py [--shapes qwen3_30b_a3b,...] [--ms 1,128,4096] [--resources] [--loops]
                                      [--picks] [--fp8] [--gpu "NVIDIA H100 80GB HBM3"]
       python scripts/compile_check.py --engine dsv2_lite,qwen3_30b [--dtypes float32,float16,bfloat16] [--fp8]
  --picks: only the table's own entries (the launches serving makes; a unit test compiles these).
  --gpu: whose table (the name torch.cuda.get_device_name gives; default "NVIDIA H200"); both are sm_90.
  --fp8: also on e4m3 expert weights, W8A16 and W8A8: the table's FP8 entries of each mode (`fp8_moe_config`:
  else the bf16 entry's `fp8_tiles`), with the same LoRA trials; with --engine, also each engine in bf16 with every
  projection in e4m3 (`--quantization fp8`), W8A8 and W8A16 (the dense `fp8_linear` launches, the norms and SwiGLU
  writing W8A8 rows).
  --resources: print each kernel's registers and local memory (spills) from its cubin (cuobjdump; the
  local Triton's ptxas, which may differ from the GPU machine's).
  --loops: print the kernels with a loop that waits on memory every step in the sm_90 TTGIR (`loop_waits`): a
  synchronous tensor load, or at 3+ stages an `async_wait` of every copy in flight (num 0), as the paged-cache
  gathers did whose addresses come from a load of the same step (60th session). A listed loop is not a measured
  cost: the gathers' block-table rows carried a step ahead (num 0 -> 2), and the W8A8 scales so carried, ran level
  or slower on an H100 (61st session, performance.md's "Tried and removed").
Exit status 1 if any launch failed to compile; tiles that need more shared memory than sm_90 has are
listed (the tuner tries some and skips them there) but do not fail the check.
--engine: instead, every launch a Triton engine makes (`engine_launches`: decode.py's shapes with their dense layers
  and one MoE layer, in each of --dtypes, serving prefill, decode and a cached prefix with two adapters on every
  site); here a kernel over sm_90's shared memory fails the check too: the engine has no smaller tile to fall back on
  (an fp32 engine died at its graph capture on a 240 KiB fused-MoE tile, 42nd session).
Expert counts are cut to 16 (no kernel specialises on E), so the weights fit a laptop. Not covered: the
TMA variant (its descriptors are made by the driver of a real GPU): its entries compile without TMA.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # the compiler, not the interpreter
import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from moe_bench_common import MS, SHAPES, fp8_layer, make_inputs, make_layer, make_lora  # noqa: E402

from moelora.kernels.fp8_moe import FP8ExpertScales, fp8_moe_config  # noqa: E402
from moelora.kernels.fused_moe import fused_moe  # noqa: E402
from moelora.kernels.moe_config import tuned_fused_moe_config  # noqa: E402
from moelora.kernels.moe_lora import PATHS  # noqa: E402

SM90_SHARED = 232448  # bytes of shared memory one H100 / H200 program may use
GPU_NAME = "NVIDIA H200"  # --gpu's default


class SM90Driver:
    """The few driver calls a JIT launch makes, answered for an absent sm_90 GPU."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def __getattr__(self, name):  # anything else would need a real GPU
        raise RuntimeError(f"compile_check: the fake sm_90 driver has no {name}")


class Compiler:
    """Every launch of a JIT kernel becomes a compile; results keyed by (kernel, constexprs)."""

    def __init__(self, resources: bool):
        self.resources = resources
        self.seen: dict[tuple, str] = {}
        self.kernels: dict[tuple, object] = {}  # the compiled kernels (asm["ttgir"], asm["ptx"]), same keys
        self.failures: list[str] = []
        self.too_big: list[str] = []

    def __enter__(self):
        self._run = JITFunction.run
        compiler = self

        def run(fn, *args, grid, warmup, **kwargs):
            dtypes = tuple(str(a.dtype).removeprefix("torch.") for a in (*args, *kwargs.values())
                           if isinstance(a, torch.Tensor))
            try:
                kernel = compiler._run(fn, *args, grid=grid, warmup=True, **kwargs)
            except Exception as exc:  # noqa: BLE001 - every compile error is a finding
                compiler.record(fn, kwargs, None, f"{type(exc).__name__}: {exc}", dtypes)
                return None
            compiler.record(fn, kwargs, kernel, None, dtypes)
            return kernel

        JITFunction.run = run
        triton.runtime.driver.set_active(SM90Driver())
        return self

    def __exit__(self, *exc):
        JITFunction.run = self._run
        triton.runtime.driver._active = None  # reset_active() would look for a real driver

    def record(self, fn, kwargs, kernel, error, dtypes=()):
        """`dtypes`: of the launch's tensor arguments (one kernel compiles once per dtype signature)."""
        names = {p.name for p in fn.params if p.is_constexpr} | {"num_warps", "num_stages"}
        consts = tuple(sorted((k, v) for k, v in kwargs.items() if k in names))
        key = (fn.__name__, consts + ((("dtypes", dtypes),) if dtypes else ()))
        if key in self.seen:
            return
        what = f"{fn.__name__}({', '.join(f'{k}={v}' for k, v in consts)}) on {'/'.join(dict.fromkeys(dtypes))}"
        if error is None and kernel.metadata.shared > SM90_SHARED:  # a tile the tuner tries and skips
            self.too_big.append(f"{what}: {kernel.metadata.shared} bytes of shared memory (sm_90: {SM90_SHARED})")
        if error is not None:
            self.failures.append(f"{what}\n    {error.splitlines()[0][:300]}\n" + _located(error))
            self.seen[key] = "FAIL"
            return
        self.seen[key] = f"shared {kernel.metadata.shared}" + (_resources(kernel) if self.resources else "")
        self.kernels[key] = kernel


def _located(error: str) -> str:
    """The compiler's 'at L:C' excerpt, indented, when it gave one."""
    lines = error.splitlines()
    return "".join(f"      {ln}\n" for ln in lines[1:12]) if len(lines) > 1 else ""


def _resources(kernel) -> str:
    """' regs N local L stack S' of the kernel's cubin (cuobjdump -res-usage; LOCAL > 0: spills)."""
    import triton.backends.nvidia as nvidia

    tool = Path(nvidia.__file__).parent / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        res = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True, check=False)
    finally:
        os.unlink(f.name)
    found = re.search(r"REG:(\d+) STACK:(\d+) .*LOCAL:(\d+)", res.stdout)
    return f" regs {found.group(1)} local {found.group(3)} stack {found.group(2)}" if found else " regs ?"


def loop_waits(ttgir: str) -> list[tuple[int, int | None]]:
    """Per `scf.for` loop of a kernel's TTGIR, in order: (synchronous tensor loads in its body, the smallest
    `num` of its `async_wait`s or None); nested loops count in their own entry. A step waits on a synchronous
    load, and on every async copy in flight at num 0 (the pipeline's depth then is one step, whatever
    num_stages)."""
    loops, stack, depth = [], [], 0
    for line in ttgir.splitlines():
        if "scf.for " in line:
            stack.append((depth, len(loops)))
            loops.append([0, None])
        elif stack:
            entry = loops[stack[-1][1]]
            if "= tt.load " in line and ": tensor<" in line:
                entry[0] += 1
            wait = re.search(r"async_wait .*\{num = (\d+)", line)
            if wait:
                entry[1] = int(wait.group(1)) if entry[1] is None else min(entry[1], int(wait.group(1)))
        depth += line.count("{") - line.count("}")
        while stack and depth <= stack[-1][0]:
            stack.pop()
    return [tuple(e) for e in loops]


def configs_for(shape: dict, M: int, picks_only: bool = False, fp8: FP8ExpertScales | None = None,
                gpu: str = GPU_NAME):
    """(base from `gpu`'s table, then on its tiles every registered path's trials and each of its refinements
    on the path's default config, at every pool width); picks_only: the table's entry alone. fp8: the
    table's entry for those FP8 weights and activation mode (`fp8_moe_config`), else the bf16 one."""
    args = (shape["E"], shape["H"], shape["I"], M, shape["K"], torch.bfloat16, gpu)
    base = (tuned_fused_moe_config(*args) if fp8 is None
            else fp8_moe_config(*args, None, fp8.quantize_activations))
    cfgs = [base]
    for path in () if picks_only else PATHS.values():
        cfgs += [base.with_lora(t) for t in path.trials(base.block_m)]
        cfgs += [base.with_lora(dataclasses.replace(path.config(), **change)) for change in path.refinements]
    return [dataclasses.replace(c, use_tma=False) for c in cfgs]  # TMA descriptors need a real GPU


# Requests of `engine_launches`: decode rows on two adapters and none, and a prefill of 180 tokens in one step: over
# 64 routes an expert at 16 experts top-6 (the fused MoE's largest tiles), then a prompt on the 300 cached tokens.
ENGINE_PROMPTS = ((40, "a0"), (7, None), (130, "a1"), (3, "a0"))


def engine_launches(name: str, dtype: str, fp8: str | None = None) -> int:
    """Serve ENGINE_PROMPTS on a Triton engine of decode.py's MODELS[name] (its dense layers and one MoE layer, 16
    experts, a 1024-token vocab; adapters of rank 16 and 8 on every site) in `dtype` on the CPU, 3 tokens a
    request, then a request on a cached prefix: under a `Compiler` every launch compiles for sm_90 and none runs
    (the outputs are whatever the buffers held). fp8 "w8a8" / "w8a16": every projection in e4m3 with 128 x 128
    block scales (`--quantization fp8`; the weights left zero). -> engine steps taken."""
    from decode import MODELS, random_adapter

    from moelora.config import ModelConfig
    from moelora.engine.config import EngineConfig
    from moelora.engine.engine import LLMEngine
    from moelora.engine.request import SamplingParams
    from moelora.layers.options import LayerOptions
    from moelora.models.registry import model_class
    from moelora.quant.config import FP8Config

    if fp8 not in (None, "w8a8", "w8a16"):
        raise ValueError(f"fp8 must be None, 'w8a8' or 'w8a16', got {fp8!r}")
    spec = MODELS[name]
    cfg = ModelConfig(**{**spec, "num_layers": spec.get("first_k_dense_replace", 0) + 1, "num_experts": 16,
                         "vocab_size": 1024}).resolve()
    quant = fp8 and dataclasses.replace(FP8Config.from_engine("fp8"), quantize_activations=fp8 == "w8a8")
    torch.manual_seed(0)
    model = model_class(cfg)(cfg, max_loras=2, max_rank=16, options=LayerOptions(kernel_backend="triton"),
                             dtype=getattr(torch, dtype), quant=quant)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and p.dtype != torch.float8_e4m3fn:
                p.normal_(0, 0.02)
    adapters = {"a0": random_adapter(model, "a0", 16, 0), "a1": random_adapter(model, "a1", 8, 1)}
    os.environ["TRITON_INTERPRET"] = "1"  # the config's CUDA check passes as for the interpreter tests ...
    try:
        ecfg = EngineConfig(device="cpu", dtype=dtype, kernel_backend="triton", max_loras=2, max_lora_rank=16,
                            max_num_seqs=8, max_model_len=512, num_kv_blocks=128, block_size=16,
                            quantization=fp8 and "fp8", fp8_activation_quant=fp8 and fp8 == "w8a8").resolve(cfg)
    finally:
        os.environ.pop("TRITON_INTERPRET")  # ... but the kernels stay the compiler's (jitted without it)
    eng = LLMEngine(model.with_options(ecfg.layer_options(model.options)), None, ecfg, lambda n, path: adapters[n])
    for n in adapters:
        eng.pool.add(n, n)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    steps = 0
    for wave in (ENGINE_PROMPTS, ((ENGINE_PROMPTS[2][0] + 20, "a1"),)):  # the second: 130 cached tokens + 20
        for length, adapter in wave:
            eng.add_request(list(range(5, 5 + length)), params, adapter)
        while eng.has_unfinished():
            eng.step()
            steps += 1
    return steps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--resources", action="store_true")
    ap.add_argument("--loops", action="store_true", help="list the loops that wait on memory every step")
    ap.add_argument("--picks", action="store_true", help="only the table's own entries (what serving runs)")
    ap.add_argument("--fp8", action="store_true", help="also on FP8 expert weights (W8A16 and W8A8); with --engine, "
                    "also each engine in bf16 on FP8 weights, W8A8 and W8A16")
    ap.add_argument("--gpu", default=GPU_NAME, help="the GPU whose table's entries to compile (an sm_90 one)")
    ap.add_argument("--engine", default=None, help="instead: every launch of an engine of these decode.py shapes")
    ap.add_argument("--dtypes", default="float32,float16,bfloat16", help="--engine's model dtypes")
    args = ap.parse_args(argv)
    with Compiler(args.resources) as comp:
        runs = [(n, d, None) for n in args.engine.split(",") for d in args.dtypes.split(",")] if args.engine else []
        if args.engine and args.fp8:
            runs += [(n, "bfloat16", mode) for n in args.engine.split(",") for mode in ("w8a8", "w8a16")]
        for name, dtype, fp8 in runs:
            n_before = len(comp.seen)
            steps = engine_launches(name, dtype, fp8)
            what = f"{dtype} FP8 {fp8}" if fp8 else dtype
            print(f"engine {name} {what}: {steps} steps, {len(comp.seen) - n_before} new kernels, "
                  f"{len(comp.failures)} failures, {len(comp.too_big)} too big so far", flush=True)
        for name in () if args.engine else args.shapes.split(","):
            shape = dict(SHAPES[name])
            small = dict(shape, E=min(shape["E"], 16))
            layer = make_layer(small, pool_ranks=(16, 64), device="cpu")
            layers = [layer] + ([fp8_layer(layer, act) for act in (False, True)] if args.fp8 else [])
            for M in map(int, args.ms.split(",")):
                x, wts, ids = make_inputs(layer, M)
                loras = [make_lora(layer, M, v) for v in ("1ad_r16", "8ad_r16", "8ad_r64")]
                n_before = len(comp.seen)
                launches = [(c, la, lo) for la in layers for c in configs_for(shape, M, args.picks, la.fp8, args.gpu)
                            for lo in loras]
                for cfg, lay, lora in launches:
                    fused_moe(x, lay.w_gu, lay.w_d, wts, ids, lora=lora, out=torch.empty_like(x), config=cfg,
                              fp8=lay.fp8)
                print(f"{name} M={M}: {len(comp.seen) - n_before} new kernels, {len(comp.failures)} failures so far",
                      flush=True)
        if args.resources:
            for (fn, consts), res in sorted(comp.seen.items()):
                print(f"  {fn} {res}  {dict(consts)}")
        if args.loops:
            for (fn, consts), kernel in sorted(comp.kernels.items(), key=lambda kv: str(kv[0])):
                loops = loop_waits(kernel.asm["ttgir"])
                deep = kernel.metadata.num_stages >= 3  # launches without the option compile at Triton's 3
                if any(sync or (deep and num == 0) for sync, num in loops):
                    print(f"  {fn}: (synchronous loads, smallest async_wait num) per loop {loops}  {dict(consts)}")
    for f in comp.too_big:
        print("TOO BIG (the tuner skips it)", f)
    for f in comp.failures:
        print("FAIL", f)
    print(f"{len(comp.seen)} kernels compiled for sm_90, {len(comp.failures)} failed, {len(comp.too_big)} too big")
    return 1 if comp.failures or (args.engine and comp.too_big) else 0


if __name__ == "__main__":
    sys.exit(main())
