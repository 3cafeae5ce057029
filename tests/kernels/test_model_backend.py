"""A whole tiny model on the Triton backend equals the torch backend: every family's wiring of the fused norm /
residual, q/k norm + rotary, softmax router and SiLU·up kernels, next to the attention, MoE and LoRA kernels, with a
mixed-adapter batch; q/k/v as one merged projection (one `lora_linear` launch with segments per layer) and, with
`merge_qkv=False`, as three; and DeepSeek-V3's decode steps (MLA absorbed on the Triton kernels), also from a
block-FP8 checkpoint. Under TRITON_INTERPRET=1 on the CPU only: exact fp32 comparisons, which CUDA's TF32 dots do
not meet (kernel_env's `interp_only`); tests/engine's GPU tests compare the backends on CUDA.
Shape legend: T tokens of the step, V vocab.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.interp  # `make test` runs it with TRITON_INTERPRET=1 (set before triton is imported)
triton = pytest.importorskip("triton")

import moelora.kernels.lora_linear as lora_kernels  # noqa: E402
import moelora.kernels.norm as norm_kernels  # noqa: E402
import moelora.kernels.rotary as rotary_kernels  # noqa: E402
import moelora.kernels.silu_mul as silu_kernels  # noqa: E402
import moelora.kernels.softmax_topk as router_kernels  # noqa: E402
from moelora.layers.mlp import DenseMLP  # noqa: E402
from moelora.layers.moe import SparseMoE  # noqa: E402
from tests.helpers.kernel_env import DEV, interp_only, planned_everywhere, record_planned_sites  # noqa: E402
from tests.helpers.models import build, engine, random_adapter  # noqa: E402
from tests.helpers.oracle import tiny_hf_model  # noqa: E402

LAUNCHERS = [(norm_kernels, "rms_norm"), (norm_kernels, "add_rms_norm"), (rotary_kernels, "qk_norm_rope"),
             (router_kernels, "softmax_topk"), (silu_kernels, "silu_mul")]


def count_launches(monkeypatch) -> dict[str, int]:
    """Wrap each launcher so the test knows the Triton path really ran (layers import them per call)."""
    calls = {name: 0 for _, name in LAUNCHERS} | {"add_rms_norm+delta2": 0}
    for module, name in LAUNCHERS:
        fn = getattr(module, name)

        def counted(*args, _fn=fn, _name=name, **kw):
            calls[_name] += 1
            if kw.get("delta2") is not None:  # an MoE block's (routed, shared) summed by the next norm
                calls[_name + "+delta2"] += 1
            return _fn(*args, **kw)

        monkeypatch.setattr(module, name, counted)
    return calls


def record_lora_linear(monkeypatch) -> list[tuple[int, tuple[int, ...]]]:
    """(N_out, LoRA segments) of every `lora_linear` launch (the layers import it per call)."""
    calls = []
    fn = lora_kernels.lora_linear

    def recorded(x, weight, bias, lora, **kw):
        calls.append((weight.shape[0], lora.segments if lora is not None else ()))
        return fn(x, weight, bias, lora, **kw)

    monkeypatch.setattr(lora_kernels, "lora_linear", recorded)
    return calls


def prompts(hf, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, hf.config.vocab_size, (n,), generator=g).tolist() for n in (6, 1, 9)]


def assert_close(got, want):
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape
        assert (a - b).abs().max() <= 1e-4 * max(1.0, b.abs().max().item())


# qwen3_moe: per-head q/k norm and a dense layer; qwen2_moe: gated shared expert, q/k/v bias, a dense
# layer, no q/k norm; olmoe: q/k norm over all heads; minimax_m2: that norm, a partial rotary and a biased
# sigmoid router of one group on `softmax_topk`'s noaux_tc selection.
@interp_only
@pytest.mark.parametrize("family,fused", [("qwen3_moe", {"qk_norm_rope", "silu_mul"}),
                                          ("qwen2_moe", {"qk_norm_rope", "silu_mul"}),
                                          ("olmoe", {"qk_norm_rope", "rms_norm"}),
                                          ("minimax_m2", {"qk_norm_rope", "rms_norm"})])
def test_triton_backend_logits_equal_torch_backend(family, fused, monkeypatch):
    hf = tiny_hf_model(family, seed=21)
    model = build(hf, max_loras=2, max_rank=4).to(DEV)
    adapters = {"a": random_adapter(model, seed=22, rank=4, frac=0.6)}
    calls, lora_calls = compare_backends(model, adapters, hf.config.vocab_size, (6, 1, 9), 23, monkeypatch)
    layers = hf.config.num_hidden_layers
    assert calls["add_rms_norm"] == 2 * layers  # one add + norm per layer and step, and the final one
    assert calls["add_rms_norm+delta2"] == (shared_moe_layers(model) if family == "qwen2_moe" else 0)
    assert calls["softmax_topk"] >= 1 and all(calls[name] >= 1 for name in fused), calls
    c = model.config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    # q/k/v: one launch a layer; gate/up of a dense MLP or shared expert: one launch (DenseMLP's gate_up_proj)
    merged = [[(q + 2 * kv, (q, kv, kv))] + [(2 * m.intermediate, (m.intermediate,) * 2) for m in layer.modules()
                                             if isinstance(m, DenseMLP)] for layer in model.model.layers]
    assert any(len(calls) > 1 for calls in merged) == (family not in ("olmoe", "minimax_m2"))  # no dense MLP
    assert [call for call in lora_calls if call[1]] == [call for calls in merged for call in calls]


def shared_moe_layers(model) -> int:
    """Layers whose MoE block has shared experts: each hands (routed, shared) to the next norm (one forward)."""
    return sum(isinstance(layer.mlp, SparseMoE) and layer.mlp.has_shared for layer in model.model.layers)


def compare_backends(model, adapters, vocab, lengths, seed, monkeypatch):
    """Logits of a mixed batch (adapter "a", base, "a") on the Triton backend equal the torch
    backend's within 1e-4; returns how often each fused launcher ran and the lora_linear launches."""
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
    names = ["a", None, "a"]
    want = engine(model, adapters, max_loras=2, device=DEV, kernel_backend="torch").prompt_logits(seqs, names)
    calls = count_launches(monkeypatch)
    lora_calls = record_lora_linear(monkeypatch)
    got = engine(model, adapters, max_loras=2, device=DEV, kernel_backend="triton").prompt_logits(seqs, names)
    assert_close(got, want)
    return calls, lora_calls


