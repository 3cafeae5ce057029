"""The dense LoRA modes of `lora_linear`, one per file, in `MODES` (`LoRALinearConfig.mode`); why: performance.md."""

from __future__ import annotations

from moelora.kernels.dense_lora.concat import Concat
from moelora.kernels.dense_lora.planned import Planned
from moelora.kernels.dense_lora.split import Split
from moelora.kernels.dense_lora.splitk import SplitK

MODES = {m.name: m for m in (Split, SplitK, Planned, Concat)}
