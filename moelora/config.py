"""Frozen model configs (contract 8), read from a Hugging Face `config.json`.

`ModelConfig.from_hf(path)` accepts both the old and the new spellings of the fields transformers
has renamed (`num_experts`/`num_local_experts`, `rope_theta`/`rope_parameters`,
`torch_dtype`/`dtype`) and raises `ConfigError` naming any architecture or field value moelora
does not implement. Every derived value is computed once, in `resolve()`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moelora.errors import ConfigError

# HF architecture name -> family name used by moelora.models.registry.
ARCHITECTURES = {
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "MixtralForCausalLM": "mixtral",
    "OlmoeForCausalLM": "olmoe",
}

_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16", "fp32": "float32",
           "fp16": "float16", "bf16": "bfloat16", "half": "float16", "float": "float32"}


@dataclass(frozen=True)
class ModelConfig:
    """Everything the model code needs, in one family-neutral vocabulary.

    qk_norm: "none", "per_head" (RMSNorm over head_dim, Qwen3) or "whole" (RMSNorm over the whole
    q / k projection, OLMoE). Sparse layers are listed in `sparse_layers` (computed in resolve()).
    """

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP (non-sparse layers)
    moe_intermediate_size: int
    num_experts: int
    top_k: int
    norm_topk_prob: bool
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    attention_bias: bool = False
    qk_norm: str = "none"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    mlp_only_layers: tuple[int, ...] = ()
    decoder_sparse_step: int = 1
    dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sparse_layers: tuple[int, ...] = field(default=())

    def resolve(self) -> ModelConfig:
        """Validate and fill derived fields; returns a new config."""
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "num_experts", "top_k", "decoder_sparse_step"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_attention_heads={self.num_heads} is not a multiple of "
                              f"num_key_value_heads={self.num_kv_heads}")
        if self.top_k > self.num_experts:
            raise ConfigError(f"num_experts_per_tok={self.top_k} exceeds num_experts={self.num_experts}")
        if self.qk_norm not in ("none", "per_head", "whole"):
            raise ConfigError(f"unsupported qk_norm {self.qk_norm!r}")
        sparse = tuple(i for i in range(self.num_layers) if i not in self.mlp_only_layers
                       and (i + 1) % self.decoder_sparse_step == 0)
        if any(i not in sparse for i in range(self.num_layers)) and self.intermediate_size <= 0:
            raise ConfigError("dense layers present but intermediate_size is not positive")
        return dataclasses.replace(self, sparse_layers=sparse)

    def is_sparse(self, layer: int) -> bool:
        return layer in self.sparse_layers

    @classmethod
    def from_hf(cls, path: str | Path) -> ModelConfig:
        """Read `config.json` from a model directory (or the file itself)."""
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise ConfigError(f"no config.json at {path}")
        try:
            raw = json.loads(file.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{file} is not valid JSON: {e}") from None
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        archs = raw.get("architectures") or []
        family = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
        if family is None and not archs and raw.get("model_type") in ARCHITECTURES.values():
            family = raw["model_type"]  # configs built in memory carry no `architectures`
        if family is None:
            known = ", ".join(sorted(ARCHITECTURES))
            raise ConfigError(f"unsupported architecture {archs or raw.get('model_type')!r}; "
                              f"moelora supports {known}")
        return _parse(family, raw).resolve()


def _get(raw: dict[str, Any], *names: str, default: Any = ConfigError) -> Any:
    for n in names:
        if n in raw and raw[n] is not None:
            return raw[n]
    if default is ConfigError:
        raise ConfigError(f"config.json lacks required field {names[0]!r}")
    return default


def _rope_theta(raw: dict[str, Any]) -> float:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", None):
        raise ConfigError(f"unsupported rope_type {rope_type!r} (only 'default' rotary is implemented)")
    theta = params.get("rope_theta", raw.get("rope_theta"))
    return float(theta if theta is not None else 10000.0)


def _check_unsupported(family: str, raw: dict[str, Any]) -> None:
    if raw.get("use_sliding_window") or (family == "mixtral" and raw.get("sliding_window")):
        raise ConfigError(f"sliding_window={raw.get('sliding_window')} is not supported")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"unsupported hidden_act {act!r} (only 'silu')")
    if family == "olmoe" and raw.get("clip_qkv") is not None:
        raise ConfigError(f"unsupported clip_qkv={raw['clip_qkv']}")


def _parse(family: str, raw: dict[str, Any]) -> ModelConfig:
    _check_unsupported(family, raw)
    hidden = int(_get(raw, "hidden_size"))
    heads = int(_get(raw, "num_attention_heads"))
    dtype_name = str(_get(raw, "dtype", "torch_dtype", default="bfloat16"))
    if dtype_name not in _DTYPES:
        raise ConfigError(f"unsupported dtype {dtype_name!r}")
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    moe_inter = _get(raw, "moe_intermediate_size", "intermediate_size")
    qk_norm = {"qwen3_moe": "per_head", "olmoe": "whole"}.get(family, "none")
    return ModelConfig(
        family=family,
        vocab_size=int(_get(raw, "vocab_size")),
        hidden_size=hidden,
        num_layers=int(_get(raw, "num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(_get(raw, "num_key_value_heads", default=heads)),
        head_dim=int(_get(raw, "head_dim", default=hidden // heads)),
        intermediate_size=int(_get(raw, "intermediate_size", default=0)),
        moe_intermediate_size=int(moe_inter),
        num_experts=int(_get(raw, "num_experts", "num_local_experts")),
        top_k=int(_get(raw, "num_experts_per_tok")),
        norm_topk_prob=bool(raw.get("norm_topk_prob", family == "mixtral")) or family == "mixtral",
        shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0)
        if family == "qwen2_moe" else 0,
        attention_bias=bool(raw.get("qkv_bias", raw.get("attention_bias", family == "qwen2_moe"))),
        qk_norm=qk_norm,
        rms_norm_eps=float(_get(raw, "rms_norm_eps", default=1e-6)),
        rope_theta=_rope_theta(raw),
        max_position_embeddings=int(_get(raw, "max_position_embeddings", default=4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        mlp_only_layers=tuple(int(i) for i in raw.get("mlp_only_layers") or ()),
        decoder_sparse_step=int(raw.get("decoder_sparse_step") or 1),
        dtype=_DTYPES[dtype_name],
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )
