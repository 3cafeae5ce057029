"""Read a PEFT LoRA adapter directory into a validated `LoRAAdapter` (contract 7: strict, typed).

`load_adapter` reads ``adapter_config.json`` and ``adapter_model.safetensors``, refuses what moelora
cannot serve exactly (each with an `AdapterError` that names the reason and the key), and hands the
tensors to `moelora.lora.formats.canonicalize`, which knows every on-disk layout.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from moelora.config import ModelConfig
from moelora.errors import AdapterError
from moelora.lora.adapter import LoRAAdapter, LoRAWeights
from moelora.lora.formats import LoRAHyperParams, canonicalize

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# adapter_config fields that change the forward pass in ways a plain B @ A delta cannot express.
_VARIANT_FLAGS = ("use_dora", "use_qalora", "use_bdlora", "lora_bias")
_VARIANT_CONFIGS = ("layer_replication", "alora_invocation_tokens", "arrow_config", "velora_config",
                    "kasa_config", "monteclora_config")
_VOCAB_MODULES = ("embed_tokens", "lm_head")
# (adapter dir, hyperparams, model config) -> canonical sites, with every check `read_sites` makes
SiteReader = Callable[[Path, LoRAHyperParams, ModelConfig], dict[str, LoRAWeights]]


def load_adapter(path: str | Path, config: ModelConfig, *, name: str, max_rank: int,
                 read: SiteReader | None = None) -> LoRAAdapter:
    """Load the PEFT LoRA adapter in directory `path` for a model of `config`.

    Every site's rank (for the stacked expert ``gate_up`` site: rank of gate + rank of up) must be at
    most `max_rank`. Raises `AdapterError` naming the reason for anything moelora cannot serve.
    `read` replaces `read_sites` (reading the whole file): a tensor-parallel rank reads only its slices.
    """
    root = Path(path)
    if not root.is_dir():
        raise AdapterError(f"adapter {name!r}: {root} is not a directory")
    try:
        return _load(root, config, name, max_rank, read or read_sites)
    except AdapterError as e:  # every refusal names the adapter (and where it was read from)
        raise AdapterError(f"adapter {name!r} ({root}): {e}") from None


def _load(root: Path, config: ModelConfig, name: str, max_rank: int, read: SiteReader) -> LoRAAdapter:
    hp = hyperparams(read_config(root))
    _refuse_added_tokens(root, config)
    sites = read(root, hp, config)
    for site, w in sorted(sites.items()):
        if w.rank > max_rank:
            raise AdapterError(f"site {site} has rank {w.rank}, above max_rank={max_rank}"
                               + (" (gate rank + up rank, stacked)" if site.endswith(".gate_up") else ""))
    return LoRAAdapter(name=name, path=str(root), sites=sites)


def read_config(root: Path) -> dict[str, Any]:
    file = root / CONFIG_FILE
    if not file.is_file():
        raise AdapterError(f"no {CONFIG_FILE} in {root}")
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise AdapterError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise AdapterError(f"{file} is not a JSON object")
    return raw


def read_sites(root: Path, hp: LoRAHyperParams, config: ModelConfig) -> dict[str, LoRAWeights]:
    """The whole adapter file, checked and canonicalized."""
    tensors = read_weights(root)
    refuse_vocab_keys(tensors)
    for key, t in tensors.items():
        refuse_non_finite(key, t)
    return canonicalize(tensors, hp, config)


def refuse_vocab_keys(keys: Mapping[str, Any]) -> None:
    vocab_keys = [k for k in keys if any(m in k for m in _VOCAB_MODULES)]
    if vocab_keys:
        raise AdapterError(f"adapter touches the vocabulary ({vocab_keys[0]}): LoRA on or resizing of "
                           f"embed_tokens / lm_head (added tokens) is not supported")


def refuse_non_finite(key: str, t: torch.Tensor) -> None:
    if not torch.isfinite(t).all():
        raise AdapterError(f"adapter tensor {key} contains NaN or Inf")


def weights_file(root: Path) -> Path:
    """The adapter's safetensors file (AdapterError when there is none)."""
    file = root / WEIGHTS_FILE
    if not file.is_file():
        if (root / "adapter_model.bin").is_file():
            raise AdapterError(f"{root} holds adapter_model.bin (a pickle); convert it to "
                               f"{WEIGHTS_FILE} (e.g. PeftModel.save_pretrained(safe_serialization=True))")
        raise AdapterError(f"no {WEIGHTS_FILE} in {root}")
    return file


