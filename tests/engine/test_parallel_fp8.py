"""FP8 base weights on several ranks (CPU, gloo): each rank holds its slice of the e4m3 weights and the matching
part of their scales; the sharded FP8 engine equals the one-process FP8 engine (contract 9 over contract 10).

The tiny models here are sized so that every TP=2 attention split falls on the 128 x 128 blocks of the scales
(hidden 256, head_dim 128 / MLA head widths 128); their intermediate dims are 256 rows (even splits) or 320 / 384
/ 576 / 640 (2.5 to 5 blocks: each rank keeps whole blocks, unevenly, the last rank's last block partial where
the dim ends inside one). A dimension of fewer blocks than ranks cannot be split, which the refusal test shows.
Quantize-on-load on a rank is checked against the cut of the globally quantized weight, sliced by hand here.
"""

from __future__ import annotations

import pytest
import torch

from moelora import LLM, SamplingParams
from moelora.errors import ConfigError
from tests.helpers.fp8_oracle import write_fp8_checkpoint
from tests.helpers.gpu_engine import greedy_outputs
from tests.helpers.oracle import tiny_hf_model
from tests.helpers.oracle_lora import per_expert_lora, write_packed, write_per_expert

ENGINE = dict(device="cpu", dtype="float32", max_lora_rank=8, max_loras=3, max_num_batched_tokens=256,
              num_kv_blocks=64, max_model_len=64)
SIZES = {"qwen3_moe": dict(hidden_size=256, head_dim=128, moe_intermediate_size=256, intermediate_size=256),
         "deepseek_v3": dict(hidden_size=256, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64,
                             moe_intermediate_size=256, intermediate_size=256),
         "minimax_m2": dict(hidden_size=256, head_dim=128, intermediate_size=256),
         "glm4_moe": dict(hidden_size=256, head_dim=128, moe_intermediate_size=256, intermediate_size=256)}