# glm4_moe: partial rotary with per-head q/k norm, sigmoid group-limited router (6 experts in groups of 3: torch's
# `grouped_topk`), shared experts, a dense first layer; deepseek_v3: MLA (its inner norms on the rms_norm kernel),
# shared experts, its router (groups of 2) on `softmax_topk` where the step's router LoRA keeps two launches.
@interp_only
@pytest.mark.parametrize("family,fused", [("glm4_moe", {"qk_norm_rope", "silu_mul"}),
                                          ("deepseek_v3", {"rms_norm", "silu_mul", "softmax_topk"}),
                                          ("glm4_moe_lite", {"rms_norm", "silu_mul", "softmax_topk"}),
                                          ("dots1", {"qk_norm_rope", "silu_mul"})])
def test_triton_backend_logits_equal_torch_backend_glm_deepseek(family, fused, monkeypatch):
    from moelora.config import ModelConfig
    from moelora.models.registry import model_class
    from tests.helpers.oracle import randomize_

    hf = tiny_hf_model(family, seed=31)
    randomize_(hf, seed=31)  # random correction bias and wide routers: selection has a margin
    cfg = ModelConfig.from_dict(dict(hf.config.to_dict(), architectures=[type(hf).__name__]))
    model = model_class(cfg)(cfg, max_loras=2, max_rank=4)
    model.load_state_dict(hf.state_dict(), strict=True)
    model = model.eval().to(DEV)
    adapters = {"a": random_adapter(model, seed=32, rank=4, frac=0.7)}
    calls, _ = compare_backends(model, adapters, hf.config.vocab_size, (5, 1, 8), 33, monkeypatch)
    assert calls["add_rms_norm"] == 2 * hf.config.num_hidden_layers
    assert calls["add_rms_norm+delta2"] == shared_moe_layers(model) >= 1  # routed + shared added by the next norm
    assert all(calls[name] >= 1 for name in fused) and ("softmax_topk" in fused or calls["softmax_topk"] == 0), calls

