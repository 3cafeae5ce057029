"""HF architecture -> model class. Imports are lazy so listing families costs nothing."""

from __future__ import annotations

import importlib

from moelora.config import ModelConfig
from moelora.errors import ConfigError

_FAMILIES = {
    "qwen3_moe": "moelora.models.decoder:MoECausalLM",
    "qwen2_moe": "moelora.models.decoder:MoECausalLM",
    "mixtral": "moelora.models.decoder:MoECausalLM",
    "olmoe": "moelora.models.decoder:MoECausalLM",
    "glm4_moe": "moelora.models.decoder:MoECausalLM",
    "minimax_m2": "moelora.models.decoder:MoECausalLM",
    "dots1": "moelora.models.decoder:MoECausalLM",
    "deepseek_v2": "moelora.models.deepseek:DeepseekCausalLM",
    "deepseek_v3": "moelora.models.deepseek:DeepseekCausalLM",
    "glm4_moe_lite": "moelora.models.deepseek:DeepseekCausalLM",
}


def model_class(cfg: ModelConfig):
    target = _FAMILIES.get(cfg.family)
    if target is None:
        raise ConfigError(f"no model implementation for family {cfg.family!r}")
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)