TP2, EP2 = dict(tensor_parallel_size=2), dict(tensor_parallel_size=2, expert_parallel=True)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(family, scheme) -> (FP8 model dir, adapters, vocab), built once."""
    cache = {}

    def get(family: str, scheme: str, sizes: tuple = ()):
        if (family, scheme, sizes) not in cache:
            root = tmp_path_factory.mktemp(f"{family}-{scheme}")
            hf = tiny_hf_model(family, seed=5, num_hidden_layers=2, **{**SIZES[family], **dict(sizes)})
            form = "fused" if family == "deepseek_v3" and scheme == "block" else "per_expert"  # both expert key forms
            write_fp8_checkpoint(hf, root / "model", scheme, form)
            adapters = {
                "a": write_per_expert(per_expert_lora(hf, seed=1, r=4, lora_alpha=8), root / "a"),
                "b": write_per_expert(per_expert_lora(hf, seed=2, r=3, lora_alpha=5, router=False), root / "b"),
                "c": write_packed(per_expert_lora(hf, seed=3, r=2, lora_alpha=4, use_rslora=True), root / "c"),
            }
            cache[family, scheme, sizes] = (root / "model", adapters, hf.config.vocab_size)
        return cache[family, scheme, sizes]
    return get


def _run(model_dir, adapters, vocab, **parallel):
    llm = LLM(model_dir, adapters, **ENGINE, **parallel)
    try:
        g = torch.Generator().manual_seed(0)
        names = ["a", None, "b", "c", "a"]
        seqs = [torch.randint(3, vocab, (int(n),), generator=g).tolist()
                for n in torch.randint(2, 11, (len(names),), generator=g)]
        logits = llm.logits(seqs, names)
        greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        return logits, [o.token_ids for o in llm.generate(seqs[:3], greedy, names[:3])]
    finally:
        llm.engine.close()


CORE = [("qwen3_moe", "block", TP2), ("deepseek_v3", "block", TP2), ("deepseek_v3", "block", EP2),
        ("qwen3_moe", "channel", TP2),  # compressed-tensors per channel
        ("minimax_m2", "block", TP2)]  # q / k norms over the whole projection, FP8 q / k sharded by 128-row blocks
SLOW = [("qwen3_moe", "block", EP2), ("deepseek_v3", "tensor", TP2)]


@pytest.mark.parametrize("family,scheme,parallel", CORE + [pytest.param(*c, marks=pytest.mark.slow) for c in SLOW],
                         ids=[f"{f}-{s}-{'ep' if p.get('expert_parallel') else 'tp'}2" for f, s, p in CORE + SLOW])
def test_sharded_fp8_engine_equals_one_process(built, family, scheme, parallel):
    _assert_equals_one_process(*built(family, scheme), parallel, f"{family} {scheme}")


def _assert_equals_one_process(model_dir, adapters, vocab, parallel: dict, what: str) -> None:
    """The engine under `parallel` (its other engine options on both sides) against one process."""
    same = {k: v for k, v in parallel.items() if k not in ("tensor_parallel_size", "expert_parallel")}
    ref_logits, ref_tokens = _run(model_dir, adapters, vocab, **same)
    got_logits, got_tokens = _run(model_dir, adapters, vocab, **parallel)
    for ref, got in zip(ref_logits, got_logits, strict=True):
        diff = (got - ref).abs().max().item()
        assert diff <= 1e-4, f"{what} {parallel}: max |diff| {diff:.2e}"
    assert got_tokens == ref_tokens


# Intermediate dims off an even block split: (expert, dense) rows; DeepSeek / GLM's one shared expert has the
# expert's. At TP=2, 384 rows = 3 blocks -> 256 / 128, 320 = 2.5 blocks -> 256 / 64 (a partial block); at TP=4,
# 640 = 5 blocks -> 256 / 128 / 128 / 128, 576 = 4.5 blocks -> 128 x 3 / 64 (the first rank's extra block).
UNEVEN = (("moe_intermediate_size", 384), ("intermediate_size", 320))
UNEVEN4 = (("moe_intermediate_size", 640), ("intermediate_size", 576))
BLOCKS = [("qwen3_moe", UNEVEN, TP2), ("deepseek_v3", UNEVEN, TP2),
          ("glm4_moe", (*UNEVEN, ("n_shared_experts", 1)), EP2),
          ("deepseek_v3", UNEVEN, dict(TP2, fp8_activation_quant=True))]  # W8A8: a rank's groups are the global ones
BLOCKS_SLOW = [("qwen3_moe", UNEVEN4, dict(tensor_parallel_size=4))]


@pytest.mark.parametrize("family,sizes,parallel",
                         BLOCKS + [pytest.param(*c, marks=pytest.mark.slow) for c in BLOCKS_SLOW],
                         ids=[f"{f}-{dict(z)['moe_intermediate_size']}-{'ep' if p.get('expert_parallel') else 'tp'}"
                              f"{p['tensor_parallel_size']}{'-w8a8' if p.get('fp8_activation_quant') else ''}"
                              for f, z, p in BLOCKS + BLOCKS_SLOW])
def test_intermediate_splits_on_whole_fp8_blocks_equal_one_process(built, family, sizes, parallel):
    """Block-FP8 intermediate dims whose blocks do not divide by the ranks (the splits vLLM refuses: GLM-4.5-Air's
    1408 / 10944 rows at TP=2..8, Qwen3-235B's 1536 at TP=8): each rank keeps whole blocks, so the sharded
    engine, adapters on the routed experts, the shared expert and the dense MLP included, equals one process."""
    _assert_equals_one_process(*built(family, "block", sizes), parallel, f"{family} {sizes}")


def _fp32_checkpoint(tmp_path, family="qwen3_moe", **overrides):
    hf = tiny_hf_model(family, seed=7, num_hidden_layers=2, **{**SIZES[family], **overrides})
    hf.save_pretrained(str(tmp_path / "model"))
    return tmp_path / "model"


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "ep2"])
def test_quantize_on_load_on_a_rank_equals_the_cut_of_the_global_quantization(tmp_path, expert_parallel):
    """`quantization="fp8"` on a fp32 checkpoint: each rank quantizes the slice it read; the result is the
    one-process quantized weight and scale cut by hand (128-row / -column blocks of the global matrix)."""
    from moelora.config import ModelConfig
    from moelora.engine.config import EngineConfig
    from moelora.engine.loader import build_engine
    from moelora.parallel.build import build_rank_model
    from moelora.parallel.rules import ShardPlan
    from moelora.parallel.shard import Shard

    path = _fp32_checkpoint(tmp_path)
    one = dict(build_engine(path, EngineConfig(**ENGINE, quantization="fp8")).model.weight_params())
    cfg = EngineConfig(**ENGINE, quantization="fp8", tensor_parallel_size=2,
                       expert_parallel=expert_parallel).resolve(ModelConfig.from_hf(path))
    attn, experts = "model.layers.0.self_attn.", "model.layers.0.mlp.experts."
    for rank in range(2):
        got = build_rank_model(path, cfg, Shard(ShardPlan(rank, 2, expert_parallel))).weight_params()
        q, e = slice(256 * rank, 256 * (rank + 1)), slice(3 * rank, 3 * (rank + 1))  # 4 heads x 128; 6 experts
        want = {attn + "q_proj.weight": one[attn + "q_proj.weight"][q],
                attn + "q_proj.weight_scale_inv": one[attn + "q_proj.weight_scale_inv"][2 * rank:2 * rank + 2],
                attn + "o_proj.weight": one[attn + "o_proj.weight"][:, q],
                attn + "o_proj.weight_scale_inv": one[attn + "o_proj.weight_scale_inv"][:, 2 * rank:2 * rank + 2]}
        gu, gus = one[experts + "gate_up_proj"], one[experts + "gate_up_proj_scale_inv"]
        down, downs = one[experts + "down_proj"], one[experts + "down_proj_scale_inv"]
        if expert_parallel:
            want.update({experts + "gate_up_proj": gu[e], experts + "gate_up_proj_scale_inv": gus[e],
                         experts + "down_proj": down[e], experts + "down_proj_scale_inv": downs[e]})
        else:  # gate rows [128 r, 128 (r + 1)) and the same rows of up (256 + ...); down's columns alike
            rows = [*range(128 * rank, 128 * (rank + 1)), *range(256 + 128 * rank, 256 + 128 * (rank + 1))]
            want.update({experts + "gate_up_proj": gu[:, rows],
                         experts + "gate_up_proj_scale_inv": gus[:, [rank, 2 + rank]],
                         experts + "down_proj": down[:, :, 128 * rank:128 * (rank + 1)],
                         experts + "down_proj_scale_inv": downs[:, :, rank:rank + 1]})
        for name, ref in want.items():
            assert got[name].shape == ref.shape, name
            assert got[name].dtype == ref.dtype, name
            assert torch.equal(got[name].view(torch.uint8) if ref.element_size() == 1 else got[name],
                               ref.view(torch.uint8) if ref.element_size() == 1 else ref), name


def test_quantize_on_load_splits_on_whole_blocks(tmp_path):
    """`quantization="fp8"` at TP=2 on 384 expert rows (3 blocks): rank 0 keeps gate / up rows 0..256 (blocks
    0-1), rank 1 rows 256..384 (block 2); the down projection the same columns: the one-process weights cut by
    hand."""
    from moelora.config import ModelConfig
    from moelora.engine.config import EngineConfig
    from moelora.engine.loader import build_engine
    from moelora.parallel.build import build_rank_model, rank_plan
    from moelora.parallel.shard import Shard

    path = _fp32_checkpoint(tmp_path, moe_intermediate_size=384)
    one = dict(build_engine(path, EngineConfig(**ENGINE, quantization="fp8")).model.weight_params())
    model_cfg = ModelConfig.from_hf(path)
    cfg = EngineConfig(**ENGINE, quantization="fp8", tensor_parallel_size=2).resolve(model_cfg)
    experts = "model.layers.0.mlp.experts."
    gu, gus = one[experts + "gate_up_proj"], one[experts + "gate_up_proj_scale_inv"]
    down, downs = one[experts + "down_proj"], one[experts + "down_proj_scale_inv"]
    for rank, (lo, hi), blocks in ((0, (0, 256), [0, 1]), (1, (256, 384), [2])):
        got = build_rank_model(path, cfg, Shard(rank_plan(rank, model_cfg, cfg))).weight_params()
        rows = [*range(lo, hi), *range(384 + lo, 384 + hi)]
        want = {experts + "gate_up_proj": gu[:, rows],
                experts + "gate_up_proj_scale_inv": gus[:, blocks + [3 + b for b in blocks]],
                experts + "down_proj": down[:, :, lo:hi], experts + "down_proj_scale_inv": downs[:, :, blocks]}
        for name, ref in want.items():
            assert got[name].shape == ref.shape, name
            assert torch.equal(got[name].view(torch.uint8) if ref.element_size() == 1 else got[name],
                               ref.view(torch.uint8) if ref.element_size() == 1 else ref), name


def test_fewer_fp8_blocks_than_ranks_is_a_config_error(tmp_path):
    """moe_intermediate_size 128 at TP=2: one 128-row block of the scales for two ranks."""
    path = _fp32_checkpoint(tmp_path, moe_intermediate_size=128)
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=2 cannot split moe_intermediate_size=128: its FP8 "
                                          r"weights hold 1 scale block\(s\) of 128 rows.*--enable-expert-parallel"):
        LLM(path, **ENGINE, **TP2, quantization="fp8")
    LLM(path, **ENGINE, **EP2, quantization="fp8").engine.close()  # whole experts: no split inside a block


def test_dummy_fp8_weights_on_two_ranks_generate_tokens(tmp_path):
    """load_format="dummy" with FP8 storage at TP=2: each rank draws its shard; the tokenizer and chat template
    overrides are rank 0's."""
    from moelora import demo
    from moelora.engine.config import EngineConfig
    from moelora.engine.loader import build_engine

    path = _fp32_checkpoint(tmp_path)
    (path / "model.safetensors").unlink()  # dummy reads only config.json
    engine = build_engine(path, EngineConfig(**ENGINE, quantization="fp8", **TP2), load_format="dummy",
                          tokenizer=demo.model_dir(), chat_template="{{ messages[0]['content'] }}!")
    try:
        assert engine.tokenizer.chat_template == "{{ messages[0]['content'] }}!"
        llm = LLM.__new__(LLM)
        llm.engine, llm.config, llm.tokenizer = engine, engine.model_config, engine.tokenizer
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        assert len(out[0].token_ids) == 4
    finally:
        engine.close()


def test_rank_dummy_weights_agree_on_replicated_tensors_and_differ_on_shards(tmp_path):
    """Two ranks' dummy draws: routers and norms equal (one routing decision a token), split tensors differ."""
    from moelora.config import ModelConfig
    from moelora.engine.config import EngineConfig
    from moelora.parallel.build import build_rank_model
    from moelora.parallel.rules import ShardPlan
    from moelora.parallel.shard import Shard

    path = _fp32_checkpoint(tmp_path)
    cfg = EngineConfig(**ENGINE, tensor_parallel_size=2).resolve(ModelConfig.from_hf(path))
    ranks = [build_rank_model(path, cfg, Shard(ShardPlan(r, 2)), "dummy", seed=3).weight_params() for r in (0, 1)]
    router, q = "model.layers.0.mlp.gate.weight", "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(ranks[0][router], ranks[1][router]) and ranks[0][router].abs().max() > 0
    assert not torch.equal(ranks[0][q], ranks[1][q])




def test_a_rank_reads_only_its_slices_of_fp8_weights_and_scales(built, monkeypatch):
    """Rank 1 of TP=2 on the FP8 block checkpoint: every 256 x 256 weight (experts, dense MLP) is split, so none is
    read whole, nor any of their 2 x 2 block scales."""
    import moelora.parallel.weights as pw
    from moelora.config import ModelConfig
    from moelora.engine.config import EngineConfig
    from moelora.parallel.build import build_rank_model
    from moelora.parallel.rules import ShardPlan
    from moelora.parallel.shard import Shard

    model_dir, _, _ = built("qwen3_moe", "block")
    reads, real = [], pw._read

    def recording(src, cut, ndim):
        out = real(src, cut, ndim)
        reads.append((tuple(src.get_shape()), tuple(out.shape), out.dtype))
        return out
    monkeypatch.setattr(pw, "_read", recording)
    cfg = EngineConfig(**ENGINE).resolve(ModelConfig.from_hf(model_dir))
    build_rank_model(model_dir, cfg, Shard(ShardPlan(1, 2)))
    weights = [r for r in reads if r[0] == (256, 256)]
    scales = [r for r in reads if r[0] == (2, 2)]
    assert weights and all(r[2] == torch.float8_e4m3fn and r[1] in ((128, 256), (256, 128)) for r in weights)
    assert scales and all(r[1] in ((1, 2), (2, 1)) for r in scales)


GPU_ENGINE = dict(max_lora_rank=8, max_loras=3, num_kv_blocks=256, max_model_len=128, max_num_seqs=16)
needs_two_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                    reason="needs 2 GPUs")


