"""The bundled demo: a tiny Qwen3-MoE that copies a line, and LoRA adapters that transform it.

Made by scripts/train_demo.py; README.md here records how, and the measured accuracy.
`tasks` defines what each of them computes.
"""

from __future__ import annotations

from pathlib import Path

ADAPTER_NAMES = ("upper", "reverse", "shift")


def demo_dir() -> Path:
    """The folder holding `model/` and `adapters/`."""
    return Path(__file__).resolve().parent


def model_dir() -> Path:
    """The demo base model: config.json, model.safetensors, tokenizer and chat template."""
    return demo_dir() / "model"


def adapter_dir(name: str) -> Path:
    """The PEFT folder of demo adapter `name` (one of ADAPTER_NAMES)."""
    if name not in ADAPTER_NAMES:
        raise ValueError(f"unknown demo adapter {name!r}; expected one of {ADAPTER_NAMES}")
    return demo_dir() / "adapters" / name
