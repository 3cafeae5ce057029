"""CUDA engines over tiny random models (Qwen2-MoE, DeepSeek-V3 with MLA, GLM-4-MoE, MiniMax-M2), their workload and
the logprob comparisons of the GPU equivalence tests (contract 6); also used by scripts/gpu_diag*.py."""

from __future__ import annotations

import torch

from moelora.engine.config import EngineConfig
from moelora.engine.engine import LLMEngine
from moelora.engine.request import SamplingParams
from tests.helpers.models import build, build_from_architecture, random_adapter
from tests.helpers.oracle import tiny_hf_model

SIZES = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=4, moe_intermediate_size=128,
             intermediate_size=384, shared_expert_intermediate_size=256, num_experts=8, vocab_size=512,
             max_position_embeddings=1024, num_hidden_layers=2, mlp_only_layers=[])
# DeepSeek-V3 with awkward MLA widths (C 80, Dv 24 != Dn 32), 8 heads, groups that bind, 1 dense layer.
DSV3_SIZES = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=96, kv_lora_rank=80,
                  qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=24, moe_intermediate_size=128,
                  intermediate_size=384, n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3,
                  n_shared_experts=2, first_k_dense_replace=1, vocab_size=512, max_position_embeddings=1024,
                  num_hidden_layers=3)
# GLM-4-MoE: partial rotary (half of head_dim 32) with per-head q/k norm, sigmoid grouped router,
# a shared expert, 1 dense layer.
GLM_SIZES = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=4, head_dim=32, moe_intermediate_size=128,
                 intermediate_size=384, n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3,
                 n_shared_experts=1, first_k_dense_replace=1, vocab_size=512, max_position_embeddings=1024,
                 num_hidden_layers=3)
# MiniMax-M2: q / k norms over the whole projections, rotary over half of head_dim 32, a biased sigmoid router of
# one group, every layer sparse (added in the 43rd session without a GPU to run it on).
MINIMAX_SIZES = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=4, head_dim=32, intermediate_size=128,
                     num_local_experts=8, num_experts_per_tok=3, vocab_size=512, max_position_embeddings=1024,
                     num_hidden_layers=2)
FAMILY_SIZES = {"deepseek_v3": DSV3_SIZES, "glm4_moe": GLM_SIZES, "minimax_m2": MINIMAX_SIZES}
FAMILIES = ("qwen2_moe", "deepseek_v3", "glm4_moe", "minimax_m2")


def tiny_model(family: str, dtype: torch.dtype = torch.bfloat16, max_loras: int = 4, max_rank: int = 16):
    if family == "qwen2_moe":
        return build(tiny_hf_model("qwen2_moe", seed=3, **SIZES), max_loras=max_loras, max_rank=max_rank).to(
            "cuda", dtype)
    hf = tiny_hf_model(family, seed=3, **FAMILY_SIZES[family])
    return build_from_architecture(hf, max_loras, max_rank, dtype).to("cuda")  # router and norms stay fp32


def tiny_adapters(model, family: str, frac: float | None = None) -> dict:
    if frac is None:
        frac = 0.8 if family == "qwen2_moe" else 1.0  # DeepSeek / GLM: every site, all attention projections
    return {f"a{i}": random_adapter(model, 40 + i, r, frac=frac) for i, r in enumerate((16, 8, 4, 12))}


def gpu_engine(model, adapters, registered=None, **kw) -> LLMEngine:
    """A CUDA engine whose loader serves `adapters`, registering `registered` of them (default: all)."""
    base = dict(device="cuda", dtype="bfloat16", kernel_backend="triton", max_loras=4, max_lora_rank=16,
                block_size=16, num_kv_blocks=2048, max_model_len=1024, max_num_seqs=32)
    cfg = EngineConfig(**{**base, **kw}).resolve(model.config)
    eng = LLMEngine(model.with_options(cfg.layer_options(model.options)), None, cfg, lambda name, path: adapters[name])
    for name in adapters if registered is None else registered:
        eng.pool.add(name, name)
    return eng


