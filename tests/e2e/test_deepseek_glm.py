"""DeepSeek-V2/V3 (MLA) and GLM-4-MoE against transformers + PEFT, end to end and piece by piece.

Each family's tiny model is saved as a real checkpoint; adapters are (b) real PEFT (every attention
projection -- all MLA ones --, dense MLP, shared experts, the router through `target_parameters`,
routed experts through `target_parameters`) and (a) per-expert keys (manual-merge oracle); the LLM
loads them from disk and one batch mixing both adapters and base rows must give, row for row, the
oracle's logits (fp32, max abs diff <= 1e-4). The engine's paged latent-cache decode must equal
recomputing from scratch. Routers are checked against transformers' router modules directly.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from moelora import LLM
from moelora.config import ModelConfig, YarnRope
from moelora.engine.request import SamplingParams
from moelora.errors import AdapterError, CheckpointError, ConfigError
from moelora.layers.router import RoutingSpec, grouped_topk
from moelora.lora.formats import LoRAHyperParams, canonicalize
from moelora.models.registry import model_class
from moelora.models.weights import load_checkpoint
from tests.helpers.models import (
    ATTN_SITES,
    add_attention_factors,
    build_from_architecture,
    config_of,
    engine,
    random_adapter,
)
from tests.helpers.oracle import tiny_hf_config, tiny_hf_model
from tests.helpers.oracle_lora import (
    MLP,
    build_peft_adapter,
    merged_model,
    peft_model,
    per_expert_lora,
    write_per_expert,
)
from tests.helpers.runs import greedy_by_recompute, prompts, run

CASES = {"deepseek_v2": ("per_expert", None), "deepseek_v3": ("fused", None), "glm4_moe": ("per_expert", "30KB"),
         "glm4_moe_lite": ("per_expert", "30KB"), "dots1": ("fused", None)}


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run faster on one thread; on a loaded 2-core box, two threads spin-wait (measured:
    the decode test 2 s on one thread, 65 s on two under load)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("family", list(CASES))
def test_mixed_adapters_from_disk_equal_oracle(family, tmp_path):
    hf = tiny_hf_model(family, seed=11)
    form, shard = CASES[family]
    kwargs = {"save_original_format": False} if form == "fused" else {}
    hf.save_pretrained(str(tmp_path / "model"), **kwargs, **({"max_shard_size": shard} if shard else {}))
    keys = set().union(*(load_file(str(p)).keys() for p in (tmp_path / "model").glob("*.safetensors")))
    assert any(k.endswith("experts.gate_up_proj") for k in keys) == (form == "fused")

    peft_dir = build_peft_adapter(hf, tmp_path / "peft", seed=1, r=4, lora_alpha=8, use_rslora=True,
                                  rank_pattern={"kv_b_proj": 6, "v_proj": 6}, alpha_pattern={"o_proj": 3},
                                  target_modules=ATTN_SITES[family] + MLP, router=True)
    raw_a = per_expert_lora(hf, seed=2, r=3, lora_alpha=5, rank_pattern={"down_proj": 2, "q_b_proj": 5})
    add_attention_factors(raw_a, hf, family, seed=5)
    a_dir = write_per_expert(raw_a, tmp_path / "per_expert")

    llm = LLM(tmp_path / "model", {"b": peft_dir, "a": a_dir}, device="cpu", dtype="float32", max_lora_rank=16,
              max_loras=2)
    g = torch.Generator().manual_seed(0)
    names = ["b", None, "a", "b", "a", None]
    seqs = [torch.randint(0, hf.config.vocab_size, (int(n),), generator=g)
            for n in torch.randint(2, 17, (len(names),), generator=g)]
    ours = llm.logits([s.tolist() for s in seqs], names)
    oracles = {"b": peft_model(hf, peft_dir), "a": merged_model(hf, raw_a), None: hf}
    with torch.no_grad():
        for seq, name, got in zip(seqs, names, ours, strict=True):
            ref = oracles[name](seq[None]).logits[0]
            if name is not None:
                assert (ref - hf(seq[None]).logits[0]).abs().max() > 1e-2, f"adapter {name} has no visible effect"
            diff = (got - ref).abs().max().item()
            assert diff <= 1e-4, f"{family} adapter {name}: max |diff| {diff:.2e}"


def test_deepseek_v3_paged_decode_equals_full_recompute():
    hf = tiny_hf_model("deepseek_v3", seed=7)
    model = build_from_architecture(hf, max_loras=4, max_rank=8)
    assert model.kv_cache_shapes() == [((20 + 8,),)] * 3
    adapters = {"x": random_adapter(model, 20, 6), "y": random_adapter(model, 21, 8, frac=0.6)}
    ps = prompts(5, model.config.vocab_size)
    names = ["x", None, "y", "x", None]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    eng = engine(model, adapters, block_size=4)
    outs = run(eng, ps, names, params)
    for p, name, out in zip(ps, names, outs, strict=True):
        assert out == greedy_by_recompute(eng, p, name, 8)
    assert eng.cache.allocator.num_used == 0
    # prefix-cache hits, two-token blocks and chunked prefill read the same latents
    tight = engine(model, adapters, block_size=2, num_kv_blocks=64, max_num_batched_tokens=5)
    assert run(tight, ps + ps, names + names, params) == outs + outs


def _hf_router(family: str, method: str, renorm: bool, seed: int):
    import transformers as tf

    sizes = dict(n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4, routed_scaling_factor=2.5,
                 norm_topk_prob=renorm)
    cfg = tiny_hf_config(family, **sizes, **({"topk_method": method} if family == "deepseek_v2" else {}))
    module = {"deepseek_v2": tf.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2TopkRouter,
              "deepseek_v3": tf.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter,
              "glm4_moe": tf.models.glm4_moe.modeling_glm4_moe.Glm4MoeTopkRouter}[family]
    router = module(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(0.3 * torch.randn(router.weight.shape, generator=g))
        if hasattr(router, "e_score_correction_bias"):
            router.e_score_correction_bias.copy_(0.1 * torch.randn(16, generator=g))
    return router, RoutingSpec(method, 4, renorm, 4, 2, 2.5)


@pytest.mark.parametrize("family,method,renorm", [("deepseek_v2", "greedy", False),
                                                  ("deepseek_v2", "group_limited_greedy", False),
                                                  ("deepseek_v3", "noaux_tc", True), ("glm4_moe", "noaux_tc", False)])
def test_router_equals_transformers(family, method, renorm):
    router, spec = _hf_router(family, method, renorm, seed=3)
    x = torch.randn(64, router.hidden_dim, generator=torch.Generator().manual_seed(4))
    logits, ref_w, ref_ids = router(x)
    w, ids = grouped_topk(logits, spec, getattr(router, "e_score_correction_bias", None))
    assert w.dtype == torch.float32
    order, ref_order = ids.argsort(dim=1), ref_ids.argsort(dim=1)
    assert torch.equal(ids.gather(1, order), ref_ids.gather(1, ref_order))
    torch.testing.assert_close(w.gather(1, order), ref_w.gather(1, ref_order), rtol=1e-6, atol=1e-7)
    if method != "greedy":  # the groups bind: plain top-k over all experts would differ somewhere
        plain = torch.topk(logits.softmax(-1) if family == "deepseek_v2" else logits.sigmoid(), 4).indices
        assert not torch.equal(plain.sort(1).values, ids.sort(1).values)


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "beta_fast": 32, "beta_slow": 1}


@pytest.mark.parametrize("family,mscales", [("deepseek_v2", (0.707, 0.707)), ("deepseek_v3", (1.0, 0.8))])
def test_yarn_rope_equals_transformers(family, mscales):
    rope = dict(YARN, mscale=mscales[0], mscale_all_dim=mscales[1])
    extra = {"rope_interleave": False} if family == "deepseek_v3" else {}  # V2 always interleaves
    hf = tiny_hf_model(family, seed=5, rope_parameters=rope, **extra)
    model = build_from_architecture(hf)
    assert model.config.rope_yarn == YarnRope(4.0, 32, 32.0, 1.0, *mscales)
    ids = torch.randint(0, hf.config.vocab_size, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits[0]
    ours = engine(model).prompt_logits(ids.tolist(), [None])[0]
    assert (ours - ref).abs().max() <= 1e-4


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "glm4_moe", "minimax_m2", "olmoe"])
def test_yarn_rope_of_gqa_families_equals_transformers(family):
    """YaRN on the GQA families (Qwen3's long-context config: rope_scaling yarn, factor 4 over the original
    positions; GLM's and MiniMax's partial rotary take it over their rotary dims), positions past the original 32 up
    to 48: the logits equal transformers'."""
    partial = {"glm4_moe": 0.5, "minimax_m2": 0.5}.get(family)
    rope = dict(YARN, **({"partial_rotary_factor": partial} if partial else {}))
    hf = tiny_hf_model(family, seed=5, rope_parameters=rope)
    model = build_from_architecture(hf)
    assert model.config.rope_yarn == YarnRope(4.0, 32, 32.0, 1.0)
    ids = torch.randint(0, hf.config.vocab_size, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits[0]
        plain = tiny_hf_model(family, seed=5, rope_parameters=dict(rope, rope_type="default"))(ids).logits[0]
    ours = engine(model).prompt_logits(ids.tolist(), [None])[0]
    assert (ours - ref).abs().max() <= 1e-4
    assert (plain - ref).abs().max() > 1e-2  # YaRN changed the logits: the check above is of YaRN


def test_yarn_extends_the_longest_sequence():
    """Under YaRN the longest sequence is the original positions times the factor where that is longer than
    max_position_embeddings (vLLM's derived max_model_len; Qwen3-30B-A3B's long-context setting: 32768 x 4 past its
    40960): max_model_len defaults to it and is refused past it."""
    from moelora.engine.config import EngineConfig

    qwen = config_of(tiny_hf_model("qwen3_moe", max_position_embeddings=40, rope_parameters=YARN))
    assert (qwen.max_position_embeddings, qwen.max_context_len) == (40, 128)
    engine_cfg = dict(device="cpu", dtype="float32", max_loras=0, max_lora_rank=0)
    assert EngineConfig(**engine_cfg).resolve(qwen).max_model_len == 128
    with pytest.raises(ConfigError, match=r"max_model_len=129 exceeds .*40 \(x its YaRN factor: 128\)"):
        EngineConfig(**engine_cfg, max_model_len=129).resolve(qwen)
    v3 = config_of(tiny_hf_model("deepseek_v3", rope_parameters=dict(YARN, mscale=1.0, mscale_all_dim=1.0)))
    assert (v3.max_position_embeddings, v3.max_context_len) == (128, 128)  # DeepSeek-V3's: 4096 x 40 = 163840
    plain = config_of(tiny_hf_model("qwen3_moe", max_position_embeddings=40))
    assert plain.max_context_len == 40 and EngineConfig(**engine_cfg).resolve(plain).max_model_len == 40


def test_hf_overrides_give_a_saved_model_yarn(tmp_path):
    """vLLM's --hf-overrides / --rope-scaling over a saved config.json (transformers 5 keeps the rotary in
    rope_parameters: the override lands there, the file's rope_theta kept; the old `type` spelling read): the engine
    then equals transformers built with that YaRN config, and its max_model_len is the YaRN length."""
    from moelora.config import apply_hf_overrides
    from moelora.engine.config import EngineConfig
    from moelora.engine.loader import build_engine

    tiny_hf_model("qwen3_moe", seed=5, max_position_embeddings=40).save_pretrained(str(tmp_path))
    scaling = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    eng = build_engine(tmp_path, EngineConfig(device="cpu", dtype="float32", max_loras=0, max_lora_rank=0,
                                              hf_overrides={"rope_scaling": scaling}))
    assert eng.model_config.rope_yarn == YarnRope(4.0, 32) and eng.cfg.max_model_len == 128
    hf = tiny_hf_model("qwen3_moe", seed=5, max_position_embeddings=40, rope_parameters=YARN)
    ids = torch.randint(0, hf.config.vocab_size, (1, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits[0]
    assert (eng.prompt_logits(ids.tolist(), [None])[0] - ref).abs().max() <= 1e-4
    raw = {"rope_theta": 5.0, "rope_parameters": {"rope_type": "default", "rope_theta": 7.0}, "x": 1}
    assert apply_hf_overrides(raw, {"rope_scaling": scaling, "x": 2}) == {
        "rope_theta": 5.0, "x": 2, "rope_scaling": scaling,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 7.0, "factor": 4.0,
                            "original_max_position_embeddings": 32}}
    assert apply_hf_overrides(raw, None) is raw
    theta = apply_hf_overrides(raw, {"rope_theta": 9.0})
    assert theta["rope_parameters"] == {"rope_type": "default", "rope_theta": 9.0} and theta["rope_theta"] == 9.0
    assert apply_hf_overrides({"rope_theta": 5.0}, {"rope_theta": 9.0}) == {"rope_theta": 9.0}
    with pytest.raises(ConfigError, match="hf_overrides must be a JSON object"):
        apply_hf_overrides(raw, ["rope_scaling"])


def test_config_fields():
    v2, v3, glm = (config_of(tiny_hf_model(f)) for f in ("deepseek_v2", "deepseek_v3", "glm4_moe"))
    assert (v2.attention, v2.q_lora_rank, v2.kv_lora_rank, v2.qk_nope_head_dim, v2.qk_rope_head_dim, v2.v_head_dim,
            v2.head_dim, v2.num_kv_heads, v2.rotary_dim, v2.rope_interleave) == ("mla", None, 20, 12, 8, 10, 20, 3, 8,
                                                                                True)
    assert (v2.topk_method, v2.n_group, v2.topk_group, v2.routed_scaling_factor, v2.router_correction_bias,
            v2.n_shared_experts, v2.shared_experts_intermediate_size, v2.sparse_layers) == (
        "group_limited_greedy", 3, 2, 1.5, False, 2, 32, (1, 2))
    assert (v3.q_lora_rank, v3.topk_method, v3.norm_topk_prob, v3.router_correction_bias, v3.attention_bias,
            v3.shared_experts_intermediate_size, v3.latent_cache_dim) == (24, "noaux_tc", True, True, True, 16, 28)
    assert (glm.attention, glm.qk_norm, glm.attention_bias, glm.partial_rotary_factor, glm.rotary_dim, glm.head_dim,
            glm.num_kv_heads, glm.topk_method, glm.n_group, glm.topk_group) == (
        "gqa", "per_head", True, 0.5, 8, 16, 2, "noaux_tc", 2, 1)


def _raw(family: str, **changes) -> dict:
    raw = tiny_hf_config(family).to_dict()
    raw["architectures"] = [{"deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
                             "glm4_moe": "Glm4MoeForCausalLM", "glm4_moe_lite": "Glm4MoeLiteForCausalLM",
                             "dots1": "Dots1ForCausalLM"}[family]]
    raw.update(changes)
    return raw


@pytest.mark.parametrize("family,changes,needle", [
    ("deepseek_v2", {"topk_method": "noaux_tc"}, "topk_method"),
    ("deepseek_v3", {"topk_method": "group_limited_greedy"}, "topk_method"),
    ("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func"),
    ("deepseek_v2", {"norm_topk_prob": True}, "norm_topk_prob"),
    ("deepseek_v3", {"rope_parameters": dict(YARN, rope_type="longrope")}, "longrope"),
    ("glm4_moe", {"rope_parameters": dict(YARN, rope_type="dynamic")}, "dynamic"),
    ("deepseek_v3", {"rope_parameters": dict(YARN, low_freq_factor=1.0)}, "low_freq_factor"),
    ("deepseek_v3", {"quantization_config": {"quant_method": "fp8"}}, "fp8"),
    ("deepseek_v2", {"mlp_bias": True}, "mlp_bias"),
    ("deepseek_v3", {"moe_layer_freq": 2}, "moe_layer_freq"),
    ("deepseek_v3", {"n_group": 3}, "n_group"),
    ("deepseek_v3", {"n_group": 8}, "top-2"),
    ("deepseek_v3", {"topk_group": 1, "num_experts_per_tok": 3}, "num_experts_per_tok"),
    ("glm4_moe", {"hidden_act": "gelu"}, "gelu"),
    ("glm4_moe", {"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5625}}, "rotary"),
    ("glm4_moe_lite", {"mlp_layer_types": ["sparse", "dense", "sparse"]}, "mlp_layer_types"),
    ("glm4_moe_lite", {"mlp_layer_types": ["dense", "sparse"]}, "one per layer"),
    ("glm4_moe_lite", {"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}}, "partial_rotary"),
    ("glm4_moe_lite", {"scoring_func": "softmax"}, "scoring_func"),
    ("dots1", {"layer_types": ["full_attention", "sliding_attention", "full_attention"]}, "sliding-window"),
])
def test_unsupported_config_values_are_refused(family, changes, needle):
    with pytest.raises(ConfigError, match=needle):
        ModelConfig.from_dict(_raw(family, **changes))


def test_yarn_derives_factor_and_reads_old_spelling():
    rope = {"type": "yarn", "original_max_position_embeddings": 32, "mscale": 1.0, "mscale_all_dim": 1.0}
    cfg = ModelConfig.from_dict(_raw("deepseek_v3", rope_parameters=None, rope_scaling=rope, rope_theta=5e4))
    assert cfg.rope_theta == 5e4 and cfg.rope_yarn.factor == 128 / 32


def test_mla_adapter_sites_are_checked():
    cfg_v3 = config_of(tiny_hf_model("deepseek_v3"))
    cfg_v2 = dataclasses.replace(cfg_v3, q_lora_rank=None)
    hp = LoRAHyperParams(r=2, lora_alpha=2)

    def keys(module: str, fin: int, fout: int):
        pre = f"base_model.model.model.layers.1.{module}"
        return {f"{pre}.lora_A.weight": torch.ones(2, fin), f"{pre}.lora_B.weight": torch.ones(fout, 2)}

    sites = canonicalize(keys("self_attn.kv_b_proj", 20, 4 * (12 + 10)), hp, cfg_v3)
    assert list(sites) == ["model.layers.1.self_attn.kv_b_proj"]
    for module, cfg, needle in [("self_attn.k_proj", cfg_v3, "no k_proj"), ("self_attn.q_proj", cfg_v3, "no q_proj"),
                                ("self_attn.q_a_proj", cfg_v2, "no q_a_proj")]:
        with pytest.raises(AdapterError, match=needle):
            canonicalize(keys(module, 48, 24), hp, cfg)
    with pytest.raises(AdapterError, match="shape mismatch"):
        canonicalize(keys("mlp.shared_experts.up_proj", 48, 40), hp, cfg_v3)


def test_mtp_layers_are_ignored_and_router_stays_fp32(tmp_path):
    hf = tiny_hf_model("deepseek_v3", seed=9)
    hf.save_pretrained(str(tmp_path))
    file = tmp_path / "model.safetensors"
    sd = load_file(str(file))
    mtp = {"model.layers.3.eh_proj.weight": torch.ones(48, 96), "model.layers.3.enorm.weight": torch.ones(48),
           "model.layers.3.mlp.experts.0.gate_proj.weight": torch.ones(16, 48),
           "model.layers.4.mlp.experts.0.gate_proj.weight": torch.ones(16, 48)}  # a module's second layer
    save_file({**sd, **mtp}, str(file))
    cfg = config_of(hf)
    model = model_class(cfg)(cfg, dtype=torch.bfloat16)
    load_checkpoint(tmp_path, model.weight_params(), progress=False)
    gate = model.model.layers[1].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(gate.e_score_correction_bias, hf.model.layers[1].mlp.gate.e_score_correction_bias)
    assert torch.equal(gate.weight, hf.model.layers[1].mlp.gate.weight)
    assert model.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    # no eh_proj, past the one MTP layer config.json declares (transformers' default num_nextn_predict_layers 1)
    save_file({**sd, "model.layers.4.enorm.weight": torch.ones(48)}, str(file))
    with pytest.raises(CheckpointError, match="model.layers.4.enorm.weight"):
        load_checkpoint(tmp_path, model.weight_params(), progress=False)


def test_mtp_layers_config_json_declares_are_ignored(tmp_path):
    """MiniMax-M2's `num_mtp_modules` (x `mtp_transformer_layers`) or DeepSeek's `num_nextn_predict_layers`: that many
    layers after the decoder are ignored though none holds eh_proj (vLLM's and SGLang's rule); one more is refused."""
    hf = tiny_hf_model("deepseek_v3", seed=9)
    hf.save_pretrained(str(tmp_path))
    file, config = tmp_path / "model.safetensors", tmp_path / "config.json"
    sd = load_file(str(file))
    extra = {f"model.layers.{k}.self_attn.o_proj.weight": torch.ones(48, 48) for k in (3, 4)}
    save_file({**sd, **extra}, str(file))
    cfg = config_of(hf)
    params = model_class(cfg)(cfg, dtype=torch.bfloat16).weight_params()
    raw = json.loads(config.read_text())
    for declared in ({"num_mtp_modules": 2}, {"num_mtp_modules": 1, "mtp_transformer_layers": 2},
                     {"num_nextn_predict_layers": 2}):
        config.write_text(json.dumps({**raw, "num_nextn_predict_layers": 0, **declared}))
        load_checkpoint(tmp_path, params, progress=False)
    config.write_text(json.dumps({**raw, "num_nextn_predict_layers": 0, "num_mtp_modules": 1}))
    with pytest.raises(CheckpointError, match="model.layers.4.self_attn.o_proj.weight"):
        load_checkpoint(tmp_path, params, progress=False)


YARN_HUB = {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
            "original_max_position_embeddings": 4096, "type": "yarn"}
HUB_CONFIGS = {  # the fields of the published config.json files that moelora reads (V3: a bf16 conversion)
    "DeepseekV2ForCausalLM": dict(
        first_k_dense_replace=1, hidden_act="silu", hidden_size=2048, intermediate_size=10944, kv_lora_rank=512,
        max_position_embeddings=163840, moe_intermediate_size=1408, moe_layer_freq=1, n_group=1, n_routed_experts=64,
        n_shared_experts=2, norm_topk_prob=False, num_attention_heads=16, num_experts_per_tok=6, num_hidden_layers=27,
        num_key_value_heads=16, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, rms_norm_eps=1e-6,
        rope_scaling=YARN_HUB, rope_theta=10000, routed_scaling_factor=1.0, scoring_func="softmax", topk_group=1,
        topk_method="greedy", torch_dtype="bfloat16", v_head_dim=128, vocab_size=102400),
    "DeepseekV3ForCausalLM": dict(
        first_k_dense_replace=3, hidden_act="silu", hidden_size=7168, intermediate_size=18432, kv_lora_rank=512,
        max_position_embeddings=163840, moe_intermediate_size=2048, moe_layer_freq=1, n_group=8, n_routed_experts=256,
        n_shared_experts=1, norm_topk_prob=True, num_attention_heads=128, num_experts_per_tok=8, num_hidden_layers=61,
        num_key_value_heads=128, num_nextn_predict_layers=1, q_lora_rank=1536, qk_nope_head_dim=128,
        qk_rope_head_dim=64, rms_norm_eps=1e-6, rope_scaling=dict(YARN_HUB, mscale=1.0, mscale_all_dim=1.0),
        rope_theta=10000, routed_scaling_factor=2.5, scoring_func="sigmoid", topk_group=4, topk_method="noaux_tc",
        torch_dtype="bfloat16", v_head_dim=128, vocab_size=129280),
    "Glm4MoeForCausalLM": dict(
        attention_bias=True, first_k_dense_replace=1, head_dim=128, hidden_act="silu", hidden_size=4096,
        intermediate_size=10944, max_position_embeddings=131072, moe_intermediate_size=1408, n_group=1,
        n_routed_experts=128, n_shared_experts=1, norm_topk_prob=True, num_attention_heads=96, num_experts_per_tok=8,
        num_hidden_layers=46, num_key_value_heads=8, num_nextn_predict_layers=1, partial_rotary_factor=0.5,
        rms_norm_eps=1e-5, rope_scaling=None, rope_theta=1000000, routed_scaling_factor=1.0, topk_group=1,
        torch_dtype="bfloat16", use_qk_norm=False, vocab_size=151552),
    "Glm4MoeLiteForCausalLM": dict(  # GLM-4.7-Flash (transformers' Glm4MoeLiteConfig defaults are this model)
        hidden_size=2048, intermediate_size=10240, moe_intermediate_size=1536, num_hidden_layers=47,
        num_attention_heads=20, num_key_value_heads=20, n_shared_experts=1, n_routed_experts=64,
        routed_scaling_factor=1.8, kv_lora_rank=512, q_lora_rank=768, qk_rope_head_dim=64, v_head_dim=256,
        qk_nope_head_dim=192, n_group=1, topk_group=1, num_experts_per_tok=4, norm_topk_prob=True, hidden_act="silu",
        max_position_embeddings=202752, rms_norm_eps=1e-5, vocab_size=154880, rope_interleave=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000}, torch_dtype="bfloat16"),
}


@pytest.mark.parametrize("arch", list(HUB_CONFIGS))
def test_published_configs_parse(arch):
    cfg = ModelConfig.from_dict(dict(HUB_CONFIGS[arch], architectures=[arch]))
    assert cfg.dtype == "bfloat16" and len(cfg.sparse_layers) == cfg.num_layers - cfg.first_k_dense_replace
    if arch == "Glm4MoeForCausalLM":
        assert (cfg.rotary_dim, cfg.qk_norm, cfg.topk_method, cfg.shared_experts_intermediate_size) == (
            64, "none", "noaux_tc", 1408)
    elif arch == "Glm4MoeLiteForCausalLM":  # one dense layer (transformers' default mlp_layer_types), MLA of q_lora
        assert (cfg.attention, cfg.first_k_dense_replace, cfg.q_lora_rank, cfg.latent_cache_dim, cfg.rotary_dim,
                cfg.topk_method, cfg.routed_scaling_factor, cfg.shared_experts_intermediate_size) == (
            "mla", 1, 768, 576, 64, "noaux_tc", 1.8, 1536)
    else:
        assert cfg.latent_cache_dim == 576 and cfg.rope_yarn.factor == 40 and cfg.rotary_dim == 64
        assert cfg.topk_method == ("greedy" if arch.startswith("DeepseekV2") else "noaux_tc")


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe", "qwen3_moe"])
def test_bfloat16_from_disk_tracks_fp32_oracle(family, tmp_path):
    """bf16 end to end through `LLM` (norm outputs back in bf16, router and correction bias in fp32). A sanity
    bound: bf16 rounding moves these logits by 0.01-0.12 (measured); a dtype bug moves them by whole units."""
    hf = tiny_hf_model(family, seed=13)
    hf.save_pretrained(str(tmp_path))
    llm = LLM(tmp_path, device="cpu", dtype="bfloat16")
    ids = torch.randint(0, hf.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids).logits[0]
    assert (llm.logits(ids.tolist())[0] - ref).abs().max() < 0.25
