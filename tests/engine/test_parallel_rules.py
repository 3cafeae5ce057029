"""Sharding rules and sliced loading, in one process (no group): each rank's model has its shard's shapes, its
weights are exactly its slices of the checkpoint, and it reads only those slices (per-expert keys of other ranks'
experts not at all)."""

from __future__ import annotations

import re

import pytest
import torch

import moelora.parallel.weights as pw
from moelora.config import ModelConfig
from moelora.engine.config import EngineConfig
from moelora.errors import ConfigError
from moelora.parallel.build import build_rank_model
from moelora.parallel.rules import ShardPlan
from moelora.parallel.shard import Shard, apply_cut
from tests.helpers.oracle import tiny_hf_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("rules") / "model"
    hf = tiny_hf_model("qwen3_moe", seed=2)
    hf.save_pretrained(str(path))  # per-expert (Hub) keys on disk
    return path, {k: v.detach() for k, v in hf.state_dict().items()}  # fused experts in memory: moelora's names


@pytest.mark.parametrize("size,rank,ep", [(2, 1, False), (2, 0, True), (4, 3, False), (2, 1, True)])
def test_rank_weights_are_its_slices_and_only_those_are_read(checkpoint, monkeypatch, size, rank, ep):
    path, hf_state = checkpoint
    reads = []
    real = pw._read

    def recording(src, cut, ndim):
        out = real(src, cut, ndim)
        reads.append((tuple(src.get_shape()), tuple(out.shape)))
        return out
    monkeypatch.setattr(pw, "_read", recording)
    cfg = EngineConfig(device="cpu", dtype="float32", max_loras=0, max_lora_rank=0).resolve(ModelConfig.from_hf(path))
    plan = ShardPlan(rank, size, ep)
    model = build_rank_model(path, cfg, Shard(plan))
    model_cfg = model.config
    for name, local in model.weight_params().items():
        want = apply_cut(hf_state[name], plan.cut(name, model_cfg))
        if name.endswith("embed_tokens.weight") or name.endswith("lm_head.weight"):
            assert torch.equal(local[: want.shape[0]], want) and not local[want.shape[0]:].any(), name
        else:
            assert torch.equal(local, want), name
    split_reads = [r for r in reads if r[0] != r[1]]
    assert split_reads, "every rank of a split model reads some tensors partly"
    if ep:  # per-expert keys: this rank's experts only (6 experts, 2 sparse layers, 3 projections)
        expert_reads = [r for r in reads if len(r[0]) == 2 and 40 in r[0] and 48 in r[0]]
        assert len(expert_reads) == 2 * 3 * 3


