"""Decode throughput of a Qwen3-30B-A3B- or DeepSeek-V2-Lite-shaped model (random bf16 weights) on one GPU.

Concurrency 1..256 with no LoRA (an engine without LoRA slots, over the same weight tensors), 1
adapter, and 8 adapters of rank 16 spread over the requests (an engine with 8 slots). Both engines
live side by side and, per concurrency, the three configurations run in turns for `--repeats`
rounds (median), so the device's drift between minutes hits them alike. Each run: prefill short
prompts, then time `--steps` back-to-back CUDA-graph decode steps (wall clock, one device sync at
the end). Prints the step time, tokens/s, the bytes bound of a step over the copy bandwidth measured
here, and the LoRA / no-LoRA throughput ratio. Writes a CSV (one row per model, config and
concurrency).

Bytes bound of a step, per layer: the attention projections (GQA q/k/v/o; MLA q_proj or q_a/q_b,
kv_a_proj_with_mqa, kv_b_proj, o_proj), the distinct routed experts the batch touches under uniform
routing (E (1 - (1 - K/E)^B), each 3 H I) plus shared experts on sparse layers, the dense MLP on dense
layers, LoRA A/B of every adapted projection per adapter and of the distinct (adapter, expert) pairs,
and the KV read (GQA: 2 N_kv D per cached token; MLA: the latent C + Dr); plus the LM head. Routers
and norms are left out (< 1%).

--quantization fp8: every projection in FP8 (128 x 128 blocks, random weights drawn and quantized on the GPU;
`moelora.quant`), the bound counting them one byte each (scales < 0.03 %); the FP8 kernels (`fp8_moe`,
`fp8_linear`) run them in W8A8 (the fused-MoE table's W8A8 entries; EngineConfig.fp8_activation_quant's GPU
default), or W8A16 with --no-fp8-activation-quant.

--model qwen3_30b (default), dsv2_lite (DeepSeek-V2-Lite: 27 layers, MLA with C 512, 64 experts top-6,
2 shared experts, first layer dense), dsv3 (DeepSeek-V3: cut short, --layers 8 --quantization fp8 on one H200),
minimax_m2 (MiniMax-M2: cut short, --layers 8 on one H200), qwen3_235b (Qwen3-235B-A22B: cut short on one GPU;
--tensor-parallel-size 8 --quantization fp8 splits its experts on whole FP8 blocks, unevenly) or all (the first
two, one after the other).

usage: python benchmarks/decode.py OUT.csv [--model qwen3_30b|dsv2_lite|dsv3|minimax_m2|qwen3_235b|all] [--layers N]
       [--conc 1,8,32,64,128,256] [--steps 20] [--repeats 2] [--no-async-scheduling] [--no-overlap-lora]
       [--lora-target-modules self_attn,experts] [--ab async_scheduling=0]  (engine-level keys only)
       [--ab-table other_fused_moe_table.json]  (B engines built, captured and run with that MoE table)
       [--quantization fp8 [--no-fp8-activation-quant]]
       [--tensor-parallel-size N [--enable-expert-parallel]]  (N GPUs: benchmarks/decode_parallel.py, 8 layers
       unless --layers, a random checkpoint written to a temporary directory; 1 rank vs N ranks)
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable

import torch

sys.path.insert(0, __file__.rsplit("/", 2)[0])
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from moe_bench_common import copy_gbps, write_rows  # noqa: E402

from moelora.bench import random_prompts, time_decode  # noqa: E402
from moelora.config import ModelConfig  # noqa: E402
from moelora.engine.config import EngineConfig  # noqa: E402
from moelora.engine.engine import LLMEngine  # noqa: E402
from moelora.kernels.moe_config import check_table_file  # noqa: E402
from moelora.layers.options import LayerOptions  # noqa: E402
from moelora.lora.adapter import LoRAAdapter, LoRAWeights  # noqa: E402
from moelora.models.decoder import MoECausalLM  # noqa: E402
from moelora.models.registry import model_class  # noqa: E402
from moelora.quant.config import FP8Config  # noqa: E402
from moelora.quant.fp8 import quantize_segments  # noqa: E402
from moelora.quant.storage import fp8_weight_sites  # noqa: E402

QWEN3_30B = dict(family="qwen3_moe", vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32,
                 num_kv_heads=4, head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                 top_k=8, norm_topk_prob=True, qk_norm="per_head", max_position_embeddings=4096, dtype="bfloat16")
# DeepSeek-V2-Lite's config.json (shared experts: 2 x 1408 = 2816 wide; layer 0 dense, 10944 wide).
DSV2_LITE = dict(family="deepseek_v2", vocab_size=102400, hidden_size=2048, num_layers=27, num_heads=16,
                 num_kv_heads=16, head_dim=128 + 64, intermediate_size=10944, moe_intermediate_size=1408,
                 num_experts=64, top_k=6, norm_topk_prob=False, attention="mla", q_lora_rank=None, kv_lora_rank=512,
                 qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, topk_method="greedy",
                 routed_scaling_factor=1.0, n_shared_experts=2, first_k_dense_replace=1, rope_interleave=True,
                 max_position_embeddings=4096, dtype="bfloat16")
# DeepSeek-V3's config.json (noaux_tc router in 8 groups of 32, top-4 groups; q_lora 1536; one shared expert;
# layers 0-2 dense). 671B parameters: one H200 holds it only cut short and in FP8 (--layers 8 --quantization fp8:
# ~11 GB an MoE layer), so `--model all` leaves it out.
DSV3 = dict(family="deepseek_v3", vocab_size=129280, hidden_size=7168, num_layers=61, num_heads=128,
            num_kv_heads=128, head_dim=128 + 64, intermediate_size=18432, moe_intermediate_size=2048,
            num_experts=256, top_k=8, norm_topk_prob=True, attention="mla", q_lora_rank=1536, kv_lora_rank=512,
            qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, topk_method="noaux_tc", n_group=8,
            topk_group=4, routed_scaling_factor=2.5, router_correction_bias=True, n_shared_experts=1,
            first_k_dense_replace=3, rope_interleave=True, max_position_embeddings=4096, dtype="bfloat16")
# MiniMax-M2's config.json (230B, 10B active: one H200 holds it only cut short, --layers 8 in FP8 ~ 3.6 GB a
# layer; the noaux_tc router of one group, whole-projection q / k norms, rotary over 64 of each head's 128).
MINIMAX_M2 = dict(family="minimax_m2", vocab_size=200064, hidden_size=3072, num_layers=62, num_heads=48,
                  num_kv_heads=8, head_dim=128, intermediate_size=1536, moe_intermediate_size=1536, num_experts=256,
                  top_k=8, norm_topk_prob=True, qk_norm="whole", partial_rotary_factor=0.5, rope_theta=5e6,
                  topk_method="noaux_tc", router_correction_bias=True, max_position_embeddings=4096,
                  dtype="bfloat16")
# GLM-4.7-Flash (30B-A3B): DeepSeek-V3's MLA with wider heads (nope 192, v 256, 20 of them), GLM's router.
GLM47_FLASH = dict(family="glm4_moe_lite", vocab_size=154880, hidden_size=2048, num_layers=47, num_heads=20,
                   num_kv_heads=20, head_dim=192 + 64, intermediate_size=10240, moe_intermediate_size=1536,
                   num_experts=64, top_k=4, norm_topk_prob=True, attention="mla", q_lora_rank=768, kv_lora_rank=512,
                   qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256, topk_method="noaux_tc",
                   routed_scaling_factor=1.8, router_correction_bias=True, n_shared_experts=1, first_k_dense_replace=1,
                   rope_interleave=True, rope_theta=1e6, max_position_embeddings=4096, dtype="bfloat16")
# Qwen3-235B-A22B's config.json (94 layers, 64 q / 4 kv heads, 128 experts top-8 of 1536 rows): its FP8 checkpoint
# fits one 8-GPU host; at --tensor-parallel-size 8 the expert rows split on whole 128 blocks, 256 x 4 / 128 x 4
# (vLLM refuses that split; docs/parallel.md). One GPU holds it only cut short (--layers 8 in FP8: ~2.5 GB a layer).
QWEN3_235B = dict(QWEN3_30B, hidden_size=4096, num_layers=94, num_heads=64, intermediate_size=12288,
                  moe_intermediate_size=1536)
MODELS = {"qwen3_30b": QWEN3_30B, "dsv2_lite": DSV2_LITE, "dsv3": DSV3, "minimax_m2": MINIMAX_M2,
          "glm47_flash": GLM47_FLASH, "qwen3_235b": QWEN3_235B}
ALL = ("qwen3_30b", "dsv2_lite")  # `--model all`
TRITON = LayerOptions(kernel_backend="triton")


def random_model(cfg: ModelConfig, max_loras: int, rank: int, quant: FP8Config | None = None) -> MoECausalLM:
    with torch.device("cuda"):
        model = model_class(cfg)(cfg, max_loras=max_loras, max_rank=rank, options=TRITON, dtype=torch.bfloat16,
                                 quant=quant)
    with torch.no_grad():
        for mod, weight, scale, segments in fp8_weight_sites(model):  # random bf16, quantized a matrix at a time
            w, s = getattr(mod, weight), getattr(mod, scale)
            for i in range(w.shape[0] if w.dim() == 3 else 1):
                dest_w, dest_s = (w[i], s[i]) if w.dim() == 3 else (w, s)
                draw = torch.empty(dest_w.shape, dtype=torch.bfloat16, device=w.device).normal_(0, 0.02)
                q, sc = quantize_segments(draw, segments)
                dest_w.copy_(q)
                dest_s.copy_(sc)
        # The router: logits of std ~14 (0.3 x sqrt(H)) pick uniformly under softmax; DeepSeek-V3's sigmoid
        # saturates there (scores 1.0, the correction bias choosing the same experts for every token: 40 distinct
        # of 256 at 64 tokens, uniform routing touches ~222), so a sigmoid router's logits get std ~1 (225 distinct)
        router_std = cfg.hidden_size ** -0.5 if cfg.topk_method == "noaux_tc" else 0.3
        for name, p in model.named_parameters():
            if p.dtype == torch.float8_e4m3fn or name.endswith("_scale_inv"):
                continue
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0, router_std if name.endswith("mlp.gate.weight") else 0.02)
            if name.endswith("mlp.gate.weight") and p.dtype == torch.float32:
                p.copy_(p.to(torch.bfloat16))  # as DeepSeek's / GLM's checkpoints ship it: bf16, upcast by the model
    return model.eval()


def random_adapter(model: MoECausalLM, name: str, rank: int, seed: int) -> LoRAAdapter:
    g = torch.Generator().manual_seed(seed)
    sites = {}
    for key, (mod, proj) in model.lora_sites().items():
        if proj is None:
            if key.endswith("mlp.gate"):
                continue
            a, b = (rank, mod.in_features), (mod.out_features, rank)
        else:
            a_buf, b_buf = getattr(mod, f"lora_{proj}_a"), getattr(mod, f"lora_{proj}_b")
            a, b = (a_buf.shape[1], rank, a_buf.shape[3]), (b_buf.shape[1], b_buf.shape[2], rank)
        sites[key] = LoRAWeights(0.01 * torch.randn(a, generator=g), 0.01 * torch.randn(b, generator=g))
    return LoRAAdapter(name, "", sites)


def model_with_adapters(name: str, layers: int | None = None, n: int = 8, rank: int = 16, pool_rank: int | None = None,
                        quant: FP8Config | None = None, max_positions: int | None = None, distinct: bool = True):
    """MODELS[name]'s shape cut to `layers` layers (None: all of its own): (config, random model with n slots
    of `pool_rank` (default `rank`), FP8 projections with `quant`, adapters a0..a{n-1} of `rank`).
    `max_positions`: its max_position_embeddings, when above the spec's (long prompts). `distinct` False:
    a1.. carry a0's tensors (each still written to a slot of its own, so the kernels read as many bytes;
    8x less random generation on the host: ~0.6e9 values an adapter at 48 layers of Qwen3-30B-A3B)."""
    spec = MODELS[name]
    positions = max(spec["max_position_embeddings"], max_positions or 0)
    cfg = ModelConfig(**{**spec, "num_layers": layers or spec["num_layers"],
                         "max_position_embeddings": positions}).resolve()
    model = random_model(cfg, n, pool_rank or rank, quant)
    if distinct or n == 0:
        return cfg, model, {f"a{i}": random_adapter(model, f"a{i}", rank, i) for i in range(n)}
    first = random_adapter(model, "a0", rank, 0)
    return cfg, model, {f"a{i}": LoRAAdapter(f"a{i}", "", first.sites) for i in range(n)}


def add_quant_args(ap: argparse.ArgumentParser) -> None:
    """--quantization fp8 and --[no-]fp8-activation-quant (W8A8 unless --no-), as `quant_from_args` reads them."""
    ap.add_argument("--quantization", choices=["fp8"], default=None, help="FP8 projections (see decode.py's docstring)")
    ap.add_argument("--fp8-activation-quant", action=argparse.BooleanOptionalAction, default=None,
                    help="with --quantization fp8: W8A8 GEMMs (default, as the engine on a GPU); --no-: W8A16")


def quant_from_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> FP8Config | None:
    if args.fp8_activation_quant is not None and not args.quantization:
        ap.error("--[no-]fp8-activation-quant needs --quantization fp8")
    quant = FP8Config.from_engine(args.quantization) if args.quantization else None
    return quant and dataclasses.replace(quant, quantize_activations=args.fp8_activation_quant is not False)


def add_model_args(ap: argparse.ArgumentParser, layers: int) -> None:
    """--model (a MODELS key), --layers (default `layers`, 0: the model's own count) and the FP8 flags of the
    profiling benchmarks (`model_from_args` builds what they name)."""
    ap.add_argument("--model", default="qwen3_30b", choices=list(MODELS))
    ap.add_argument("--layers", type=int, default=layers, help="layers of the model to build (0: all)")
    add_quant_args(ap)


def model_from_args(ap: argparse.ArgumentParser, args: argparse.Namespace):
    """`model_with_adapters` for `add_model_args`' arguments: (config, model, adapters, FP8 scheme or None (for
    `no_lora_twin`), a one-line description)."""
    quant = quant_from_args(ap, args)
    cfg, model, adapters = model_with_adapters(args.model, args.layers or None, quant=quant)
    return cfg, model, adapters, quant, f"{cfg.num_layers} layers, {args.model} shape, {quant_name(quant)}"


def quant_name(quant: FP8Config | None) -> str:
    return "bf16" if quant is None else "FP8 W8A8" if quant.quantize_activations else "FP8 W8A16"


def tee() -> tuple[list[str], Callable[..., None]]:
    """(lines, log): log(s) prints s and keeps it in lines (for the benchmark's OUT.txt)."""
    lines: list[str] = []

    def log(s: str = "") -> None:
        print(s, flush=True)
        lines.append(s)

    return lines, log


def attention_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(in, out) of each attention projection of one layer."""
    H, N = cfg.hidden_size, cfg.num_heads
    if cfg.attention != "mla":
        D, kv = cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        return [(H, N * D), (H, kv), (H, kv), (N * D, H)]
    C, Dr, Dn, Dv = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    q = [(H, cfg.q_lora_rank), (cfg.q_lora_rank, N * (Dn + Dr))] if cfg.q_lora_rank else [(H, N * (Dn + Dr))]
    return q + [(H, C + Dr), (C, N * (Dn + Dv)), (N * Dv, H)]


def kv_per_token(cfg: ModelConfig) -> int:
    """Cache elements one token holds in one layer."""
    return cfg.latent_cache_dim if cfg.attention == "mla" else 2 * cfg.num_kv_heads * cfg.head_dim


def step_bytes(cfg: ModelConfig, conc: int, n_adapters: int, rank: int, ctx: int, weight_bytes: int = 2) -> float:
    """Bytes a decode step reads: the projections at `weight_bytes` each (1: FP8), the rest in bf16."""
    H, inter, E, K = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.top_k
    shapes = attention_shapes(cfg)
    attn = sum(i * o for i, o in shapes)
    attn_lora = n_adapters * rank * sum(i + o for i, o in shapes)
    kv = conc * ctx * kv_per_token(cfg)
    shared = cfg.shared_experts_intermediate_size or cfg.shared_expert_intermediate_size
    touched = E * (1 - (1 - K / E) ** conc)
    sparse = touched * 3 * H * inter + 3 * H * shared
    sparse_lora = 0.0
    if n_adapters:
        pairs = n_adapters * E * (1 - (1 - K / E) ** (conc / n_adapters))
        sparse_lora = pairs * rank * (2 * H + 3 * inter) + n_adapters * rank * 3 * (H + shared) * (shared > 0)
    dense = 3 * H * cfg.intermediate_size
    dense_lora = n_adapters * rank * 3 * (H + cfg.intermediate_size)
    n_sparse = len(cfg.sparse_layers)
    n_dense = cfg.num_layers - n_sparse
    weights = cfg.num_layers * attn + n_sparse * sparse + n_dense * dense
    rest = cfg.num_layers * (attn_lora + kv) + n_sparse * sparse_lora + n_dense * dense_lora
    return weight_bytes * weights + 2.0 * (rest + cfg.vocab_size * H)


def measure(eng: LLMEngine, conc: int, names: list, steps: int, prompt_len: int = 32) -> float:
    """Seconds a decode step of `conc` requests on `names` (in turn): `moelora.bench.time_decode` (steps back
    to back, one device sync at the end, every request one token a step or it raises)."""
    vocab = min(1000, eng.model_config.vocab_size)
    return time_decode(eng, random_prompts(conc, prompt_len, vocab, seed=conc), names, steps)[1]


def engine_config(cfg: ModelConfig, max_loras: int, rank: int, max_seqs: int, device: str = "cuda",
                  max_model_len: int = 512, num_kv_blocks: int | None = None, **engine_kw) -> EngineConfig:
    """By default 16 KV blocks (256 tokens) a sequence: room for a prompt and up to ~200 steps without
    preemption, small enough that the no-LoRA and LoRA engines both fit next to the weights."""
    blocks = max_seqs * 16 + 64 if num_kv_blocks is None else num_kv_blocks
    base = dict(device=device, dtype="bfloat16", kernel_backend="triton", max_loras=max_loras, max_lora_rank=rank,
                max_num_seqs=max_seqs, max_model_len=max_model_len, num_kv_blocks=blocks, block_size=16)
    return EngineConfig(**{**base, **engine_kw}).resolve(cfg)  # engine_kw may override (an --ab kernel_backend)


def engine(model, cfg: ModelConfig, max_loras: int, rank: int, max_seqs: int, adapters: dict,
           **engine_kw) -> LLMEngine:
    """An engine over `model`, or over its twin built with the config's layer options (the same tensors:
    engines of several configs share the weights, `MoECausalLM.with_options`)."""
    ecfg = engine_config(cfg, max_loras, rank, max_seqs, **engine_kw)
    eng = LLMEngine(model.with_options(ecfg.layer_options(model.options)), None, ecfg,
                    lambda name, path: adapters[name])
    for name in adapters:
        eng.pool.add(name, name)
    return eng


def no_lora_twin(model: MoECausalLM, cfg: ModelConfig, quant: FP8Config | None = None) -> MoECausalLM:
    """The same model without LoRA sites, over the same weight tensors (no second copy): the no-LoRA
    baseline, alive next to the LoRA engine so the two are measured in turns."""
    with torch.device("meta"):
        twin = model_class(cfg)(cfg, max_loras=0, max_rank=0, options=model.options, dtype=torch.bfloat16,
                                quant=quant)
    src = dict(model.named_modules())
    for name, mod in twin.named_modules():
        for table, other in ((mod._parameters, src[name]._parameters), (mod._buffers, src[name]._buffers)):
            for key, t in table.items():
                if t is not None:
                    table[key] = other[key]
        left = [k for k, v in vars(mod).items() if isinstance(v, torch.Tensor) and v.is_meta]
        if left:
            raise RuntimeError(f"{name}: tensors not shared with the LoRA model: {left}")
    return twin.eval()


def run_model(name: str, layers: int | None, concs: list[int], steps: int, rank: int, bw: float,
              engine_kw: dict, repeats: int = 1, ab: dict | None = None, ab_table: str | None = None,
              pool_rank: int | None = None, quant: FP8Config | None = None) -> list[dict]:
    """`ab`: engine settings of a second engine pair ("B", e.g. {"async_scheduling": True}) over the same
    weights, measured in the same turns as the first, so a few-percent effect is not lost to drift.
    `ab_table`: a fused-MoE table file the B pair is built, captured and run with (its
    EngineConfig.fused_moe_table: its engines run twins of the models built with it, over the same
    weights). `pool_rank`: the slots' max rank (max_lora_rank), default
    the adapters' `rank`."""
    pool_rank = pool_rank or rank  # was passed on as None without --pool-rank: a TypeError in resolve()
    cfg, model, adapters = model_with_adapters(name, layers, 8, rank, pool_rank, quant)
    print(f"model {name}, layers {cfg.num_layers}, {quant_name(quant)} projections")
    twin = no_lora_twin(model, cfg, quant)
    has_b = bool(ab) or ab_table is not None
    b_table = check_table_file(ab_table) if ab_table else None
    runs = []
    b_kw = {**engine_kw, **(ab or {}), "fused_moe_table": b_table}
    for variant, kw in (("", engine_kw), *((("B", b_kw),) if has_b else ())):
        lora_eng = engine(model, cfg, 8, pool_rank, max(concs), adapters, **kw)
        base_kw = {k: v for k, v in kw.items() if k != "lora_target_modules"}  # it has no LoRA sites to name
        base_eng = engine(twin, cfg, 0, 0, max(concs), {}, **base_kw)
        runs += [(variant, "no LoRA", base_eng, [None]), (variant, "1 adapter", lora_eng, ["a0"]),
                 (variant, "8 adapters", lora_eng, list(adapters))]
    samples: dict[tuple[str, str, int], list[float]] = {}
    for conc in concs:  # the configurations in turns, `repeats` rounds: drift hits all of them alike
        for _ in range(repeats):
            for variant, label, eng, names in runs:
                samples.setdefault((variant, label, conc), []).append(measure(eng, conc, names, steps))
    results = {key: sorted(v)[len(v) // 2] for key, v in samples.items()}
    for variant, label, eng, _ in runs:
        if eng.graphs is not None and label != "1 adapter":  # the LoRA engine is listed twice
            print(f"# {variant or 'A'} {label if label == 'no LoRA' else 'LoRA engine'}: decode graphs captured "
                  f"{eng.graphs.captures}x, the last in {eng.graphs.capture_s:.2f} s")
    del runs, lora_eng, base_eng, twin, model
    torch.cuda.empty_cache()
    rows = []
    for variant in ("", "B") if has_b else ("",):
        if has_b:
            b_desc = [f"{k}={v}" for k, v in (ab or {}).items()] + ([f"MoE table {ab_table}"] if ab_table else [])
            print(f"# {'A: as given' if not variant else 'B: ' + ', '.join(b_desc)}")
        print(f"{'config':>11} {'conc':>5} {'step ms':>8} {'tok/s':>9} {'bound ms':>9} {'x bound':>8} {'vs noLoRA':>9}"
              + ("  B/A" if variant else ""))
        for conc in concs:
            for label, n in (("no LoRA", 0), ("1 adapter", 1), ("8 adapters", 8)):
                t = results[(variant, label, conc)]
                bound = step_bytes(cfg, conc, n, rank, 40, 1 if quant else 2) / bw
                ratio = results[(variant, "no LoRA", conc)] / t
                rows.append(dict(model=name, variant=variant or "A", config=label, concurrency=conc, step_ms=t * 1e3,
                                 tokens_per_s=conc / t, bound_ms=bound * 1e3, x_bound=t / bound,
                                 throughput_vs_nolora=ratio))
                vs_a = f"  {t / results[('', label, conc)]:.3f}" if variant else ""
                print(f"{label:>11} {conc:>5} {t * 1e3:8.2f} {conc / t:9.0f} {bound * 1e3:9.2f} {t / bound:8.2f} "
                      f"{ratio:9.3f}{vs_a}")
    return rows


# EngineConfig keys that shape the model itself (its LoRA slots and the sites keeping them, its dtype): the A and
# B engines share its tensors, so B cannot differ there. Layer options (overlap_shared_experts, overlap_mla_absorb,
# mla_absorbed_decode, merge_qkv, kernel_backend, pdl, ...) can: `engine` gives B a twin built with them over the
# same tensors. The MoE table has its own flag (--ab-table, which checks the file).
MODULE_LEVEL_KEYS = frozenset({"lora_target_modules", "max_loras", "max_lora_rank", "dtype", "fused_moe_table"})


def parse_ab(spec: str) -> dict:
    """"async_scheduling=1,skip_idle_lora_sites=0" -> EngineConfig keyword values (0/1 as booleans; a
    value with "+" a tuple). Keys that shape the shared model are refused (MODULE_LEVEL_KEYS): compare those in
    separate runs."""
    out = {}
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        if key in MODULE_LEVEL_KEYS:
            hint = "--ab-table" if key == "fused_moe_table" else "separate runs (DECODE_VARIANTS of make gpu-check)"
            raise SystemExit(f"--ab {key}: it shapes the model, whose tensors the A and B engines share; use {hint}")
        out[key] = (tuple(value.split("+")) if "+" in value
                    else {"0": False, "1": True, "false": False, "true": True}.get(value.lower(), value))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--model", default="qwen3_30b", choices=[*MODELS, "all"])
    ap.add_argument("--layers", type=int, default=None, help="default: the model's own layer count")
    ap.add_argument("--conc", default="1,8,32,64,128,256")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--pool-rank", type=int, default=None, help="the slots' max rank (EngineConfig.max_lora_rank; "
                    "default --rank), e.g. 64 (the engine's default) for rank-16 adapters")
    ap.add_argument("--repeats", type=int, default=2, help="rounds of (no LoRA, 1 adapter, 8 adapters); median")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                    help="EngineConfig.async_scheduling (default: the engine's, on with CUDA)")
    ap.add_argument("--no-overlap-lora", action="store_true", help="EngineConfig.overlap_lora=False")
    ap.add_argument("--lora-target-modules", default=None,
                    help="comma-separated EngineConfig.lora_target_modules (e.g. self_attn,experts: no router LoRA)")
    ap.add_argument("--ab-table", default=None, help="A/B in the same turns: a fused-MoE table file (as "
                    "tune_fused_moe.py writes) the B engines use, against the package's (A); with --ab, B has both")
    ap.add_argument("--ab", default="", help="A/B in the same turns: engine settings of a second engine pair, "
                    "e.g. async_scheduling=1, overlap_mla_absorb=0 or pdl=0 (B/A: its step time over the first's); "
                    "keys that shape the shared model (slots, dtype) are refused")
    add_quant_args(ap)
    ap.add_argument("--tensor-parallel-size", type=int, default=1, help="N > 1: time 1 rank against N ranks "
                    "(needs N GPUs; benchmarks/decode_parallel.py)")
    ap.add_argument("--enable-expert-parallel", action="store_true", help="with --tensor-parallel-size: EP experts")
    args = ap.parse_args()
    quant = quant_from_args(ap, args)
    if args.model == "dsv3" and args.tensor_parallel_size == 1 and (not args.layers or quant is None):
        ap.error("--model dsv3 (671 B parameters) fits one GPU only cut short and in FP8: --layers 8 "
                 "--quantization fp8 on an H200")
    if args.model == "minimax_m2" and args.tensor_parallel_size == 1 and not args.layers:
        ap.error("--model minimax_m2 (230 B parameters) fits one GPU only cut short: --layers 8 on an H200")
    if args.model == "qwen3_235b" and args.tensor_parallel_size == 1 and not args.layers:
        ap.error("--model qwen3_235b (235 B parameters) fits one GPU only cut short: --layers 8 (FP8 on an H100)")
    concs = [int(c) for c in args.conc.split(",")]
    if args.tensor_parallel_size > 1:
        from decode_parallel import run_parallel

        if torch.cuda.device_count() < args.tensor_parallel_size:
            raise SystemExit(f"--tensor-parallel-size {args.tensor_parallel_size} needs as many GPUs; "
                             f"{torch.cuda.device_count()} here")
        name = "qwen3_30b" if args.model == "all" else args.model
        write_rows(args.out, run_parallel(MODELS[name], name, args.tensor_parallel_size, args.enable_expert_parallel,
                                          args.layers or 8, concs, args.steps, args.rank, args.repeats,
                                          args.quantization, args.fp8_activation_quant))
        return
    bw = copy_gbps() * 1e9  # bytes/s
    print(f"GPU {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s")
    rows = []
    for name in (ALL if args.model == "all" else [args.model]):
        rows += run_model(name, args.layers, concs, args.steps, args.rank, bw, repeats=args.repeats,
                          ab=parse_ab(args.ab), ab_table=args.ab_table, pool_rank=args.pool_rank,
                          quant=quant, engine_kw=
                          dict(async_scheduling=args.async_scheduling, overlap_lora=not args.no_overlap_lora,
                               lora_target_modules=tuple(args.lora_target_modules.split(","))
                               if args.lora_target_modules else None))
    write_rows(args.out, rows)


if __name__ == "__main__":
    main()