def _gpu_run(model_dir, adapters, vocab, **kw):
    llm = LLM(model_dir, adapters, device="cuda", **GPU_ENGINE, **kw)
    try:
        g = torch.Generator().manual_seed(1)
        seqs = [torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in (5, 9, 3, 12, 7, 4)]
        names = ["a", None, "b", "c", "a", "b"]
        outs = greedy_outputs(llm.engine, seqs, names, max_tokens=12)  # (token ids, sampled logprobs) per sequence
        return (llm.logits(seqs, names) if kw.get("dtype") == "float32" else None, [t for t, _ in outs],
                [lp for _, lps in outs for lp in lps], llm.engine.graphs is not None)
    finally:
        llm.engine.close()


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize("parallel,sizes", [(TP2, ()), (EP2, ()), (TP2, UNEVEN)], ids=["tp2", "ep2", "tp2-blocks"])
def test_fp8_on_two_gpus_equals_one(built, parallel, sizes):
    """NCCL: the FP8 block checkpoint at TP=2 / EP=2 equals one GPU (fp32, torch backend, eager: 1e-4 as on the
    CPU, tokens identical); tp2-blocks: intermediate dims split on whole blocks, unevenly."""
    model_dir, adapters, vocab = built("qwen3_moe", "block", sizes)
    kw = dict(dtype="float32", kernel_backend="torch", enforce_eager=True)
    ref, ref_tokens, _, _ = _gpu_run(model_dir, adapters, vocab, **kw)
    got, got_tokens, _, _ = _gpu_run(model_dir, adapters, vocab, **kw, **parallel)
    worst = max((a - b).abs().max().item() for a, b in zip(got, ref, strict=True))
    assert worst <= 1e-4, f"FP8 {parallel} logits differ from one GPU by {worst}"
    assert got_tokens == ref_tokens


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize("sizes", [(), UNEVEN], ids=["even", "blocks"])
def test_fp8_tp2_decode_graphs_equal_tp2_eager(built, sizes):
    """bf16 activations, Triton, FP8 weights at TP=2: decode graphs (NCCL inside) give the eager tokens (blocks:
    the ranks' expert and dense shards of 256 / 128 and 256 / 64 rows, a partial block on rank 1)."""
    model_dir, adapters, vocab = built("qwen3_moe", "block", sizes)
    _, graphed, graphed_lp, has_graphs = _gpu_run(model_dir, adapters, vocab, dtype="bfloat16", **TP2)
    _, eager, eager_lp, _ = _gpu_run(model_dir, adapters, vocab, dtype="bfloat16", enforce_eager=True, **TP2)
    assert has_graphs and graphed == eager
    worst = max(abs(a - b) for a, b in zip(graphed_lp, eager_lp, strict=True))
    assert worst <= 0.05, f"FP8 TP=2 graphs vs eager: max |logprob diff| {worst}"