def test_kv_heads_replicate_below_the_rank_count():
    raw = tiny_hf_model("qwen3_moe").config.to_dict()
    cfg = ModelConfig.from_dict(dict(raw, architectures=["Qwen3MoeForCausalLM"]))
    assert [ShardPlan(r, 4).kv_heads(cfg) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [ShardPlan(r, 2).kv_heads(cfg) for r in range(2)] == [(0, 1), (1, 1)]
    assert ShardPlan(1, 2).vocab(cfg) == (49, 48, 49)  # 97 rows: 49 + 48, the last block padded by one


def test_block_fp8_intermediate_splits_keep_whole_blocks():
    """GLM-4.5-Air's sizes (experts and shared expert 1408 rows = 11 blocks of 128, dense MLP 10944 = 85.5): at
    TP=4 each rank keeps whole blocks, the first ranks one more, the last rank's last block partial; sizes that
    divide into blocks evenly split as without FP8; bf16 (no unit) splits evenly."""
    from moelora.parallel.rules import split_unit
    from moelora.quant.config import FP8Config
    from tests.helpers.oracle import tiny_hf_config

    raw = tiny_hf_config("glm4_moe", moe_intermediate_size=1408, intermediate_size=10944, n_shared_experts=1,
                         num_attention_heads=96, num_key_value_heads=8).to_dict()
    cfg = ModelConfig.from_dict(dict(raw, architectures=["Glm4MoeForCausalLM"]))
    unit = split_unit(FP8Config("fp8", "block", "group", (128, 128)))
    assert unit == 128 and split_unit(FP8Config("compressed-tensors", "channel", "token")) is None
    plans = [ShardPlan(r, 4, unit=unit) for r in range(4)]
    for plan in plans:
        plan.check(cfg)
    assert [p._part(1408) for p in plans] == [((0, 384),), ((384, 768),), ((768, 1152),), ((1152, 1408),)]
    assert [p._part(10944) for p in plans] == [((0, 2816),), ((2816, 5632),), ((5632, 8320),), ((8320, 10944),)]
    assert [p.local_config(cfg).moe_intermediate_size for p in plans] == [384, 384, 384, 256]
    assert [p.local_config(cfg).intermediate_size for p in plans] == [2816, 2816, 2688, 2624]
    assert [p.local_config(cfg).shared_experts_intermediate_size for p in plans] == [384, 384, 384, 256]
    layer = "model.layers.1.mlp."
    assert plans[3].cut(layer + "experts.gate_up_proj", cfg) == ((1, ((1152, 1408), (2560, 2816))),)
    assert plans[3].cut(layer + "experts.down_proj", cfg) == ((2, ((1152, 1408),)),)
    assert plans[1].cut(layer + "shared_experts.down_proj.weight", cfg) == ((1, ((384, 768),)),)
    assert plans[2].cut("model.layers.0.mlp.gate_proj.weight", cfg) == ((0, ((5632, 8320),)),)
    assert [ShardPlan(r, 8, unit=128)._part(2048) for r in (0, 7)] == [((0, 256),), ((1792, 2048),)]
    assert [ShardPlan(r, 2)._part(1408) for r in (0, 1)] == [((0, 704),), ((704, 1408),)]
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=16 cannot split moe_intermediate_size=1408: its "
                                          r"FP8 weights hold 11 scale block\(s\) of 128 rows"):
        ShardPlan(0, 16, unit=128).check(cfg)


def test_untargeted_expert_parallel_experts_free_their_lora_slots(checkpoint):
    from moelora.layers.parallel_experts import ExpertParallelExperts

    path, _ = checkpoint
    cfg = EngineConfig(device="cpu", dtype="float32", max_loras=2, max_lora_rank=4,
                       lora_target_modules=("self_attn",)).resolve(ModelConfig.from_hf(path))
    model = build_rank_model(path, cfg, Shard(ShardPlan(1, 2, True)))
    experts = [m for m in model.modules() if isinstance(m, ExpertParallelExperts)]
    assert experts and all(not m.has_lora and m.lora_gate_up_a is None and m.lora_down_b is None for m in experts)


def test_serve_parallel_flags_reach_the_engine_config():
    from moelora.cli import build_parser, serve_engine_config

    cfg = serve_engine_config(build_parser().parse_args(["serve", "--tensor-parallel-size", "4",
                                                         "--enable-expert-parallel"]))
    assert (cfg.tensor_parallel_size, cfg.expert_parallel) == (4, True)
    default = serve_engine_config(build_parser().parse_args(["serve"]))
    assert (default.tensor_parallel_size, default.expert_parallel) == (1, False)
    assert serve_engine_config(build_parser().parse_args(["serve", "-tp", "2"])).tensor_parallel_size == 2


def test_serve_node_flags(monkeypatch, capsys):
    """Several hosts: vLLM's --nnodes / --node-rank / --master-addr / --master-port / --headless, torchrun's
    environment variables as their defaults; one node keeps a free port (no fixed one two servers would share)."""
    from moelora.cli import build_parser, main, serve_engine_config

    def parse(argv):  # a new parser each time: the defaults are read from the environment when it is built
        return build_parser().parse_args(argv)

    cfg = serve_engine_config(parse(["serve", "-tp", "4", "--nnodes", "2", "--master-addr", "10.0.0.1",
                                     "--master-port", "29600"]))
    assert (cfg.nnodes, cfg.master_addr, cfg.master_port) == (2, "10.0.0.1", 29600)
    assert cfg.parallel_config.ranks_per_node == 2
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.2")
    monkeypatch.setenv("MASTER_PORT", "29700")
    monkeypatch.setenv("NNODES", "2")
    args = parse(["serve", "-tp", "2"])
    assert (args.nnodes, args.master_addr, args.master_port, args.node_rank) == (2, "10.0.0.2", 29700, 0)
    monkeypatch.setenv("NNODES", "1")
    assert serve_engine_config(parse(["serve", "-tp", "2"])).master_port == 0
    for argv, needle in ((["--node-rank", "1", "--nnodes", "2"], "--headless"), (["--headless"], "nodes 1..N-1"),
                         (["--nnodes", "2", "--node-rank", "2", "--headless"], "not one of"),
                         (["--nnodes", "2", "-tp", "3"], "must divide")):
        with pytest.raises(SystemExit) as exit_:
            main(["serve", *argv])
        assert exit_.value.code == 2 and needle in capsys.readouterr().err


