"""The offline API: `LLM(model, adapters=...)`, `generate`, `chat`, `logits`, adapters at run time.

An adapter is named by the caller; the base model is `None`. `LLM` drives the same `LLMEngine`
(scheduler, paged KV cache, adapter pool) that the server uses, on the CPU or on CUDA.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from moelora.engine.config import EngineConfig
from moelora.engine.loader import build_engine, resolve_auto_targets
from moelora.engine.request import RequestOutput, SamplingParams
from moelora.errors import RequestError
from moelora.lora.request import LoRARequest

# vLLM's LLM(...) arguments with nothing to set here: adapters are always served; the model classes are moelora's own
_ACCEPTED = ("enable_lora", "trust_remote_code")


class LLM:
    def __init__(self, model: str | Path, adapters: dict[str, str | Path] | None = None, *,
                 device: str | None = None, dtype: str = "auto", max_lora_rank: int = 64,
                 max_loras: int = 8, kernel_backend: str | None = None, progress: bool = False,
                 **engine_kwargs):
        """`engine_kwargs`: EngineConfig's fields; vLLM's `enable_lora` and `trust_remote_code` are accepted (they
        change nothing), `enable_expert_parallel` is EngineConfig's `expert_parallel`, `tokenizer` the directory of
        tokenizer.json (default `model`), `seed` seeds the draws of requests without a seed of their own (as
        `moelora serve --seed`)."""
        for name in _ACCEPTED:
            engine_kwargs.pop(name, None)
        if "enable_expert_parallel" in engine_kwargs:
            engine_kwargs["expert_parallel"] = engine_kwargs.pop("enable_expert_parallel")
        tokenizer, seed = engine_kwargs.pop("tokenizer", None), engine_kwargs.pop("seed", None)
        if seed is not None:
            torch.manual_seed(seed)
        cfg = EngineConfig(device=device, dtype=dtype, max_lora_rank=max_lora_rank, max_loras=max_loras,
                           kernel_backend=kernel_backend, **engine_kwargs)
        cfg = resolve_auto_targets(model, adapters or {}, cfg)  # lora_target_modules="auto": these adapters'
        # the adapters are registered before the decode graphs are captured: captured once, their sites on
        self.engine = build_engine(model, cfg, progress=progress, adapters=adapters, tokenizer=tokenizer)
        self.config = self.engine.model_config
        self.tokenizer = self.engine.tokenizer

    @property
    def adapters(self) -> list[str]:
        return self.engine.pool.names

    def add_adapter(self, name: str, path: str | Path, pinned: bool = False) -> None:
        self.engine.pool.add(name, path, pinned=pinned)

    def remove_adapter(self, name: str) -> None:
        if any(r.adapter == name for r in self.engine.requests.values()):
            raise RequestError(f"adapter {name!r} has requests in flight")
        self.engine.pool.remove(name)

    def generate(self, prompts: str | list[int] | Sequence[str | list[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 adapter: str | None | Sequence[str | None] = None, *,
                 lora_request: LoRARequest | None | Sequence[LoRARequest | None] = None) -> list[RequestOutput]:
        """`adapter`: a registered adapter's name per prompt (None: the base); or vLLM's `lora_request`
        (`moelora.lora.request.LoRARequest`), whose adapter is registered from its path at first use."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        n = len(prompts)
        params = _per_prompt(sampling_params or SamplingParams(), n, "sampling_params", SamplingParams)
        names = self._names(adapter, lora_request, n)
        reqs = []
        try:
            for prompt, p, name in zip(prompts, params, names, strict=True):
                reqs.append(self.engine.add_request(prompt, p, name))
            while self.engine.has_unfinished():
                self.engine.step()
        except BaseException:
            for r in reqs:
                self.engine.abort(r.request_id)
            raise
        return [RequestOutput(r.prompt, r.prompt_ids, r.adapter, r.output_ids, r.text, r.finish_reason, r.stop_reason)
                for r in reqs]

    def _names(self, adapter, lora_request, n: int) -> list[str | None]:
        """Each prompt's adapter name, from `adapter` or from vLLM's `lora_request` (registering its adapters)."""
        if lora_request is None:
            return _per_prompt(adapter, n, "adapter", (str, type(None)))
        if adapter is not None:
            raise RequestError("give adapter or lora_request, not both")
        requests = _per_prompt(lora_request, n, "lora_request", (LoRARequest, type(None)))
        for r in dict.fromkeys(r for r in requests if r is not None):
            known = self.engine.pool.path_of(r.lora_name)
            if known is None:
                if not r.lora_path:
                    raise RequestError(f"LoRARequest {r.lora_name!r}: no adapter of that name and no lora_path")
                self.add_adapter(r.lora_name, r.lora_path)
            elif r.lora_path and Path(r.lora_path).resolve() != known.resolve():
                raise RequestError(f"adapter {r.lora_name!r} is registered from {known}, not {r.lora_path}")
        return [None if r is None else r.lora_name for r in requests]

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params=None, adapter=None, *,
             tools: list[dict] | None = None, chat_template_kwargs: dict | None = None, lora_request=None):
        """Each conversation through the chat template (`tools`: OpenAI-shaped function definitions, as
        vLLM's `LLM.chat` passes them; the reply's text is returned as generated, calls unparsed)."""
        if self.tokenizer is None:
            raise RequestError("this model has no tokenizer")
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(m, tools=tools, **(chat_template_kwargs or {})) for m in convs]
        return self.generate(prompts, sampling_params, adapter, lora_request=lora_request)

    def logits(self, token_ids: list[list[int]], adapter: str | None | Sequence[str | None] = None
               ) -> list[torch.Tensor]:
        """float32 logits [T, V] of every position of each sequence, run in mixed batches of the step budget."""
        names = _per_prompt(adapter, len(token_ids), "adapter", (str, type(None)))
        return self.engine.prompt_logits([list(t) for t in token_ids], names)


def _per_prompt(value, n: int, what: str, kind) -> list:
    if isinstance(value, kind):
        return [value] * n
    value = list(value)
    if len(value) != n:
        raise RequestError(f"{what} has {len(value)} entries for {n} prompts")
    return value
