"""OpenAI completions and chat completions on top of `AsyncEngine`: validation, admission,
and the response bodies (whole, or streamed as server-sent events).

One HTTP request becomes `len(prompts) * n` engine sequences ("choices"), added all or none.
Both endpoints share `_run`, which turns the engine's `Delta`s into per-choice events (text
delta, token ids, logprobs, finish reason), records metrics, and aborts every unfinished choice
when the consumer goes away (client disconnect, cancellation, error).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from moelora.engine.detokenize import IncrementalDetokenizer
from moelora.engine.request import SamplingParams
from moelora.errors import RequestError
from moelora.server.async_engine import AsyncEngine, EngineDead, GenerateSpec, Overloaded, RequestStream, UnknownAdapter
from moelora.server.metrics import ServerMetrics
from moelora.server.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    _Sampling,
)


@dataclass(frozen=True)
class ServerConfig:
    served_model_names: tuple[str, ...]  # the first is the name responses carry for the base model
    model_path: str
    max_waiting_requests: int = 1024  # 503 once this many requests wait to be scheduled
    retry_after_s: int = 1
    api_keys: tuple[str, ...] = ()  # any of them as `Authorization: Bearer KEY` (none: no authentication)
    allow_runtime_lora_updating: bool = False  # /v1/load_lora_adapter and /v1/unload_lora_adapter served
    lora_roots: tuple[str, ...] = ()  # a runtime load reads only paths inside one of these (none: anywhere)
    max_logprobs: int = 20  # the most logprobs / top_logprobs a request may ask for
    enable_tokenizer_info_endpoint: bool = False  # GET /tokenizer_info
    return_tokens_as_token_ids: bool = False  # logprob tokens as "token_id:{id}"
    enable_log_requests: bool = False  # log each request's fields (at info)
    log_stats_interval_s: float = 10.0  # throughput / queue / cache log line while busy (0: off)
    default_sampling: tuple[tuple[str, object], ...] = ()  # --generation-config defaults, for unset fields


@dataclass(frozen=True)
class Result:
    """A whole response body, or an SSE stream; `stream.abort()` is safe to call once it is done
    (None: nothing was generated, as for an echo with max_tokens 0)."""

    body: dict | None
    sse: AsyncIterator[str] | None
    stream: RequestStream | None


@dataclass
class Event:
    """What one engine delta means for one choice."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list
    finish_reason: str | None


