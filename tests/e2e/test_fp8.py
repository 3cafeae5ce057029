"""FP8 checkpoints end to end: moelora's fp32 logits from an FP8 checkpoint against transformers + PEFT on
the same weights dequantized by hand (tests/helpers/fp8_oracle.py), with mixed adapters on attention, dense /
shared MLPs and routed experts; the W8A8 twin within its bound; quantize-on-load; `moelora verify`.

W8A8 bound (documented in README, derived in tests/helpers/fp8_bounds.py): every FP8 GEMM of the W8A8 twin is
within 2^-4 |x| |W|^T + 2^-10 s |W|^T of the W8A16 twin on the same input (experts: propagated through
silu * up and the down GEMM); checked here at every FP8 layer of each model on its actual activations.
The logits themselves carry no useful bound on these random tiny models: rounded activations flip
top-k routing (measured: mean |diff| 1-32 % of the mean |logit|, argmax agreement 50-100 %).
"""

from __future__ import annotations

import json

import pytest
import torch

from moelora import LLM
from moelora.quant.fp8 import FP8_DTYPE
from tests.helpers.fp8_bounds import check_w8a8_bounds
from tests.helpers.fp8_models import SITES, fp8_model, mixed_batch
from tests.helpers.fp8_oracle import write_fp8_checkpoint
from tests.helpers.models import ATTN_SITES, add_attention_factors
from tests.helpers.oracle_lora import (
    ATTN,
    MLP,
    build_peft_adapter,
    merged_model,
    peft_model,
    per_expert_lora,
    write_per_expert,
)
from tests.helpers.scripts import load_script

# family, scheme, expert form, shards; qwen3 with sizes past one 128 block (partial blocks in both dims)
CASES = [("qwen3_moe", "block", "per_expert", 2), ("qwen3_moe", "channel", "per_expert", 1),
         ("deepseek_v3", "block", "fused", 1), ("deepseek_v3", "tensor", "per_expert", 2),
         ("glm4_moe", "block", "per_expert", 1), ("glm4_moe", "channel", "per_expert", 1),
         ("qwen2_moe", "tensor", "per_expert", 1),  # its shared_expert_gate stays high precision
         ("qwen3_moe", "ct_block", "per_expert", 1),  # compressed-tensors FP8_BLOCK
         ("minimax_m2", "block", "per_expert", 1), ("glm4_moe_lite", "block", "fused", 1)]


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def adapters(hf, family: str, tmp_path):
    """(b) real PEFT on attention + MLPs (dense, shared) + routed experts; (a) per-expert keys."""
    peft_dir = build_peft_adapter(hf, tmp_path / "peft", seed=1, r=4, lora_alpha=8, use_rslora=True,
                                  rank_pattern={"v_proj": 6, "kv_b_proj": 6}, target_modules=SITES[family] + MLP)
    raw_a = per_expert_lora(hf, seed=2, r=3, lora_alpha=5, rank_pattern={"down_proj": 2})
    if family in ATTN_SITES:  # MLA's projections (per_expert_lora covers q/k/v/o)
        add_attention_factors(raw_a, hf, family, seed=5)
    return peft_dir, raw_a, write_per_expert(raw_a, tmp_path / "per_expert")


