"""Tensor parallelism on CUDA (NCCL). Run by `make gpu-check` (or pytest -m gpu) on a CUDA machine.

- One GPU: an engine whose model is built for a world of size 1 on an NCCL group (every layer's all-reduce and
  the vocab gather are real NCCL collectives), decoding under CUDA graphs, equals the plain engine token for
  token and logprob for logprob (a size-1 all-reduce and gather are copies: bit-exact).
- Two or more GPUs: TP=2 (and TP=2 with EP) equal one GPU (fp32, torch backend: cuBLAS fp32, no TF32, so the
  CPU tests' 1e-4 holds), and greedy tokens are identical; TP=2 decode graphs (bf16, Triton) equal TP=2 eager
  (tokens identical, logprobs within the single-GPU graph-vs-eager test's 0.05).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moelora import LLM, SamplingParams
from moelora.config import ModelConfig
from moelora.engine.config import EngineConfig
from moelora.engine.engine import LLMEngine
from moelora.engine.loader import build_engine
from moelora.lora.loader import load_adapter
from tests.helpers.gpu_engine import greedy_outputs
from tests.helpers.oracle import tiny_hf_model
from tests.helpers.oracle_lora import per_expert_lora, write_per_expert

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SIZES = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=4, head_dim=32, moe_intermediate_size=128,
             intermediate_size=384, num_experts=8, vocab_size=512, max_position_embeddings=1024, num_hidden_layers=2,
             mlp_only_layers=[])
ENGINE = dict(max_loras=4, max_lora_rank=16, num_kv_blocks=1024, max_model_len=512, max_num_seqs=32, block_size=16)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_gpu")
    hf = tiny_hf_model("qwen3_moe", seed=3, **SIZES)
    hf.save_pretrained(str(root / "model"))
    adapters = {f"a{i}": str(write_per_expert(per_expert_lora(hf, seed=40 + i, r=4, std=0.1), root / f"a{i}"))
                for i in range(3)}
    return root / "model", adapters


def _workload(n=24, vocab=512):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (int(torch.randint(4, 40, (), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    return prompts, [[None, "a0", "a1", "a2"][i % 4] for i in range(n)]


def test_world_size_one_nccl_group_under_cuda_graphs_equals_plain_engine(assets):
    from moelora.parallel.build import build_rank_model, plan_kv_blocks
    from moelora.parallel.groups import device_group, open_store
    from moelora.parallel.rules import ShardPlan
    from moelora.parallel.shard import Shard

    model_dir, adapters = assets
    cfg = EngineConfig(device="cuda", dtype="bfloat16", **ENGINE)
    plain = build_engine(model_dir, cfg, adapters=adapters)
    assert plain.graphs is not None
    prompts, names = _workload()
    want = greedy_outputs(plain, prompts, names)
    del plain
    torch.cuda.empty_cache()

    store = open_store("127.0.0.1", 0, 0, 1, 120)
    shard = Shard(ShardPlan(0, 1), device_group(store, 0, 1, torch.device("cuda"), 120))
    resolved = EngineConfig(device="cuda", dtype="bfloat16", **ENGINE).resolve(ModelConfig.from_hf(model_dir))
    model = build_rank_model(model_dir, resolved, shard)
    resolved = plan_kv_blocks(resolved, model, shard)
    eng = LLMEngine(model, None, resolved,
                    lambda name, path: load_adapter(Path(path), model.config, name=name, max_rank=16), adapters)
    assert eng.graphs is not None, "the NCCL-group engine must decode under CUDA graphs"
    got = greedy_outputs(eng, prompts, names)
    assert [t for t, _ in got] == [t for t, _ in want]
    worst = max(abs(a - b) for (_, x), (_, y) in zip(got, want, strict=True) for a, b in zip(x, y, strict=True))
    assert worst == 0.0, f"a size-1 NCCL group changed logprobs by {worst}"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "tp2-ep"])
def test_tp2_on_two_gpus_equals_one(assets, expert_parallel):
    model_dir, adapters = assets
    kw = dict(device="cuda", dtype="float32", kernel_backend="torch", enforce_eager=True, **ENGINE)
    prompts, names = _workload(8)
    results = []
    for parallel in (dict(), dict(tensor_parallel_size=2, expert_parallel=expert_parallel)):
        llm = LLM(model_dir, adapters, **kw, **parallel)
        try:
            logits = llm.logits(prompts, names)
            outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), names)
            results.append((logits, [o.token_ids for o in outs]))
        finally:
            llm.engine.close()
    (ref, ref_tokens), (got, got_tokens) = results
    worst = max((a - b).abs().max().item() for a, b in zip(got, ref, strict=True))
    assert worst <= 1e-4, f"TP=2 logits differ from one GPU by {worst}"
    assert got_tokens == ref_tokens


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tp2_decode_graphs_equal_tp2_eager(assets):
    """Every rank captures and replays its decode graphs in step with rank 0 (NCCL inside the graphs),
    including the re-capture a run-time adapter with new LoRA sites triggers."""
    model_dir, adapters = assets
    prompts, names = _workload()
    results = []
    for eager in (False, True):
        llm = LLM(model_dir, {"a0": adapters["a0"]}, device="cuda", dtype="bfloat16", tensor_parallel_size=2,
                  enforce_eager=eager, **ENGINE)
        try:
            assert (llm.engine.graphs is None) == eager
            llm.add_adapter("a1", adapters["a1"])  # run time: the graphs re-capture at its first replay
            llm.add_adapter("a2", adapters["a2"])
            results.append(greedy_outputs(llm.engine, prompts, names))
        finally:
            llm.engine.close()
    graphed, eager = results
    assert [t for t, _ in graphed] == [t for t, _ in eager]
    worst = max(abs(a - b) for (_, x), (_, y) in zip(graphed, eager, strict=True) for a, b in zip(x, y, strict=True))
    assert worst <= 0.05, f"TP=2 graphs vs eager: max |logprob diff| {worst}"