@dataclass
class _Choice:
    detok: IncrementalDetokenizer
    last_time: float | None = None
    finish_reason: str | None = None


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, cfg: ServerConfig, metrics: ServerMetrics):
        self.engine, self.cfg, self.metrics = engine, cfg, metrics
        self.tokenizer = engine.engine.tokenizer
        self.max_model_len = engine.engine.cfg.max_model_len
        self._token_text: dict[int, str] = {}
        self.defaults = dict(cfg.default_sampling)  # --generation-config: for the fields a request leaves unset

    # models -------------------------------------------------------------------------------------
    def resolve_model(self, name: str) -> str | None:
        """The adapter a `model` field names (None: the base model); 404 if none."""
        if name in self.cfg.served_model_names:
            return None
        if any(n == name for n, _ in self.engine.stats.adapters):
            return name
        raise ApiError(404, f"The model `{name}` does not exist.", "model")

    def model_cards(self) -> list[dict]:
        created = int(time.time())
        base = self.cfg.served_model_names[0]
        cards = [{"id": n, "object": "model", "created": created, "owned_by": "moelora", "root": self.cfg.model_path,
                  "parent": None, "max_model_len": self.max_model_len} for n in self.cfg.served_model_names]
        for name, path in self.engine.stats.adapters:
            cards.append({"id": name, "object": "model", "created": created, "owned_by": "moelora", "root": path,
                          "parent": base, "max_model_len": self.max_model_len})
        return cards

    # tokenizer routes ---------------------------------------------------------------------------
    def tokenize(self, body: TokenizeRequest) -> dict:
        """The ids completions / chat would feed the model for this prompt or these messages."""
        if body.model is not None:
            self.resolve_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give exactly one of prompt and messages", "prompt")
        text = body.prompt if body.messages is None else self._chat_text(body.messages, body.add_generation_prompt)
        ids = self.tokenizer.encode(text)
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}

    def detokenize(self, body: DetokenizeRequest) -> dict:
        if body.model is not None:
            self.resolve_model(body.model)
        vocab = self.tokenizer.vocab_size
        outside = [t for t in body.tokens if t >= vocab]
        if outside:
            raise ApiError(400, f"token ids outside the vocabulary (size {vocab}): {outside[:5]}", "tokens")
        return {"prompt": self.tokenizer.decode(body.tokens)}

    # admission ----------------------------------------------------------------------------------
    def _encode(self, prompt, param: str) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        if not ids:
            raise ApiError(400, "the prompt is empty", param)
        if len(ids) >= self.max_model_len:
            raise ApiError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, "
                           f"your prompt has {len(ids)} tokens (at least one must be left to generate).", param)
        return ids

    def _params(self, body: _Sampling, max_tokens: int | None, prompt_len: int, logprobs: int | None,
                choice: int) -> SamplingParams:
        d = self.defaults
        if max_tokens is None:
            max_tokens = min(self.max_model_len - prompt_len, d.get("max_tokens", self.max_model_len))
        elif prompt_len + max_tokens > self.max_model_len:
            raise ApiError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, "
                           f"you requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
                           f"{max_tokens} in the completion).", "max_tokens")
        seed = None if body.seed is None else body.seed + choice  # n > 1: distinct, reproducible choices
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=d.get("temperature", 1.0) if body.temperature is None
                else body.temperature, top_p=d.get("top_p", 1.0) if body.top_p is None else body.top_p,
                top_k=d.get("top_k", -1) if body.top_k is None else body.top_k,
                seed=seed, stop=body.stop_strings(), stop_token_ids=tuple(body.stop_token_ids or ()),
                ignore_eos=body.ignore_eos, logprobs=logprobs,
                presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
                repetition_penalty=d.get("repetition_penalty", 1.0) if body.repetition_penalty is None
                else body.repetition_penalty,
                logit_bias=body.logit_bias or {}, min_tokens=body.min_tokens)
        except RequestError as e:
            raise ApiError(400, str(e)) from None

    def _check_common(self, body: _Sampling) -> str | None:
        body.check_implemented()
        if body.stream_options is not None and not body.stream:
            raise ApiError(400, "stream_options can only be set when stream is true", "stream_options")
        if any(not s for s in body.stop_strings()):
            raise ApiError(400, "stop strings must be non-empty", "stop")
        return self.resolve_model(body.model)

    async def _open(self, specs: list[GenerateSpec], label: str) -> RequestStream:
        try:
            stream = await self.engine.open(specs)
        except UnknownAdapter as e:
            raise ApiError(404, f"The model `{label}` does not exist ({e}).", "model") from None
        except Overloaded as e:
            raise ApiError(503, str(e), headers={"Retry-After": str(self.cfg.retry_after_s)}) from None
        except EngineDead as e:
            raise ApiError(503, str(e)) from None
        except RequestError as e:
            raise ApiError(400, str(e)) from None
        for spec in specs:
            self.metrics.prompt_tokens.labels(label).inc(len(spec.prompt_ids))
        return stream

    # the shared loop ----------------------------------------------------------------------------
    async def _run(self, stream: RequestStream, stop: tuple[str, ...], label: str, arrival: float,
                   incremental: bool) -> AsyncIterator[Event]:
        m = self.metrics
        choices = [_Choice(IncrementalDetokenizer(self.tokenizer.decode, stop)) for _ in stream.request_ids]
        try:
            async for d in stream:
                c = choices[d.index]
                if d.error is not None:
                    c.finish_reason = "error"
                    m.requests.labels(label, "error").inc()
                    raise ApiError(500, d.error)
                if d.token_ids:
                    m.generation_tokens.labels(label).inc(len(d.token_ids))
                    if c.last_time is None:
                        m.ttft.labels(label).observe(d.time - arrival)
                    else:
                        for _ in d.token_ids:
                            m.itl.labels(label).observe((d.time - c.last_time) / len(d.token_ids))
                    c.last_time = d.time
                if d.finish_reason is None:
                    text = c.detok.push(d.token_ids) if incremental else ""
                else:  # the engine's final text is authoritative (it is cut at a stop string)
                    text = c.detok.finish(d.final_text)
                    c.finish_reason = d.finish_reason
                    m.requests.labels(label, d.finish_reason).inc()
                    m.e2e.labels(label).observe(d.time - arrival)
                yield Event(d.index, text, d.token_ids, d.logprobs, d.finish_reason)
        finally:
            if not stream.finished:
                stream.abort()
                for c in choices:
                    if c.finish_reason is None:
                        m.requests.labels(label, "abort").inc()

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    # completions --------------------------------------------------------------------------------
    async def completion(self, body: CompletionRequest) -> Result:
        arrival = time.monotonic()
        adapter = self._check_common(body)
        label = adapter or self.cfg.served_model_names[0]
        prompts = body.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise ApiError(400, "the prompt is empty", "prompt")
        encoded = [self._encode(p, "prompt") for p in prompts]
        if body.max_tokens == 0 and not body.echo:
            raise ApiError(400, "max_tokens must be at least 1 (0 is only allowed with echo)", "max_tokens")
        echo = None
        if body.echo:  # once per prompt (its logprobs cost a forward), shared by the prompt's n choices
            echo = [e for p, ids in zip(prompts, encoded, strict=True)
                    for e in [await self._echo(p, ids, adapter, body.logprobs)] * body.n]
        resp = _Response("cmpl", body.model, sum(len(ids) for ids in encoded))
        stream = events = None
        if body.max_tokens != 0:
            specs = [GenerateSpec(ids, self._params(body, body.max_tokens, len(ids), body.logprobs, j), adapter,
                                  body.n)
                     for ids in encoded for j in range(body.n)]
            stream = await self._open(specs, label)
            events = self._run(stream, body.stop_strings(), label, arrival, incremental=body.stream)
        n, logprobs = len(encoded) * body.n, body.logprobs is not None
        if body.stream:
            usage = body.stream_options is not None and bool(body.stream_options.include_usage)
            return Result(None, self._stream_completion(resp, events, n, usage, logprobs, echo), stream)
        return Result(await self._collect_completion(resp, events, n, logprobs, echo), None, stream)

    async def _echo(self, prompt, ids: list[int], adapter: str | None, logprobs: int | None) -> tuple:
        """(prompt text, ids, per-token logprobs or None) of an echoed prompt."""
        text = prompt if isinstance(prompt, str) else self.tokenizer.decode(ids)
        if logprobs is None:
            return text, ids, None
        try:
            return text, ids, await self.engine.prompt_logprobs(ids, adapter, logprobs)
        except RequestError as e:
            raise ApiError(400, str(e), "prompt") from None

    def _completion_logprobs(self, token_ids: list[int], logprobs: list, offset: int) -> dict:
        """The legacy completions `logprobs` object; `offset` is where the first token's text starts."""
        tokens = [self.token_text(t) for t in token_ids]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {"tokens": tokens, "token_logprobs": [lp for lp, _ in logprobs],
                "top_logprobs": [None if lp is None else self._top_by_text(top) for lp, top in logprobs],
                "text_offset": offsets}

    def _top_by_text(self, top) -> dict:
        """{token text: logprob} of (id, logprob) pairs, most likely first; tokens whose text is the
        same (e.g. two partial UTF-8 bytes both reading U+FFFD) keep the most likely one."""
        out: dict[str, float] = {}
        for t, v in top:
            out.setdefault(self.token_text(t), v)
        return out

    async def _collect_completion(self, resp: _Response, events, n: int, logprobs: bool, echo) -> dict:
        texts, reasons = [""] * n, ["length"] * n
        ids, lps = [[] for _ in range(n)], [[] for _ in range(n)]
        if echo:  # the prompt first: its text, and its tokens' logprobs (the first token has none)
            for i, (text, p_ids, p_lps) in enumerate(echo):
                texts[i], ids[i], lps[i] = text, list(p_ids), list(p_lps or ())
        async for ev in events or _nothing():
            texts[ev.index] += ev.text
            reasons[ev.index] = ev.finish_reason or reasons[ev.index]
            ids[ev.index] += ev.token_ids
            lps[ev.index] += ev.logprobs
            resp.completion_tokens += len(ev.token_ids)
        choices = [{"index": i, "text": texts[i], "finish_reason": reasons[i],
                    "logprobs": self._completion_logprobs(ids[i], lps[i], 0) if logprobs else None}
                   for i in range(n)]
        return resp.body("text_completion", choices, usage=resp.usage())

    async def _stream_completion(self, resp: _Response, events, n: int, usage: bool, logprobs: bool, echo):
        offsets = [0] * n
        try:
            for i, (text, p_ids, p_lps) in enumerate(echo or ()):  # the echoed prompt, one chunk a choice
                lp = self._completion_logprobs(p_ids, p_lps, 0) if logprobs else None
                offsets[i] = len(text)
                yield sse(resp.body("text_completion", [{"index": i, "text": text, "logprobs": lp,
                                                         "finish_reason": None if events else "length"}],
                                    **({"usage": None} if usage else {})))
            async for ev in events or _nothing():
                resp.completion_tokens += len(ev.token_ids)
                lp = None
                if logprobs:
                    lp = self._completion_logprobs(ev.token_ids, ev.logprobs, offsets[ev.index])
                    offsets[ev.index] += sum(len(t) for t in lp["tokens"])
                if not ev.text and lp is None and ev.finish_reason is None:
                    continue
                choice = {"index": ev.index, "text": ev.text, "logprobs": lp, "finish_reason": ev.finish_reason}
                yield sse(resp.body("text_completion", [choice], **({"usage": None} if usage else {})))
            if usage:
                yield sse(resp.body("text_completion", [], usage=resp.usage()))
        except ApiError as e:
            yield sse(e.body())
        yield "data: [DONE]\n\n"

    # chat ---------------------------------------------------------------------------------------
    def _chat_text(self, messages: list, add_generation_prompt: bool) -> str:
        turns = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})} for m in messages]
        try:
            return self.tokenizer.apply_chat_template(turns, add_generation_prompt=add_generation_prompt)
        except RequestError as e:
            raise ApiError(400, str(e), "messages") from None

    async def chat(self, body: ChatCompletionRequest) -> Result:
        arrival = time.monotonic()
        adapter = self._check_common(body)
        label = adapter or self.cfg.served_model_names[0]
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs to be true", "top_logprobs")
        ids = self._encode(self._chat_text(body.messages, body.add_generation_prompt), "messages")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        specs = [GenerateSpec(ids, self._params(body, max_tokens, len(ids), logprobs, j), adapter, body.n)
                 for j in range(body.n)]
        stream = await self._open(specs, label)
        resp = _Response("chatcmpl", body.model, len(ids))
        events = self._run(stream, body.stop_strings(), label, arrival, incremental=body.stream)
        if body.stream:
            usage = body.stream_options is not None and bool(body.stream_options.include_usage)
            return Result(None, self._stream_chat(resp, events, body.n, usage, body.logprobs), stream)
        return Result(await self._collect_chat(resp, events, body.n, body.logprobs), None, stream)

    def _chat_logprobs(self, ev: Event) -> list[dict]:
        out = []
        for tok, (lp, top) in zip(ev.token_ids, ev.logprobs, strict=True):
            s = self.token_text(tok)
            out.append({"token": s, "logprob": lp, "bytes": list(s.encode()),
                        "top_logprobs": [{"token": self.token_text(t), "logprob": v,
                                          "bytes": list(self.token_text(t).encode())} for t, v in top]})
        return out

    async def _collect_chat(self, resp: _Response, events, n: int, logprobs: bool) -> dict:
        texts, reasons, lps = [[] for _ in range(n)], [None] * n, [[] for _ in range(n)]
        async for ev in events:
            texts[ev.index].append(ev.text)
            reasons[ev.index] = ev.finish_reason or reasons[ev.index]
            if logprobs:
                lps[ev.index] += self._chat_logprobs(ev)
            resp.completion_tokens += len(ev.token_ids)
        choices = [{"index": i, "message": {"role": "assistant", "content": "".join(texts[i])},
                    "logprobs": {"content": lps[i]} if logprobs else None, "finish_reason": reasons[i]}
                   for i in range(n)]
        return resp.body("chat.completion", choices, usage=resp.usage())

    async def _stream_chat(self, resp: _Response, events, n: int, usage: bool, logprobs: bool):
        extra = {"usage": None} if usage else {}
        try:
            for i in range(n):
                first = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}
                yield sse(resp.body("chat.completion.chunk", [first], **extra))
            async for ev in events:
                resp.completion_tokens += len(ev.token_ids)
                lp = {"content": self._chat_logprobs(ev)} if logprobs and ev.token_ids else None
                if not ev.text and lp is None and ev.finish_reason is None:
                    continue
                delta = {"content": ev.text} if ev.text or ev.finish_reason is None else {}
                choice = {"index": ev.index, "delta": delta, "logprobs": lp, "finish_reason": ev.finish_reason}
                yield sse(resp.body("chat.completion.chunk", [choice], **extra))
            if usage:
                yield sse(resp.body("chat.completion.chunk", [], usage=resp.usage()))
        except ApiError as e:
            yield sse(e.body())
        yield "data: [DONE]\n\n"


class _Response:
    def __init__(self, prefix: str, model: str, prompt_tokens: int):
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created, self.model = int(time.time()), model
        self.prompt_tokens, self.completion_tokens = prompt_tokens, 0

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def body(self, obj: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices,
                **extra}


async def _nothing():
    """An empty event stream (echo with max_tokens 0 generates nothing)."""
    return
    yield


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"