@pytest.mark.parametrize("family,scheme,form,shards", CASES)
def test_fp8_checkpoint_equals_oracle_on_dequantized_weights(family, scheme, form, shards, tmp_path):
    hf = fp8_model(family)
    names, seqs = mixed_batch(hf.config.vocab_size)
    with torch.no_grad():
        before = [hf(s[None]).logits[0] for s in seqs]
    write_fp8_checkpoint(hf, tmp_path / "model", scheme, form, shards)  # hf now holds the dequantized weights
    if family == "minimax_m2":  # its released quantization_config: the dtype's spelling, what stays unquantized
        config = json.loads((tmp_path / "model" / "config.json").read_text())
        config["quantization_config"] = dict(config["quantization_config"], fmt="float8_e4m3fn",
                                             modules_to_not_convert=["gate", "e_score_correction_bias", "lm_head"])
        (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    peft_dir, raw_a, a_dir = adapters(hf, family, tmp_path)
    llm = LLM(tmp_path / "model", {"b": peft_dir, "a": a_dir}, device="cpu", dtype="float32", max_lora_rank=16,
              max_loras=2)
    dtypes = {p.dtype for n, p in llm.engine.model.named_parameters() if n.endswith(("_proj", "proj.weight"))}
    assert dtypes == {FP8_DTYPE}
    ours = llm.logits([s.tolist() for s in seqs], names)
    oracles = {"b": peft_model(hf, peft_dir), "a": merged_model(hf, raw_a), None: hf}
    with torch.no_grad():
        for i, (seq, name, got) in enumerate(zip(seqs, names, ours, strict=True)):
            ref = oracles[name](seq[None]).logits[0]
            if name is None:  # the checkpoint is FP8: the original weights give other logits
                assert (ref - before[i]).abs().max() > 1e-3
            else:
                assert (ref - hf(seq[None]).logits[0]).abs().max() > 1e-2, f"adapter {name} has no visible effect"
            diff = (got - ref).abs().max().item()
            assert diff <= 1e-4, f"{family} {scheme} adapter {name}: max |diff| {diff:.2e}"

    w8a8 = LLM(tmp_path / "model", {"b": peft_dir, "a": a_dir}, device="cpu", dtype="float32", max_lora_rank=16,
               max_loras=2, fp8_activation_quant=True)
    checked = check_w8a8_bounds(w8a8.engine.model)
    got = w8a8.logits([s.tolist() for s in seqs], names)
    assert len(checked) >= 3 * w8a8.config.num_layers, checked  # every FP8 GEMM of the model was checked
    assert all((a - b).abs().max() > 0 for a, b in zip(got, ours, strict=True))


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_quantize_on_load_equals_a_block_fp8_checkpoint(family, tmp_path):
    """`quantization="fp8"` on a high-precision checkpoint holds the weights a block-FP8 checkpoint of the same
    model holds: the same logits, and every projection in e4m3."""
    hf = fp8_model(family, seed=3)
    hf.save_pretrained(str(tmp_path / "bf16"), **({"save_original_format": False} if family == "deepseek_v3" else {}))
    write_fp8_checkpoint(hf, tmp_path / "fp8", "block", "per_expert")
    on_load = LLM(tmp_path / "bf16", device="cpu", dtype="float32", max_loras=1, quantization="fp8")
    from_disk = LLM(tmp_path / "fp8", device="cpu", dtype="float32", max_loras=1)
    for (name, p), (_, q) in zip(on_load.engine.model.named_parameters(), from_disk.engine.model.named_parameters(),
                                 strict=True):
        assert p.dtype == q.dtype and torch.equal(p.float(), q.float()), name
    ids = [[1, 5, 9, 30, 2, 7]]
    assert torch.equal(on_load.logits(ids)[0], from_disk.logits(ids)[0])
    router = on_load.engine.model.model.layers[-1].mlp.gate.weight
    assert router.dtype == torch.float32 and on_load.engine.model.lm_head.weight.dtype == torch.float32


def test_fp8_unmerged_qkv_equals_merged(tmp_path):
    """merge_qkv off: q, k and v each dequantize their own rows and scale rows (views of the merged ones)."""
    hf = fp8_model("qwen3_moe", seed=9)
    write_fp8_checkpoint(hf, tmp_path / "model", "block", "per_expert")
    peft_dir = build_peft_adapter(hf, tmp_path / "peft", seed=1, target_modules=ATTN)
    ids, names = [[4, 8, 15, 16, 23, 42], [1, 2, 3]], ["b", None]
    merged, split = (LLM(tmp_path / "model", {"b": peft_dir}, device="cpu", dtype="float32", max_lora_rank=8,
                         max_loras=1, merge_qkv=m).logits(ids, names) for m in (True, False))
    for a, b in zip(merged, split, strict=True):
        assert (a - b).abs().max() <= 1e-5


def test_deepseek_fp8_paged_decode_equals_full_recompute(tmp_path):
    """Decode steps run MLA absorbed, reading the FP8 kv_b_proj dequantized: the same tokens as recomputing
    every prefix (the expanded path), with an adapter on kv_b_proj and rows on none."""
    from moelora.engine.request import SamplingParams
    from tests.helpers.runs import greedy_by_recompute

    hf = fp8_model("deepseek_v3", seed=8)
    write_fp8_checkpoint(hf, tmp_path / "model", "block", "fused")
    peft_dir = build_peft_adapter(hf, tmp_path / "peft", seed=1, target_modules=SITES["deepseek_v3"] + MLP)
    llm = LLM(tmp_path / "model", {"b": peft_dir}, device="cpu", dtype="float32", max_lora_rank=8, max_loras=1,
              block_size=4)
    prompts, names = [[3, 9, 27, 4, 5], [11, 2, 40], [7, 7, 8, 60]], ["b", None, "b"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), names)
    for prompt, name, out in zip(prompts, names, outs, strict=True):
        assert out.token_ids == greedy_by_recompute(llm.engine, prompt, name, 6)


