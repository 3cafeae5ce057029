"""The offline API: `LLM(model, adapters=...)`, `generate`, `chat`, `logits`, adapters at run time.

An adapter is named by the caller; the base model is `None`. Adapters live in `max_loras` slots
of fixed address inside the model's LoRA-capable layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from moelora.config import ModelConfig
from moelora.engine.engine import Engine, Sequence_
from moelora.engine.request import RequestOutput, SamplingParams
from moelora.engine.tokenizer import Tokenizer
from moelora.errors import AdapterError, CapacityError, ConfigError, RequestError
from moelora.lora.batch import NO_SLOT
from moelora.models.registry import model_class

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(device: str | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={device!r} requested but CUDA is not available")
    return dev


class LLM:
    def __init__(self, model: str | Path, adapters: dict[str, str | Path] | None = None, *,
                 device: str | None = None, dtype: str = "auto", max_lora_rank: int = 64,
                 max_loras: int = 8, kernel_backend: str | None = None, progress: bool = False):
        from moelora.models.weights import load_checkpoint

        self.model_dir = Path(model)
        self.config = ModelConfig.from_hf(self.model_dir)
        self.device = resolve_device(device)
        self.dtype = self._dtype(dtype)
        backend = kernel_backend or ("triton" if self.device.type == "cuda" else "torch")
        if backend not in ("torch", "triton"):
            raise ConfigError(f"kernel_backend must be 'torch' or 'triton', got {backend!r}")
        if max_loras < 0 or max_lora_rank < 0:
            raise ConfigError("max_loras and max_lora_rank must be >= 0")
        self.max_lora_rank, self.max_loras = max_lora_rank, max_loras
        with torch.device(self.device):
            self.model = model_class(self.config)(self.config, max_loras=max_loras, max_rank=max_lora_rank,
                                                  backend=backend, dtype=self.dtype)
        load_checkpoint(self.model_dir, self.model.weight_params(), progress=progress)
        self.model.eval()
        self.tokenizer = Tokenizer(self.model_dir) if (self.model_dir / "tokenizer.json").is_file() else None
        self._slots: dict[str, int] = {}
        self._slot_ranks = [0] * max_loras
        eos = set(self.config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.engine = Engine(self.model, self.device, self.dtype, lambda: self._slot_ranks, sorted(eos),
                             self.tokenizer.decode if self.tokenizer else None)
        for name, path in (adapters or {}).items():
            self.add_adapter(name, path)

    def _dtype(self, dtype: str) -> torch.dtype:
        if dtype == "auto":
            return torch.float32 if self.device.type == "cpu" else _DTYPES[self.config.dtype]
        if dtype not in _DTYPES:
            raise ConfigError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {dtype!r}")
        return _DTYPES[dtype]

    # adapters -----------------------------------------------------------------------------------
    @property
    def adapters(self) -> list[str]:
        return sorted(self._slots)

    def add_adapter(self, name: str, path: str | Path) -> None:
        from moelora.lora.formats import load_adapter

        if name in self._slots:
            raise AdapterError(f"an adapter named {name!r} is already loaded")
        free = [s for s in range(self.max_loras) if s not in self._slots.values()]
        if not free:
            raise CapacityError(f"all {self.max_loras} adapter slots are in use; remove one first")
        adapter = load_adapter(path, self.config, name=name, max_rank=self.max_lora_rank)
        self.model.set_lora_slot(free[0], adapter)
        self._slots[name] = free[0]
        self._slot_ranks[free[0]] = adapter.max_rank

    def remove_adapter(self, name: str) -> None:
        slot = self._slot_of(name)
        self.model.set_lora_slot(slot, None)
        self._slot_ranks[slot] = 0
        del self._slots[name]

    def _slot_of(self, name: str | None) -> int:
        if name is None:
            return NO_SLOT
        if name not in self._slots:
            raise RequestError(f"unknown adapter {name!r}; loaded: {self.adapters}")
        return self._slots[name]

    # requests -----------------------------------------------------------------------------------
    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this model directory has no tokenizer.json; pass token ids")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def generate(self, prompts: str | list[int] | Sequence[str | list[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 adapter: str | None | Sequence[str | None] = None) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        n = len(prompts)
        params = _per_prompt(sampling_params or SamplingParams(), n, "sampling_params", SamplingParams)
        names = _per_prompt(adapter, n, "adapter", (str, type(None)))
        seqs = []
        for i, (prompt, p, name) in enumerate(zip(prompts, params, names, strict=True)):
            ids = self._encode(prompt)
            gen = torch.Generator(self.device).manual_seed(p.seed) if p.seed is not None else None
            out = RequestOutput(prompt if isinstance(prompt, str) else None, ids, name)
            seqs.append(Sequence_(i, ids, p, self._slot_of(name), out, gen))
        if seqs:
            self.engine.generate(seqs)
        return [s.out for s in seqs]

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params=None, adapter=None):
        if self.tokenizer is None:
            raise RequestError("this model has no tokenizer")
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(m) for m in convs]
        return self.generate(prompts, sampling_params, adapter)

    def logits(self, token_ids: list[list[int]], adapter: str | None | Sequence[str | None] = None
               ) -> list[torch.Tensor]:
        """float32 logits [T, V] of every position of each sequence, run as one mixed batch."""
        names = _per_prompt(adapter, len(token_ids), "adapter", (str, type(None)))
        return self.engine.logits([list(t) for t in token_ids], [self._slot_of(a) for a in names])


def _per_prompt(value, n: int, what: str, kind) -> list:
    if isinstance(value, kind):
        return [value] * n
    value = list(value)
    if len(value) != n:
        raise RequestError(f"{what} has {len(value)} entries for {n} prompts")
    return value
