"""Tiny moelora models twinned from transformers ones, CPU engines over them, random adapters, merged oracles."""

from __future__ import annotations

import copy

import torch

from moelora.config import ModelConfig
from moelora.engine.config import EngineConfig
from moelora.engine.engine import LLMEngine
from moelora.lora.adapter import LoRAAdapter, LoRAWeights
from moelora.models.decoder import MoECausalLM
from moelora.models.registry import model_class
from moelora.models.weights import map_checkpoint_key
from tests.helpers.oracle_lora import peft_scale


def hf_weights(hf) -> dict[str, torch.Tensor]:
    """`hf`'s state dict under moelora's names: transformers 5's in-memory names are moelora's, but for MiniMax-M2's
    router correction bias, which moelora's router holds (`models.weights.map_checkpoint_key` maps it)."""
    return {map_checkpoint_key(k).name: v for k, v in hf.state_dict().items()}


def build(hf, max_loras=0, max_rank=0, dtype=torch.float32, **kw):
    """The moelora twin of `hf` (its weights); `kw`: more constructor arguments (`options`)."""
    cfg = ModelConfig.from_dict(hf.config.to_dict())
    model = MoECausalLM(cfg, max_loras=max_loras, max_rank=max_rank, dtype=dtype, **kw)
    model.load_state_dict(hf_weights(hf), strict=True)
    return model.eval()


def engine(model, adapters: dict[str, LoRAAdapter] | None = None, max_loras: int = 4, **kw) -> LLMEngine:
    """A CPU engine over `model` whose pool serves the given in-memory adapters by name; a config whose
    layer options differ from the model's gets the model's twin built with them (`with_options`: the same
    weights and LoRA slots), as `eng.model`."""
    adapters = adapters or {}
    kw = dict(dict(device="cpu", dtype="float32", max_loras=max_loras, max_lora_rank=8, block_size=4,
                   num_kv_blocks=256, max_model_len=128), **kw)
    cfg = EngineConfig(**kw).resolve(model.config)
    eng = LLMEngine(model.with_options(cfg.layer_options(model.options)), None, cfg, lambda name, path: adapters[name])
    for name in adapters:
        eng.pool.add(name, name)
    return eng


def random_adapter(model, seed: int, rank: int, frac: float = 1.0) -> LoRAAdapter:
    """Random non-zero LoRA on a random subset of the model's sites (scaling folded in)."""
    g = torch.Generator().manual_seed(seed)
    sites = {}
    for key, (mod, proj) in model.lora_sites().items():
        if torch.rand((), generator=g) > frac:
            continue
        if proj is None:
            shape_a, shape_b = (rank, mod.in_features), (mod.out_features, rank)
        else:
            a_buf, b_buf = getattr(mod, f"lora_{proj}_a"), getattr(mod, f"lora_{proj}_b")
            shape_a = (a_buf.shape[1], rank, a_buf.shape[3])
            shape_b = (b_buf.shape[1], b_buf.shape[2], rank)
        a, b = torch.randn(shape_a, generator=g), torch.randn(shape_b, generator=g)
        sites[key] = LoRAWeights(0.2 * a, 0.2 * b)
    return LoRAAdapter(f"rand{seed}", "", sites)


def merged_hf(hf, adapter: LoRAAdapter):
    """Oracle: a copy of the HF model with every delta merged into its weights."""
    merged = copy.deepcopy(hf)
    params = dict(merged.named_parameters())
    with torch.no_grad():
        for key, w in adapter.sites.items():
            if key.endswith(".experts.gate_up") or key.endswith(".experts.down"):
                name = key.rsplit(".", 1)[0] + (".gate_up_proj" if key.endswith("gate_up") else ".down_proj")
                params[name] += torch.einsum("eor,eri->eoi", w.b, w.a)
            else:
                params[key + ".weight"] += w.b @ w.a
    return merged


ATTN_SITES = {"deepseek_v2": ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"),
              "deepseek_v3": ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"),
              "glm4_moe_lite": ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"),
              "glm4_moe": ("q_proj", "k_proj", "v_proj", "o_proj"), "dots1": ("q_proj", "k_proj", "v_proj", "o_proj")}


def config_of(hf) -> ModelConfig:
    """`hf`'s config as moelora reads it from a checkpoint (its architecture named)."""
    raw = hf.config.to_dict()
    raw["architectures"] = [type(hf).__name__]
    return ModelConfig.from_dict(raw)


def build_from_architecture(hf, max_loras=0, max_rank=0, dtype=torch.float32):
    """The moelora twin of `hf` as the model registry builds it from the checkpoint's architecture (MLA
    and GLM layers included); router and norms stay fp32 whatever `dtype`."""
    cfg = config_of(hf)
    model = model_class(cfg)(cfg, max_loras=max_loras, max_rank=max_rank, dtype=dtype)
    model.load_state_dict(hf_weights(hf), strict=True)
    return model.eval()


def add_attention_factors(raw, hf, family: str, seed: int, std: float = 0.2) -> None:
    """Per-module LoRA on the attention projections `per_expert_lora` does not know (MLA's)."""
    g = torch.Generator().manual_seed(seed)
    for name, mod in hf.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ATTN_SITES[family] and name not in raw.factors:
            rank, scale = peft_scale(raw.config, name)
            raw.factors[name] = (std * torch.randn(rank, mod.in_features, generator=g),
                                 std * torch.randn(mod.out_features, rank, generator=g), scale)
    raw.config["target_modules"] = sorted(set(raw.config["target_modules"]) | set(ATTN_SITES[family]))
