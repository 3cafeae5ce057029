"""What every body and chunk of one response carries (id, created, model, usage), and the SSE framing."""

from __future__ import annotations

import json
import time
import uuid

from moelora.server.protocol import _Sampling


class OpenAIResponse:
    """The id, model and usage every body and chunk of one response carries."""

    def __init__(self, prefix: str, body: _Sampling, base: str, prompt_tokens: int, cached_details: bool = False,
                 force_usage: bool = False):
        self.id = f"{prefix}-{body.request_id or uuid.uuid4().hex}"
        self.created, self.model = int(time.time()), body.model or base
        self.prompt_tokens, self.completion_tokens = prompt_tokens, 0
        self.final_usage, self.continuous_usage = body.usage_mode() if body.stream else (False, False)
        self.final_usage = self.final_usage or (force_usage and bool(body.stream))  # --enable-force-include-usage
        # usage.prompt_tokens_details (vLLM's --enable-prompt-tokens-details): each prompt's cached tokens, the most
        # of its choices (a prompt counts once in prompt_tokens); choices of one prompt are `n` consecutive indices
        self.cached_details, self.n, self.cached = cached_details, body.choices, {}

    def count(self, event) -> None:
        """An engine event of choice `event.index`: its tokens, and its prompt's cached tokens."""
        self.completion_tokens += len(event.token_ids)
        prompt = event.index // self.n
        self.cached[prompt] = max(self.cached.get(prompt, 0), event.cached_tokens)

    def usage(self) -> dict:
        out = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
               "total_tokens": self.prompt_tokens + self.completion_tokens}
        if self.cached_details:
            out["prompt_tokens_details"] = {"cached_tokens": sum(self.cached.values())}
        return out

    def chunk_usage(self) -> dict:
        """A chunk's usage field: the counts so far (continuous_usage_stats), null (include_usage), or none."""
        if self.continuous_usage:
            return {"usage": self.usage()}
        return {"usage": None} if self.final_usage else {}

    def body(self, obj: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices,
                **extra}


async def no_events():
    """An empty event stream (echo with max_tokens 0 generates nothing)."""
    return
    yield


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"