def test_verify_on_an_fp8_checkpoint(tmp_path):
    from moelora.verify import verify

    hf = fp8_model("glm4_moe", seed=4)
    write_fp8_checkpoint(hf, tmp_path / "model", "block", "per_expert")
    peft_dir = build_peft_adapter(hf, tmp_path / "peft", seed=1, target_modules=ATTN_SITES["glm4_moe"] + MLP)
    lines = []
    worst = verify(str(tmp_path / "model"), {"b": str(peft_dir)}, print_fn=lines.append, num_seqs=2, seq_len=8)
    assert worst <= 1e-4 and len(lines) == 2 and all("ok" in line for line in lines)


_GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEVICES = ["cpu", pytest.param("cuda", marks=_GPU), pytest.param("cuda-w8a8", marks=_GPU)]


@pytest.mark.parametrize("device", DEVICES)
def test_demo_under_quantization_fp8_keeps_95_percent_exact(device):
    """The bundled demo quantized while loading: every adapter, in one mixed batch (CUDA graphs on the GPU: the
    FP8 kernels, W8A16, and W8A8 with fp8_activation_quant), still answers >= 95 % of the held-out inputs
    exactly."""
    from moelora.demo import ADAPTER_NAMES
    from moelora.demo.show import load_demo_llm, run_demo_batch
    from moelora.demo.tasks import heldout_inputs, transform

    device, _, mode = device.partition("-")
    llm = load_demo_llm(device, quantization="fp8", fp8_activation_quant=mode == "w8a8",
                        num_kv_blocks=4096 if device == "cuda" else None)  # not 90 % of the card: see test_demo
    assert llm.engine.model.model.layers[0].mlp.experts.gate_up_proj.dtype == FP8_DTYPE
    inputs = heldout_inputs(60 if device == "cuda" else 20)  # the CPU suite keeps it short
    answers = run_demo_batch(llm, inputs)
    for task in ("copy", *ADAPTER_NAMES):
        hits = sum(answers[(task, x)] == transform(task, x) for x in inputs)
        assert hits / len(inputs) >= 0.95, f"{task}: {hits}/{len(inputs)}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="programmatic dependent launch needs CUDA compute capability >= 9.0")
def test_demo_fp8_answers_equal_with_and_without_pdl():
    """The W8A8 demo batch under CUDA graphs with programmatic dependent launch (the default) and without it:
    the same kernels in the same order, so the same answers for every adapter."""
    from moelora.demo.show import load_demo_llm, run_demo_batch
    from moelora.demo.tasks import heldout_inputs

    inputs = heldout_inputs(60)
    answers = {}
    for pdl in (True, False):
        llm = load_demo_llm("cuda", quantization="fp8", fp8_activation_quant=True, num_kv_blocks=4096, pdl=pdl)
        assert llm.engine.model.options.pdl == pdl
        answers[pdl] = run_demo_batch(llm, inputs)
        del llm
    assert answers[True] == answers[False]


def test_fp8_weight_bytes_of_the_qwen3_30b_shape():
    """Computed, not timed (README's table): the Qwen3-30B-A3B shape built on the meta device."""
    QWEN3_30B = load_script("benchmarks/decode.py").QWEN3_30B

    from moelora.config import ModelConfig
    from moelora.models.registry import model_class
    from moelora.quant.config import FP8Config
    from moelora.quant.storage import weight_bytes

    cfg = ModelConfig(**QWEN3_30B).resolve()
    sizes = {}
    for quant in (None, FP8Config.from_engine("fp8")):
        with torch.device("meta"):
            sizes[quant is not None] = weight_bytes(model_class(cfg)(cfg, dtype=torch.bfloat16, quant=quant))
    L, E, H, inter, q, kv, V = 48, 128, 2048, 768, 32 * 128, 4 * 128, 151936
    projections = L * (E * 3 * H * inter + 2 * H * q + 2 * H * kv)  # one byte each in FP8
    scales = 4 * L * (E * (2 * 6 * 16 + 16 * 6) + 2 * 32 * 16 + 2 * 4 * 16)
    assert sizes[True]["float8_e4m3fn"] == projections
    assert sizes[True]["float32"] - sizes[False]["float32"] == scales  # the norms are fp32 in both
    assert sizes[False]["bfloat16"] == 2 * projections + 2 * 2 * V * H + 2 * L * H * E  # + embed, head, router
    fp8_total, bf16_total = sum(sizes[True].values()), sum(sizes[False].values())
    assert (round(bf16_total / 2 ** 30, 2), round(fp8_total / 2 ** 30, 2)) == (56.87, 29.03)


