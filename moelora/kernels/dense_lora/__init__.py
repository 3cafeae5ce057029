"""The dense LoRA modes of `lora_linear`, one per file, each a class behind `base`'s protocol.

`LoRALinearConfig.mode` names one; the tests, scripts/compile_check.py and benchmarks/lora_linear.py
iterate `MODES`. Which modes stay and why: docs/performance.md.
"""

from __future__ import annotations

from moelora.kernels.dense_lora.planned import Planned, row_plan
from moelora.kernels.dense_lora.split import Split
from moelora.kernels.dense_lora.splitk import SplitK

MODES = {m.name: m for m in (Split, SplitK, Planned)}

__all__ = ["MODES", "Planned", "Split", "SplitK", "row_plan"]