def workload(n=32, seed=0, vocab=512):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (int(torch.randint(4, 40, (), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    names = [[None, "a0", "a1", "a2", "a3"][i % 5] for i in range(n)]
    return prompts, names


def generate(eng, prompts, names, max_tokens):
    """Greedy requests run to the end; each token's logprob entry holds the top two (`logprob_diff`'s ties)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=2)
    reqs = [eng.add_request(p, params, a) for p, a in zip(prompts, names, strict=True)]
    while eng.has_unfinished():
        eng.step()
    return reqs


def staggered(eng, prompts, names, max_tokens: int, every: int = 2):
    """Greedy requests added two at a time, every `every` steps, so prompts prefill beside decodes (steps with
    prompt rows: the piecewise graphs' steps)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=2)
    reqs, todo, n = [], list(zip(prompts, names, strict=True)), 0
    while todo or eng.has_unfinished():
        if todo and n % every == 0:
            reqs += [eng.add_request(p, params, a) for p, a in todo[:2]]
            todo = todo[2:]
        eng.step()
        n += 1
    return reqs


def racy_and_safe(x: torch.Tensor, w: torch.Tensor, inplace: bool) -> torch.Tensor:
    """Side stream reads x after a delay; main overwrites x in place (wrong) or writes a new tensor."""
    main, side = torch.cuda.current_stream(), torch.cuda.Stream()
    side.wait_stream(main)
    with torch.cuda.stream(side):
        torch.cuda._sleep(20_000_000)
        shared = x @ w
    routed = x.mul_(3.0) if inplace else x * 3.0
    main.wait_stream(side)
    return routed + shared


def forced_logprob_diff(reference_engine, reqs) -> float:
    """Runs the same requests greedily on `reference_engine`; every token must be identical (no
    divergence) and the result is the max |logprob difference| over all generated tokens."""
    ref = generate(reference_engine, [r.prompt_ids for r in reqs], [r.adapter for r in reqs],
                   len(reqs[0].output_ids))
    return logprob_diff(reqs, ref)


TIE = 0.05  # a greedy choice between two tokens this close in logprob may go either way under bf16 rounding


def logprob_diff(reqs, ref, tie: float = TIE) -> float:
    """Every request's tokens identical to its reference's, up to a near-tie: where two runs first pick
    different tokens, the reference's top two (`generate` asks for them) must be within `tie` of each other and
    hold both picks (random tiny models meet such ties; bf16 paths that sum in another order split them), and
    the rest of that request is not compared. Returns the max |logprob difference| over the compared tokens."""
    worst = 0.0
    for got, want in zip(reqs, ref, strict=True):
        for i, (a, b, ga, wa) in enumerate(zip(got.output_ids, want.output_ids, got.logprobs, want.logprobs,
                                               strict=True)):
            if a != b:
                tops = dict(wa[2][:2])
                assert a in tops and tops[b] - tops[a] <= tie, (
                    f"tokens diverge for {got.request_id} ({got.adapter}) at {i}: {a} vs {b}, the reference's top "
                    f"two {wa[2][:2]}")
                break
            worst = max(worst, abs(ga[0] - wa[0]))
    return worst


def greedy_outputs(eng, prompts, names, max_tokens=48) -> list[tuple[list[int], list[float]]]:
    """(token ids, sampled logprobs) of each request, run greedily on `eng`."""
    return [(r.output_ids, [lp[0] for lp in r.logprobs]) for r in generate(eng, prompts, names, max_tokens)]


def decode_step_without_host_sync(eng) -> None:
    """Contract 5: prefill the requests `eng` holds (at least one decode step left each), then run one decode
    forward, prepared by hand, under `torch.cuda.set_sync_debug_mode("error")`: any host sync raises. `eng`:
    eager and synchronous (`enforce_eager=True, async_scheduling=False`), so its step can be driven by hand."""
    eng.step()  # prefill
    step = eng.scheduler.schedule()
    inputs = eng.runner.prepare(step, eng.pool.acquire(r.adapter for r in step.requests), eng.pool.slot_ranks)
    without_host_sync(lambda: eng.runner.run(inputs))


def without_host_sync(fn) -> None:
    """Runs fn() under `torch.cuda.set_sync_debug_mode("error")` (after a device sync): any host sync raises."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