def read_weights(root: Path) -> dict[str, torch.Tensor]:
    file = weights_file(root)
    from safetensors.torch import load_file

    try:
        return load_file(str(file))
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise AdapterError(f"cannot read {file}: {e}") from None


def hyperparams(raw: dict[str, Any]) -> LoRAHyperParams:
    """Validate an ``adapter_config.json`` dict and keep the fields that shape the weights."""
    peft_type = str(raw.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise AdapterError(f"peft_type={raw.get('peft_type')!r} is not supported (only LORA)")
    for flag in _VARIANT_FLAGS:
        if raw.get(flag):
            raise AdapterError(f"{flag}={raw[flag]!r} is not supported (plain LoRA only)")
    for name in _VARIANT_CONFIGS:
        if raw.get(name) not in (None, [], {}):
            raise AdapterError(f"{name}={raw[name]!r} is not supported (plain LoRA only)")
    if raw.get("bias", "none") != "none":
        raise AdapterError(f"bias={raw['bias']!r} is not supported (only 'none': bias terms are not LoRA)")
    if raw.get("modules_to_save"):
        raise AdapterError(f"modules_to_save={raw['modules_to_save']} is not supported (fully fine-tuned "
                           f"modules are not LoRA)")
    if raw.get("trainable_token_indices"):
        raise AdapterError("trainable_token_indices is set: adapters with added or trained tokens are not "
                           "supported")
    _refuse_vocab_targets(raw.get("target_modules"))
    r, alpha = raw.get("r"), raw.get("lora_alpha")
    if not isinstance(r, int) or r <= 0 or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise AdapterError(f"adapter_config needs a positive integer r and a finite lora_alpha, got r={r!r}, "
                           f"lora_alpha={alpha!r}")
    layers = raw.get("layers_to_transform")
    if isinstance(layers, int):
        layers = [layers]
    pattern = raw.get("layers_pattern") or ()
    return LoRAHyperParams(
        r=r, lora_alpha=float(alpha), use_rslora=bool(raw.get("use_rslora", False)),
        rank_pattern=dict(raw.get("rank_pattern") or {}), alpha_pattern=dict(raw.get("alpha_pattern") or {}),
        layers_to_transform=tuple(int(i) for i in layers) if layers else None,
        layers_pattern=(pattern,) if isinstance(pattern, str) else tuple(pattern),
        target_parameters=tuple(raw.get("target_parameters") or ()),
        peft_version=raw.get("peft_version"),
    )


def _refuse_vocab_targets(targets: Any) -> None:
    if isinstance(targets, str):
        hit = next((m for m in ("model.embed_tokens", "lm_head") if re.fullmatch(targets, m)), None)
    else:
        hit = next((t for t in targets or ()
                    if any(t == m or t.endswith("." + m) for m in _VOCAB_MODULES)), None)
    if hit:
        raise AdapterError(f"target_modules targets {hit}: LoRA on embed_tokens / lm_head is not supported")


def _refuse_added_tokens(root: Path, config: ModelConfig) -> None:
    """A tokenizer saved next to the adapter with ids past the base vocabulary means a resized embedding."""
    file = root / "added_tokens.json"
    if not file.is_file():
        return
    try:
        added = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise AdapterError(f"{file} is not valid JSON: {e}") from None
    items = added.items() if isinstance(added, dict) else ()
    beyond = sorted(t for t, i in items if isinstance(i, int) and i >= config.vocab_size)
    if beyond:
        raise AdapterError(f"{file} adds token(s) {beyond[:5]} with ids past the base vocabulary "
                           f"({config.vocab_size}): added tokens are not supported")