def test_parallel_config_refuses_uneven_nodes_and_no_port():
    from moelora.errors import ConfigError
    from moelora.parallel.config import ParallelConfig

    with pytest.raises(ConfigError, match="divide"):
        ParallelConfig(4, nnodes=3, master_port=29500)
    with pytest.raises(ConfigError, match="fixed TCP port"):
        ParallelConfig(4, nnodes=2)


def test_headless_node_without_rank_0_raises_worker_error():
    import socket

    from moelora.errors import WorkerError
    from moelora.parallel.node import run_node

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(WorkerError, match=f"no rank 0 at 127.0.0.1:{port}"):
        run_node("127.0.0.1", port, 2, 1, join_timeout_s=1)


def test_several_ranks_refuse_an_fp8_block_split_before_spawning(monkeypatch):
    """What several ranks still refuse, before any worker is spawned: FP8 block scales split inside a 128 block
    (the demo model's 4 x 32 query rows are 64 per rank at TP=2; its experts whole under EP), a ConfigError naming
    the tensor, the dimension and the block size; and an intermediate dim of fewer blocks than ranks (its 80
    expert rows are one partial block)."""
    import moelora.parallel.engine as pe
    from moelora import demo
    from moelora.engine.loader import build_engine
    from moelora.errors import ConfigError

    def no_spawn(*args, **kw):
        raise AssertionError("a worker was spawned")
    monkeypatch.setattr(pe, "Driver", no_spawn)
    cfg = EngineConfig(device="cpu", tensor_parallel_size=2, expert_parallel=True, quantization="fp8")
    with pytest.raises(ConfigError, match=re.escape("self_attn.q_proj.weight (num_attention_heads x head dim) at "
                                                    "rows 0..64") + ".*weight_block_size 128"):
        build_engine(demo.model_dir(), cfg)
    cfg = EngineConfig(device="cpu", tensor_parallel_size=2, quantization="fp8")
    with pytest.raises(ConfigError, match=re.escape("tensor_parallel_size=2 cannot split moe_intermediate_size=80: "
                                                    "its FP8 weights hold 1 scale block(s) of 128 rows")):
        build_engine(demo.model_dir(), cfg)


# Shipped FP8 checkpoints' shapes (their config.json, cut to their dense layers + one MoE layer: every layer of a
# kind splits alike), with the block-FP8 weights of `--quantization fp8` (128 x 128, as their checkpoints ship).
_GLM_AIR = dict(family="glm4_moe", vocab_size=151552, hidden_size=4096, num_layers=2, num_heads=96, num_kv_heads=8,
                head_dim=128, intermediate_size=10944, moe_intermediate_size=1408, num_experts=128, top_k=8,
                norm_topk_prob=True, topk_method="noaux_tc", router_correction_bias=True, n_shared_experts=1,
                first_k_dense_replace=1, partial_rotary_factor=0.5, attention_bias=True)