@interp_only
def test_unmerged_qkv_equals_torch_backend_with_two_more_launches_a_layer(monkeypatch):
    """The off switches (`merge_qkv=False`, `merge_gate_up=False`): q, k and v each through their own segment
    (views of the merged weight, bias and LoRA buffers), gate and up likewise; the same logits as the merged
    torch path, two more launches a layer for q/k/v and one more a dense MLP or shared expert."""
    hf = tiny_hf_model("qwen2_moe", seed=24)  # q/k/v bias
    model = build(hf, max_loras=2, max_rank=4).to(DEV)
    adapters = {"a": random_adapter(model, seed=25, rank=4), "b": random_adapter(model, seed=26, rank=3, frac=0.5)}
    seqs, names = prompts(hf, 27), ["a", None, "b"]
    want = engine(model, adapters, max_loras=2, device=DEV, kernel_backend="torch").prompt_logits(seqs, names)
    counts = {}
    for merge in (True, False):
        lora_calls = record_lora_linear(monkeypatch)
        got = engine(model, adapters, max_loras=2, device=DEV, kernel_backend="triton",
                     merge_qkv=merge, merge_gate_up=merge).prompt_logits(seqs, names)
        assert_close(got, want)
        counts[merge] = (len(lora_calls), sum(bool(segs) for _, segs in lora_calls))
    layers = hf.config.num_hidden_layers
    mlps = sum(isinstance(m, DenseMLP) for m in model.modules())  # qwen2_moe: a shared expert a MoE layer
    assert mlps >= layers
    assert counts[True][1] == layers + mlps and counts[False][1] == 0
    assert counts[False][0] == counts[True][0] + 2 * layers + mlps


@interp_only
def test_rows_grouped_by_slot_equal_torch_backend(monkeypatch):
    """`EngineConfig.group_lora_rows`: the runner groups the step's rows by slot once and every dense
    site takes the "planned" delta (widened to the tiny model's shapes by an injected policy): the same
    logits as the torch backend, with rows of two adapters and of none."""
    planned = record_planned_sites(monkeypatch)
    hf = tiny_hf_model("qwen2_moe", seed=24)
    model = planned_everywhere(build(hf, max_loras=2, max_rank=4).to(DEV))
    adapters = {"a": random_adapter(model, seed=25, rank=4), "b": random_adapter(model, seed=26, rank=3, frac=0.5)}
    g = torch.Generator().manual_seed(28)
    seqs = [torch.randint(0, hf.config.vocab_size, (n,), generator=g).tolist() for n in (9, 4, 12)]
    names = ["a", None, "b"]
    want = engine(model, adapters, max_loras=2, device=DEV, kernel_backend="torch").prompt_logits(seqs, names)
    got = engine(model, adapters, max_loras=2, device=DEV, kernel_backend="triton").prompt_logits(seqs, names)
    assert planned and all(planned)
    assert_close(got, want)


@interp_only
def test_spread_moe_lora_in_the_model_equals_torch_backend(tmp_path, monkeypatch):
    """"spread" (the routed-expert LoRA of the tables' M=1 entries) inside a whole model, given to the routed
    experts by a fused-MoE table file (EngineConfig.fused_moe_table) that picks it at every M, with tiles that
    split the shrinks into several partials: a mixed batch (two adapters of different ranks and base rows)
    equals the torch backend."""
    import json

    import moelora.kernels.fused_moe as fused_moe_module
    from moelora.kernels.moe_config import shape_key

    hf = tiny_hf_model("qwen3_moe", seed=41)
    model = build(hf, max_loras=2, max_rank=4).to(DEV)
    adapters = {"a": random_adapter(model, seed=42, rank=4), "b": random_adapter(model, seed=43, rank=3, frac=0.5)}
    c = hf.config
    tile = {"block_n": 16, "block_k": 16, "num_warps": 4, "num_stages": 2}
    entry = {"tiles": dict(block_m=16, gate_up=tile, down=tile), "lora": dict(path="spread", block_k=16, block_n=16)}
    key = shape_key(c.num_experts, c.hidden_size, c.moe_intermediate_size, torch.float32)
    table = tmp_path / "spread.json"
    table.write_text(json.dumps({"device": "test", "configs": {key: {"4096": entry}}}))
    modes = []
    real_path = fused_moe_module.lora_path
    monkeypatch.setattr(fused_moe_module, "lora_path", lambda *a: modes.append(real_path(*a)) or modes[-1])
    g = torch.Generator().manual_seed(44)
    seqs = [torch.randint(0, c.vocab_size, (n,), generator=g).tolist() for n in (7, 3, 10)]
    names = ["a", None, "b"]
    want = engine(model, adapters, max_loras=2, device=DEV, kernel_backend="torch").prompt_logits(seqs, names)
    got = engine(model, adapters, max_loras=2, device=DEV, kernel_backend="triton",
                 fused_moe_table=str(table)).prompt_logits(seqs, names)
    assert modes and {m[0].name for m in modes} == {"spread"}, modes
    assert_close(got, want)