def test_cli_quantization_flag(tmp_path, capsys):
    from moelora.cli import build_parser, main, serve_engine_config

    args = build_parser().parse_args(["serve", "--quantization", "fp8"])
    assert serve_engine_config(args).quantization == "fp8"
    assert build_parser().parse_args(["bench", "-q", "fp8"]).quantization == "fp8"
    with pytest.raises(SystemExit) as exit_info:
        main(["verify", str(tmp_path), "--quantization", "fp8"])
    assert exit_info.value.code == 2
    assert "--quantization does not apply" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("w8a8", [False, True])
def test_fp8_decode_forward_has_no_host_sync(w8a8):
    """Contract 5 on the FP8 path: the FP8 kernels (W8A16 and W8A8) sync nothing."""
    from moelora.demo import ADAPTER_NAMES
    from moelora.demo.show import load_demo_llm
    from moelora.engine.request import SamplingParams
    from tests.helpers.gpu_engine import decode_step_without_host_sync

    eng = load_demo_llm("cuda", quantization="fp8", enforce_eager=True, async_scheduling=False,
                        fp8_activation_quant=w8a8, num_kv_blocks=256).engine
    for i, name in enumerate([None, *ADAPTER_NAMES]):
        eng.add_request([5 + i, 9, 11, 40 + i], SamplingParams(max_tokens=4, ignore_eos=True), name)
    decode_step_without_host_sync(eng)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("w8a8", [False, True], ids=["w8a16", "w8a8"])
def test_gpu_deepseek_fp8_graph_decode_matches_eager(w8a8, tmp_path, monkeypatch):
    """DeepSeek-V3 from a block-FP8 checkpoint on the GPU (Triton, bf16): CUDA-graph decode gives the eager
    engine's tokens, with an adapter on every MLA projection and rows on none. MLA's absorbed decode reads one
    dense copy of each FP8 kv_b_proj (`layers.mla.DenseKVB`): made before the graphs are captured, so no step of the
    graphed engine dequantizes it, and the eager engine makes it once a layer, at its first prefill."""
    from moelora.layers.linear import Linear
    from moelora.layers.mla import MLAttention
    from tests.helpers.gpu_engine import generate, logprob_diff

    hf = fp8_model("deepseek_v3", seed=8)
    write_fp8_checkpoint(hf, tmp_path / "model", "block", "fused")
    peft_dir = build_peft_adapter(hf, tmp_path / "peft", seed=1, target_modules=SITES["deepseek_v3"] + MLP)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, hf.config.vocab_size, (n,), generator=g).tolist() for n in (5, 12, 3, 9)]
    names = ["b", None, "b", None]
    dense = Linear.dense_weight
    runs = {}
    for eager in (False, True):
        llm = LLM(tmp_path / "model", {"b": peft_dir}, device="cuda", dtype="bfloat16", max_lora_rank=8, max_loras=1,
                  fp8_activation_quant=w8a8, enforce_eager=eager, num_kv_blocks=256, block_size=16)
        assert (llm.engine.graphs is None) == eager
        kv_b = {id(m.kv_b_proj) for m in llm.engine.model.modules() if isinstance(m, MLAttention)}
        assert kv_b and all(getattr(m, "quant", None) is not None for m in llm.engine.model.modules()
                            if id(m) in kv_b)
        calls = []  # the FP8 linears dequantized (a bf16 one, e.g. the fp32 router on a prefill, returns its weight)

        def counted(self, dtype, calls=calls):
            if self.quant is not None:
                calls.append(id(self))
            return dense(self, dtype)
        monkeypatch.setattr(Linear, "dense_weight", counted)
        runs[eager] = generate(llm.engine, prompts, names, 16)
        monkeypatch.setattr(Linear, "dense_weight", dense)
        assert sorted(calls) == ([] if not eager else sorted(kv_b))
        del llm
    assert logprob_diff(runs[False], runs[True]) <= 0.05