SHIPPED = {
    "glm45_air": _GLM_AIR,
    "glm45": dict(_GLM_AIR, hidden_size=5120, num_layers=4, intermediate_size=12288, moe_intermediate_size=1536,
                  num_experts=160, first_k_dense_replace=3, qk_norm="per_head"),
    "qwen3_235b": dict(family="qwen3_moe", vocab_size=151936, hidden_size=4096, num_layers=1, num_heads=64,
                       num_kv_heads=4, head_dim=128, intermediate_size=12288, moe_intermediate_size=1536,
                       num_experts=128, top_k=8, norm_topk_prob=True, qk_norm="per_head"),
    "qwen3_30b": dict(family="qwen3_moe", vocab_size=151936, hidden_size=2048, num_layers=1, num_heads=32,
                      num_kv_heads=4, head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                      top_k=8, norm_topk_prob=True, qk_norm="per_head"),
    "minimax_m2": dict(family="minimax_m2", vocab_size=200064, hidden_size=3072, num_layers=1, num_heads=48,
                       num_kv_heads=8, head_dim=128, intermediate_size=1536, moe_intermediate_size=1536,
                       num_experts=256, top_k=8, norm_topk_prob=True, qk_norm="whole", partial_rotary_factor=0.5,
                       topk_method="noaux_tc", router_correction_bias=True),
    "deepseek_v3": dict(family="deepseek_v3", vocab_size=129280, hidden_size=7168, num_layers=4, num_heads=128,
                        num_kv_heads=128, head_dim=192, intermediate_size=18432, moe_intermediate_size=2048,
                        num_experts=256, top_k=8, norm_topk_prob=True, attention="mla", q_lora_rank=1536,
                        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                        topk_method="noaux_tc", n_group=8, topk_group=4, router_correction_bias=True,
                        n_shared_experts=1, first_k_dense_replace=3, rope_interleave=True),
}
# (model, tensor_parallel_size, expert parallel): expert rows a rank under TP, or the ConfigError's words
SPLITS = [("glm45_air", 2, False, [768, 640]), ("glm45_air", 4, False, [384, 384, 384, 256]),
          ("glm45_air", 8, True, None), ("glm45", 8, False, [256] * 4 + [128] * 4),
          ("qwen3_235b", 8, False, [256] * 4 + [128] * 4), ("qwen3_235b", 4, False, [384] * 4),
          ("qwen3_30b", 4, False, [256, 256, 128, 128]), ("qwen3_30b", 8, True, None),
          ("qwen3_30b", 8, False, "6 scale block(s) of 128 rows"), ("minimax_m2", 8, False, [256] * 4 + [128] * 4),
          ("deepseek_v3", 8, False, [256] * 8), ("deepseek_v3", 16, True, None),
          ("deepseek_v3", 32, True, "16 scale block(s)")]


@pytest.mark.parametrize("model,size,ep,want", SPLITS, ids=[f"{m}-{'ep' if e else 'tp'}{n}" for m, n, e, _ in SPLITS])
def test_shipped_fp8_checkpoints_split_on_their_blocks(model, size, ep, want):
    """Every rank's cut of every weight and scale of the model (meta tensors, nothing loaded) falls on the 128 blocks
    (`check_fp8_split`), the intermediate dims' ranges tile them in whole blocks, or the refusal names the dim."""

    from moelora.parallel.build import check_fp8_split, rank_plan

    model_cfg = ModelConfig(**SHIPPED[model], max_position_embeddings=4096, dtype="bfloat16").resolve()
    cfg = EngineConfig(device="cpu", dtype="bfloat16", quantization="fp8", tensor_parallel_size=size,
                       expert_parallel=ep)
    plans = [rank_plan(r, model_cfg, cfg) for r in range(size)]
    assert all(p.unit == 128 for p in plans)
    if isinstance(want, str):
        with pytest.raises(ConfigError, match=re.escape(want)):
            plans[0].check(model_cfg)
        return
    plans[0].check(model_cfg)
    check_fp8_split(model_cfg, cfg, plans[0])
    dims = [model_cfg.shared_experts_intermediate_size, model_cfg.intermediate_size if any(
        not model_cfg.is_sparse(i) for i in range(model_cfg.num_layers)) else 0, 0 if ep else
        model_cfg.moe_intermediate_size]
    for full in (d for d in dims if d):
        ranges = [p._part(full)[0] for p in plans]
        assert ranges[0][0] == 0 and ranges[-1][1] == full and all(a % 128 == 0 and a < b for a, b in ranges)
        assert all(ranges[i][1] == ranges[i + 1][0] for i in range(size - 1))
    if want is not None:
        assert [p.local_config(model_cfg).moe_intermediate_size for p in plans] == want
    else:  # EP: whole experts, an even share each
        assert {p.local_config(model_cfg).moe_intermediate_size for p in plans} == {model_cfg.moe_intermediate_size}
        assert {p.experts(model_cfg)[1] for p in plans} == {model_cfg.num_experts // size}