@interp_only
def test_mla_decode_on_triton_equals_torch_backend(monkeypatch):
    """DeepSeek-V3's decode steps in the absorbed form on the Triton kernels (the rope + cache-store launch, the
    absorb GEMM into its [T, N, C] buffer with the kv_b LoRA term, latent attention, the output and its LoRA term;
    awkward MLA widths C 80, Dn 32, Dv 24) against the torch backend's absorbed twins: a mixed batch decoding
    greedily, the same tokens and logprobs within 1e-4 (the prompt-logits tests run prefill only; prefill takes the
    rope + cache-store launch too)."""
    import moelora.kernels.mla_rope as mla_rope_module
    from tests.helpers.gpu_engine import DSV3_SIZES, generate
    from tests.helpers.models import build_from_architecture
    from tests.helpers.oracle import randomize_

    hf = tiny_hf_model("deepseek_v3", seed=51, **DSV3_SIZES)
    randomize_(hf, seed=51)  # random correction bias and wide routers: selection has a margin
    model = build_from_architecture(hf, max_loras=2, max_rank=4).to(DEV)
    adapters = {"a": random_adapter(model, seed=52, rank=4), "b": random_adapter(model, seed=53, rank=3, frac=0.6)}
    g = torch.Generator().manual_seed(54)
    prompts = [torch.randint(3, hf.config.vocab_size, (n,), generator=g).tolist() for n in (5, 2, 7)]
    names = ["a", None, "b"]
    want = generate(engine(model, adapters, max_loras=2, device=DEV, kernel_backend="torch"), prompts, names, 4)
    stores = []
    real = mla_rope_module.mla_rope_store
    monkeypatch.setattr(mla_rope_module, "mla_rope_store", lambda *a, **kw: stores.append(1) or real(*a, **kw))
    got = generate(engine(model, adapters, max_loras=2, device=DEV, kernel_backend="triton"), prompts, names, 4)
    layers = hf.config.num_hidden_layers
    assert len(stores) == 4 * layers, len(stores)  # the prefill step, decode steps 2..4: each layer once
    for a, b in zip(got, want, strict=True):
        assert a.output_ids == b.output_ids, a.request_id
        assert max(abs(x[0] - y[0]) for x, y in zip(a.logprobs, b.logprobs, strict=True)) <= 1e-4


@interp_only
def test_fp8_deepseek_decode_on_triton_equals_torch_backend(tmp_path, monkeypatch):
    """A block-FP8 DeepSeek-V3 checkpoint with a PEFT adapter on attention, MLPs and routed experts, decoding a
    mixed batch on the Triton kernels (W8A16: the FP8 linears with their LoRA, the FP8 experts, MLA's absorbed
    decode reading kv_b_proj dequantized) against the torch backend on the dequantized weights: the same tokens
    and logprobs within 1e-4."""
    import moelora.kernels.fp8_linear as fp8_linear_module
    from moelora import LLM
    from tests.helpers.fp8_models import SITES, fp8_model
    from tests.helpers.fp8_oracle import write_fp8_checkpoint
    from tests.helpers.gpu_engine import generate
    from tests.helpers.oracle_lora import MLP, build_peft_adapter

    hf = fp8_model("deepseek_v3", seed=8)
    write_fp8_checkpoint(hf, tmp_path / "model", "block", "fused")
    peft_dir = build_peft_adapter(hf, tmp_path / "peft", seed=1, target_modules=SITES["deepseek_v3"] + MLP)
    prompts, names = [[3, 9, 27, 4, 5], [11, 2, 40], [7, 7, 8, 60]], ["b", None, "b"]

    def run(backend):
        llm = LLM(tmp_path / "model", {"b": peft_dir}, device=DEV, dtype="float32", max_lora_rank=8, max_loras=1,
                  block_size=4, kernel_backend=backend, fp8_activation_quant=False)
        return generate(llm.engine, prompts, names, 4)

    want = run("torch")
    calls = []
    real = fp8_linear_module.fp8_lora_linear
    monkeypatch.setattr(fp8_linear_module, "fp8_lora_linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = run("triton")
    assert calls  # the FP8 linears ran on the kernels
    for a, b in zip(got, want, strict=True):
        assert a.output_ids == b.output_ids, a.request_id
        assert max(abs(x[0] - y[0]) for x, y in zip(a.logprobs, b.logprobs, strict=True)) <= 1e-4


@interp_only
def test_glm47_flash_head_widths_on_the_mla_kernels_equal_torch(monkeypatch):
    """GLM-4.7-Flash's MLA is wider than DeepSeek's (nope 192, rope 64, v 256 a head; C 512): a prompt batch on the
    Triton backend (MLA prefill kernel, LoRA) equals the torch backend, and its decode (absorbed, on the MLA decode
    kernels) gives the tokens of greedy recompute on the torch backend."""
    from moelora.config import ModelConfig
    from moelora.engine.request import SamplingParams
    from moelora.models.registry import model_class
    from tests.helpers.models import hf_weights
    from tests.helpers.runs import greedy_by_recompute, run

    hf = tiny_hf_model("glm4_moe_lite", seed=31, hidden_size=64, num_attention_heads=2, num_key_value_heads=2,
                       qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256, kv_lora_rank=512, q_lora_rank=32)
    cfg = ModelConfig.from_dict(dict(hf.config.to_dict(), architectures=[type(hf).__name__]))
    model = model_class(cfg)(cfg, max_loras=2, max_rank=4)
    model.load_state_dict(hf_weights(hf), strict=True)
    model = model.eval().to(DEV)
    adapters = {"a": random_adapter(model, seed=32, rank=4, frac=0.7)}
    seqs, names = [[5, 9, 12, 3, 7], [8, 1, 2, 6, 11, 13, 14, 2]], ["a", None]
    want = engine(model, adapters, max_loras=2, device=DEV, kernel_backend="torch").prompt_logits(seqs, names)
    assert_close(engine(model, adapters, max_loras=2, device=DEV, kernel_backend="triton").prompt_logits(seqs, names),
                 want)
    import moelora.kernels.mla_attention as decode_module
    import moelora.kernels.mla_prefill as prefill_module

    launches = {"decode": 0, "prefill": 0}
    for module, name, kind in ((decode_module, "mla_decode_attention", "decode"),
                               (prefill_module, "mla_prefill_attention", "prefill")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _kind=kind, **kw: launches.__setitem__(
            _kind, launches[_kind] + 1) or _real(*a, **kw))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    got = run(engine(model, adapters, max_loras=2, device=DEV, kernel_backend="triton"), seqs, names, params)
    assert launches["decode"] >= 3 * cfg.num_layers and launches["prefill"] >= cfg.num_layers, launches  # the kernels
    ref = engine(model, adapters, max_loras=2, device=DEV, kernel_backend="torch")
    assert got == [greedy_by_recompute(ref, s, n, 4) for s, n in zip(seqs, names, strict=True)]


@interp_only
def test_minimax_m2_head_widths_equal_torch(monkeypatch):
    """MiniMax-M2's attention at its own widths (heads of 128, rotary over the first 64, q / k norms over the whole
    512 / 256-wide projections): the Triton backend's prompt logits equal the torch backend's and transformers'."""
    hf = tiny_hf_model("minimax_m2", seed=21, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=128, rope_parameters={"rope_type": "default", "rope_theta": 5e6,
                                                      "partial_rotary_factor": 0.5})
    model = build(hf, max_loras=2, max_rank=4).to(DEV)
    calls, _ = compare_backends(model, {"a": random_adapter(model, seed=22, rank=4, frac=0.6)}, hf.config.vocab_size,
                                (5, 1, 8), 23, monkeypatch)
    assert calls["qk_norm_rope"] >= 1 and calls["rms_norm"] >= 2 * hf.config.num_hidden_layers, calls
    ids = torch.tensor([[5, 9, 12, 3, 7]])
    with torch.no_grad():
        ref = hf(ids).logits[0]
    got = engine(model.to("cpu"), kernel_backend="triton").prompt_logits(ids.tolist(), [None])[0]
    assert (got - ref).abs().max() <= 1e-4
