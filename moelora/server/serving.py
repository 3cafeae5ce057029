"""OpenAI completions and chat completions on top of `AsyncEngine`: validation, admission,
and the response bodies (whole, or streamed as server-sent events).

One HTTP request becomes `len(prompts) * n` engine sequences ("choices"), added all or none.
Both endpoints share `_run`, which turns the engine's `Delta`s into per-choice events (text
delta, token ids, logprobs, finish and stop reason), records metrics, and aborts every unfinished
choice when the consumer goes away (client disconnect, cancellation, error). A chat reply's text
becomes its message's reasoning, content and tool calls through `reply.py` (the --reasoning-parser and
--tool-call-parser of vLLM's flags), whole or streamed.

Tokens and usage are vLLM's: the EOS / stop token that ends a choice is a generated token (in
`completion_tokens`, in the logprobs with text "", in `token_ids`), and its text is not in the
choice's text unless include_stop_str_in_output. `stop_reason` names the stop token id or string
that matched (null for EOS and length).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import contextmanager
from dataclasses import dataclass

from moelora.engine.detokenize import IncrementalDetokenizer
from moelora.engine.request import SamplingParams
from moelora.engine.structured import StructuredOutput
from moelora.errors import RequestError
from moelora.server.async_engine import AsyncEngine, EngineDead, GenerateSpec, Overloaded, RequestStream, UnknownAdapter
from moelora.server.forced_tools import forced_tools
from moelora.server.logprobs import LogprobView, TokenTexts
from moelora.server.metrics import ServerMetrics
from moelora.server.protocol import ApiError, ChatCompletionRequest, CompletionRequest, _Sampling, template_tools
from moelora.server.reasoning import reasoning_parser
from moelora.server.reply import ReplyFormat, ReplyStream
from moelora.server.response import OpenAIResponse, no_events, sse
from moelora.server.tokens import TokenRoutes, render_chat, template_kwargs
from moelora.server.tools import tool_parser


@dataclass(frozen=True)
class ServerConfig:
    served_model_names: tuple[str, ...]  # the first is the name responses carry for the base model
    model_path: str
    max_waiting_requests: int = 1024  # 503 once this many requests wait to be scheduled
    retry_after_s: int = 1
    api_keys: tuple[str, ...] = ()  # any of them as `Authorization: Bearer KEY` (none: no authentication)
    allow_runtime_lora_updating: bool = False  # /v1/load_lora_adapter and /v1/unload_lora_adapter served
    lora_roots: tuple[str, ...] = ()  # a runtime load reads only paths inside one of these (none: anywhere)
    enable_tokenizer_info_endpoint: bool = False  # GET /tokenizer_info (vLLM's flag of that name)
    return_tokens_as_token_ids: bool = False  # logprob tokens read "token_id:N" (a request may override)
    max_logprobs: int = 20  # the most logprobs / top_logprobs / prompt_logprobs a request may ask (400 above)
    enable_log_requests: bool = False  # log each request's fields (at info)
    log_stats_interval_s: float = 10.0  # throughput / queue / cache log line while busy (0: off)
    default_sampling: tuple[tuple[str, object], ...] = ()  # --generation-config defaults, for unset fields
    # CORS, vLLM's flags and defaults (--allowed-origins / -methods / -headers, --allow-credentials): a browser
    # client's preflight is answered before authentication, which every other request still meets
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    # tool calls (vLLM's --enable-auto-tool-choice --tool-call-parser NAME): the parser of tool_choice "auto"
    tool_call_parser: str | None = None
    exclude_tools_when_tool_choice_none: bool = False  # tool_choice "none": the template gets no tools
    reasoning_parser: str | None = None  # vLLM's --reasoning-parser: <think> text as the message's reasoning
    structured_in_reasoning: bool = False  # vLLM's enable_in_reasoning: a structured output holds the reasoning too
    response_role: str = "assistant"  # the reply's role (vLLM's --response-role) after a generation prompt
    chat_template_content_format: str = "string"  # "openai": a message's content reaches the template as parts
    disable_fastapi_docs: bool = False  # no /docs, /redoc, /openapi.json
    enable_prompt_tokens_details: bool = False  # usage.prompt_tokens_details.cached_tokens (the prefix cache's)
    enable_force_include_usage: bool = False  # a stream's usage chunk without stream_options.include_usage
    default_chat_template_kwargs: dict | None = None  # every chat's template variables, under the request's own
    enable_server_load_tracking: bool = False  # GET /load counts the generation requests in flight
    max_log_len: int = 4096  # --enable-log-requests: characters of a request logged


@dataclass(frozen=True)
class Result:
    """A whole response body, or a stream of chunk bodies (an error body ends one that failed); `stream.abort()`
    is safe to call once it is done (None: nothing was generated, as for an echo with max_tokens 0)."""

    body: dict | None
    chunks: AsyncIterator[dict] | None
    stream: RequestStream | None

    async def sse(self) -> AsyncIterator[str]:
        """The chunks as server-sent events, then `data: [DONE]`."""
        async for chunk in self.chunks:
            yield sse(chunk)
        yield "data: [DONE]\n\n"


@dataclass
class Event:
    """What one engine delta means for one choice."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list
    finish_reason: str | None
    stop_reason: int | str | None = None
    cached_tokens: int = 0

    @property
    def ends_on_stop_token(self) -> bool:
        """The last token is the EOS / stop token that finished the choice (not part of the text)."""
        return self.finish_reason == "stop" and not isinstance(self.stop_reason, str)


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
        self.texts = TokenTexts(self.tokenizer.decode)
        self.tokens = TokenRoutes(self.tokenizer, self.max_model_len, self.resolve_model, cfg.model_path,
                                  cfg.chat_template_content_format, cfg.default_chat_template_kwargs)
        self.defaults = dict(cfg.default_sampling)  # --generation-config: for the fields a request leaves unset

    # models -------------------------------------------------------------------------------------
    def resolve_model(self, name: str | None) -> str | None:
        """The adapter a `model` field names (None: the base model, also when the field is left out); 404 if none."""
        if name is None or name in self.cfg.served_model_names:
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

    # admission ----------------------------------------------------------------------------------
    def _encode(self, prompt, param: str, add_special_tokens: bool, truncate: int | None = None) -> list[int]:
        """The prompt's token ids, checked; `truncate` (vLLM's truncate_prompt_tokens): only the last k of them
        (-1: the last max_model_len)."""
        ids = self.tokenizer.encode(prompt, add_special_tokens) if isinstance(prompt, str) else list(prompt)
        if truncate is not None:
            if truncate == 0 or truncate > self.max_model_len:
                raise ApiError(400, f"truncate_prompt_tokens must be -1 or in [1, max_model_len="
                               f"{self.max_model_len}], got {truncate}", "truncate_prompt_tokens")
            ids = ids[-(self.max_model_len if truncate == -1 else truncate):]
        if not ids:
            raise ApiError(400, "the prompt is empty", param)
        vocab = self.engine.engine.model_config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:  # before any forward (echo, prompt_logprobs) reads it
            raise ApiError(400, f"token id {bad} is outside the vocabulary (size {vocab})", param)
        if len(ids) >= self.max_model_len:
            raise ApiError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, "
                           f"your prompt has {len(ids)} tokens (at least one must be left to generate).", param)
        return ids

    def _params(self, body: _Sampling, max_tokens: int | None, prompt_len: int, logprobs: int | None,
                choice: int, grammar_after: int | None = None, asked: tuple | None = None,
                spacing: str | None = None) -> SamplingParams:
        """`asked`: the structured output, (kind, value) (default: the body's own); `grammar_after`: the token it
        starts after (`_grammar_start`); `spacing`: its JSON's (default: the body's, `json_spacing`)."""
        d = self.defaults
        if max_tokens is None:
            max_tokens = min(self.max_model_len - prompt_len, d.get("max_tokens", self.max_model_len))
        elif prompt_len + max_tokens > self.max_model_len:
            raise ApiError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, "
                           f"you requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
                           f"{max_tokens} in the completion).", "max_tokens")
        seed = None if body.seed is None else body.seed + choice  # n > 1: distinct, reproducible choices
        off = lambda value, default: default if value is None else value  # noqa: E731
        asked = body.structured_output() if asked is None else asked
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=off(body.temperature, d.get("temperature", 1.0)),
                top_p=off(body.top_p, d.get("top_p", 1.0)), top_k=off(body.top_k, d.get("top_k", -1)),
                min_p=off(body.min_p, d.get("min_p", 0.0)), seed=seed, stop=body.stop_strings(),
                stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=bool(body.ignore_eos), logprobs=logprobs,
                presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
                repetition_penalty=off(body.repetition_penalty, d.get("repetition_penalty", 1.0)),
                logit_bias=body.logit_bias or {},
                min_tokens=body.min_tokens or 0, skip_special_tokens=body.skip_special_tokens is not False,
                spaces_between_special_tokens=body.spaces_between_special_tokens is not False,
                include_stop_str_in_output=bool(body.include_stop_str_in_output),
                structured=None if asked is None else StructuredOutput.of(
                    *asked, after=grammar_after, spacing=spacing or body.json_spacing()),
                allowed_token_ids=body.allowed_token_ids, bad_words=tuple(body.bad_words or ()))
        except RequestError as e:
            raise ApiError(400, str(e)) from None

    def _check_common(self, body: _Sampling, logprob_fields: dict[str, int | None]) -> str | None:
        if body.priority and self.engine.engine.cfg.scheduling_policy != "priority":
            raise ApiError(400, f"priority {body.priority} needs --scheduling-policy priority (this server schedules "
                           "first come, first served)", "priority")
        if body.stream_options is not None and not body.stream:
            raise ApiError(400, "stream_options can only be set when stream is true", "stream_options")
        if any(not s for s in body.stop_strings()):
            raise ApiError(400, "stop strings must be non-empty", "stop")
        if body.spaces_between_special_tokens is False and body.skip_special_tokens is False:
            raise ApiError(400, "spaces_between_special_tokens=false is not supported (a fast tokenizer's decode "
                           "never inserts spaces between special tokens)", "spaces_between_special_tokens")
        for name, k in {**logprob_fields, "prompt_logprobs": body.prompt_logprobs}.items():
            if k is not None and k > self.cfg.max_logprobs:
                raise ApiError(400, f"Requested {name} of {k}, which is greater than max allowed: "
                               f"{self.cfg.max_logprobs}", name)
        return self.resolve_model(body.model)

    def _view(self, body: _Sampling) -> LogprobView:
        as_ids = body.return_tokens_as_token_ids
        return LogprobView(self.texts, body.skip_special_tokens is not False, bool(body.include_stop_str_in_output),
                           self.cfg.return_tokens_as_token_ids if as_ids is None else as_ids)

    @contextmanager
    def _engine_errors(self, label: str, param: str | None = None):
        """The engine's refusals as vLLM's HTTP errors."""
        try:
            yield
        except UnknownAdapter as e:  # unloaded since the request named it
            raise ApiError(404, f"The model `{label}` does not exist ({e}).", "model") from None
        except Overloaded as e:
            raise ApiError(503, str(e), headers={"Retry-After": str(self.cfg.retry_after_s)}) from None
        except EngineDead as e:
            raise ApiError(503, str(e)) from None
        except RequestError as e:
            raise ApiError(400, str(e), param) from None

    async def _open(self, specs: list[GenerateSpec], label: str) -> RequestStream:
        with self._engine_errors(label):
            stream = await self.engine.open(specs)
        for spec in specs:
            self.metrics.prompt_tokens.labels(label).inc(len(spec.prompt_ids))
        return stream

    async def _prompt_logprobs(self, ids: list[int], adapter: str | None, k: int, alone_n: int = 0) -> list:
        with self._engine_errors(adapter or self.cfg.served_model_names[0], "prompt"):
            return await self.engine.prompt_logprobs(ids, adapter, k, alone_n)

    # the shared loop ----------------------------------------------------------------------------
    async def _run(self, stream: RequestStream, body: _Sampling, label: str, arrival: float) -> AsyncIterator[Event]:
        m, stop, incremental = self.metrics, body.stop_strings(), bool(body.stream)
        decode = self.tokenizer.decode if body.skip_special_tokens is not False else (
            lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False))
        choices = [_Choice(IncrementalDetokenizer(decode, stop)) for _ in stream.request_ids]
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
                else:  # the engine's final text is authoritative (cut at a stop string, without the stop token)
                    text = c.detok.finish(d.final_text)
                    c.finish_reason = d.finish_reason
                    m.requests.labels(label, d.finish_reason).inc()
                    m.e2e.labels(label).observe(d.time - arrival)
                yield Event(d.index, text, d.token_ids, d.logprobs, d.finish_reason, d.stop_reason, d.cached_tokens)
        finally:
            if not stream.finished:
                stream.abort()
                for c in choices:
                    if c.finish_reason is None:
                        m.requests.labels(label, "abort").inc()

    # completions --------------------------------------------------------------------------------
    async def completion(self, body: CompletionRequest) -> Result:
        arrival = time.monotonic()
        adapter = self._check_common(body, {"logprobs": body.logprobs})
        label = adapter or self.cfg.served_model_names[0]
        prompts = body.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise ApiError(400, "the prompt is empty", "prompt")
        encoded = [self._encode(p, "prompt", body.add_special_tokens is not False, body.truncate_prompt_tokens)
                   for p in prompts]
        if body.max_tokens == 0 and not body.echo:
            raise ApiError(400, "max_tokens must be at least 1 (0 is only allowed with echo)", "max_tokens")
        n, view = body.choices, self._view(body)
        # once per prompt, shared by its n choices; the prompts' logprobs asked at once: scored in shared forwards
        alone = n if body.max_tokens == 0 else 0  # nothing generated: scoring is the request (metrics count it)
        prompt_parts = await asyncio.gather(*(self._completion_prompt(body, p, ids, adapter, view, alone)
                                              for p, ids in zip(prompts, encoded, strict=True)))
        if alone:
            self._count_scored(label, [len(part["ids"]) for part in prompt_parts if part["scored"]], n, arrival)
        resp = OpenAIResponse("cmpl", body, self.cfg.served_model_names[0], sum(len(ids) for ids in encoded),
                              self.cfg.enable_prompt_tokens_details, self.cfg.enable_force_include_usage)
        stream = events = None
        if body.max_tokens != 0:
            specs = [GenerateSpec(ids, self._params(body, body.max_tokens, len(ids), body.logprobs, j), adapter, n,
                                  body.cache_salt, body.priority or 0) for ids in encoded for j in range(n)]
            stream = await self._open(specs, label)
            events = self._run(stream, body, label, arrival)
        parts = [part for part in prompt_parts for _ in range(n)]
        if body.stream:
            return Result(None, self._stream_completion(resp, events, body, view, parts), stream)
        return Result(await self._collect_completion(resp, events, body, view, parts), None, stream)

    async def _completion_prompt(self, body: CompletionRequest, prompt, ids: list[int], adapter, view,
                                 alone_n: int) -> dict:
        """What a choice shows of its prompt: the echo (text, and its logprobs object when asked, with
        text_offset over that text), `prompt_logprobs`, `prompt_token_ids`."""
        want = [k for k in (body.logprobs if body.echo else None, body.prompt_logprobs) if k is not None]
        entries = await self._prompt_logprobs(ids, adapter, max(want), alone_n) if want else None
        part = {"ids": ids, "echo": "", "echo_lp": None, "prompt_logprobs": None, "scored": bool(want)}
        if body.echo:
            whole = isinstance(prompt, str) and body.truncate_prompt_tokens is None  # else: the ids kept
            part["echo"] = prompt if whole else self.tokenizer.decode(ids, skip_special_tokens=False)
            if body.logprobs is not None:
                part["echo_lp"] = view.completion(ids, _top(entries, body.logprobs), 0, prompt=True)
        if body.prompt_logprobs is not None:
            part["prompt_logprobs"] = view.prompt_logprobs(ids, entries, body.prompt_logprobs)
        return part

    def _count_scored(self, label: str, prompt_lens: list[int], n: int, arrival: float) -> None:
        """moelora's per-adapter series of a request that only scored its prompts (the engine thread reports
        vLLM's): each choice of each scored prompt a finished request of `length`."""
        m, now = self.metrics, time.monotonic()
        for length in prompt_lens:
            m.requests.labels(label, "length").inc(n)
            m.prompt_tokens.labels(label).inc(length * n)
            for _ in range(n):
                m.e2e.labels(label).observe(now - arrival)

    def _choice_extras(self, body: _Sampling, part_ids: list[int] | None, token_ids: list[int]) -> dict:
        if not body.return_token_ids:
            return {}
        return {"token_ids": token_ids, **({"prompt_token_ids": part_ids} if part_ids is not None else {})}

    async def _collect_completion(self, resp: OpenAIResponse, events, body: CompletionRequest, view: LogprobView,
                                  parts: list[dict]) -> dict:
        n = len(parts)
        texts, reasons, stops = [p["echo"] for p in parts], ["length"] * n, [None] * n
        ids, lps, stop_last = [[] for _ in range(n)], [[] for _ in range(n)], [False] * n
        async for ev in events or no_events():
            texts[ev.index] += ev.text
            reasons[ev.index] = ev.finish_reason or reasons[ev.index]
            stops[ev.index] = ev.stop_reason
            ids[ev.index] += ev.token_ids
            lps[ev.index] += ev.logprobs
            stop_last[ev.index] = ev.ends_on_stop_token
            resp.count(ev)
        choices = []
        for i, part in enumerate(parts):
            lp = None
            if body.logprobs is not None:
                lp = view.completion(ids[i], lps[i], len(part["echo"]), stop_last[i])
                if part["echo_lp"] is not None:
                    lp = {k: part["echo_lp"][k] + lp[k] for k in lp}
            choices.append({"index": i, "text": texts[i], "logprobs": lp, "finish_reason": reasons[i],
                            "stop_reason": stops[i], "prompt_logprobs": part["prompt_logprobs"],
                            **self._choice_extras(body, part["ids"], ids[i])})
        return resp.body("text_completion", choices, usage=resp.usage())

    async def _stream_completion(self, resp: OpenAIResponse, events, body: CompletionRequest, view: LogprobView,
                                 parts: list[dict]):
        offsets = [len(p["echo"]) for p in parts]
        try:
            for i, part in enumerate(parts):  # the echoed prompt (or prompt_logprobs), one chunk a choice
                if not body.echo and part["prompt_logprobs"] is None and not body.return_token_ids:
                    continue
                choice = {"index": i, "text": part["echo"], "logprobs": part["echo_lp"],
                          "finish_reason": None if events else "length", "stop_reason": None,
                          "prompt_logprobs": part["prompt_logprobs"], **self._choice_extras(body, part["ids"], [])}
                yield resp.body("text_completion", [choice], **resp.chunk_usage())
            async for ev in events or no_events():
                resp.count(ev)
                lp = None
                if body.logprobs is not None:
                    lp = view.completion(ev.token_ids, ev.logprobs, offsets[ev.index], ev.ends_on_stop_token)
                    offsets[ev.index] += sum(len(t) for t in lp["tokens"])
                if not ev.text and lp is None and ev.finish_reason is None:
                    continue
                choice = {"index": ev.index, "text": ev.text, "logprobs": lp, "finish_reason": ev.finish_reason,
                          "stop_reason": ev.stop_reason, **self._choice_extras(body, None, ev.token_ids)}
                yield resp.body("text_completion", [choice], **resp.chunk_usage())
            if resp.final_usage:
                yield resp.body("text_completion", [], usage=resp.usage())
        except ApiError as e:
            yield e.body()

    # chat ---------------------------------------------------------------------------------------
    async def chat(self, body: ChatCompletionRequest) -> Result:
        arrival = time.monotonic()
        adapter = self._check_common(body, {"top_logprobs": body.top_logprobs})
        label = adapter or self.cfg.served_model_names[0]
        if body.top_logprobs and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs to be true", "top_logprobs")
        tools, parser, forced = self._tools(body)
        text = render_chat(self.tokenizer, body.messages, body.add_generation_prompt, body.continue_final_message,
                           template_kwargs(self.cfg.default_chat_template_kwargs, body.chat_template_kwargs,
                                           body.reasoning_effort), tools,
                           self.cfg.chat_template_content_format)
        ids = self._encode(text, "messages", bool(body.add_special_tokens), body.truncate_prompt_tokens)
        if parser is not None and parser.keeps_special_tokens:  # its tags are special tokens: decode them (vLLM's)
            body = body.model_copy(update={"skip_special_tokens": False})  # before the sampling parameters
        fmt = self._reply_format(body, parser, text, forced)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        n, view = body.choices, self._view(body)
        prompt_lp = None
        if body.prompt_logprobs is not None:
            entries = await self._prompt_logprobs(ids, adapter, body.prompt_logprobs)
            prompt_lp = view.prompt_logprobs(ids, entries, body.prompt_logprobs)
        asked = body.structured_output()  # validated once; `_params` gets it
        if forced is not None and asked is not None:
            raise ApiError(400, f"tool_choice {body.tool_mode()!r} is a structured output itself: send no other "
                           "(response_format, structured_outputs, guided_*)", "tool_choice")
        asked = ("json", forced.schema()) if forced is not None else asked
        after = self._grammar_start(text) if asked is not None else None
        spacing = "single" if forced is not None else None  # calls' JSON: one space after "," and ":"
        specs = [GenerateSpec(ids, self._params(body, max_tokens, len(ids), logprobs, j, after, asked, spacing),
                              adapter, n, body.cache_salt, body.priority or 0) for j in range(n)]
        stream = await self._open(specs, label)
        resp = OpenAIResponse("chatcmpl", body, self.cfg.served_model_names[0], len(ids),
                              self.cfg.enable_prompt_tokens_details, self.cfg.enable_force_include_usage)
        last = body.messages[-1]
        echo = last.text() if body.echo and last.role == "assistant" else ""  # vLLM: the reply's role only
        role = self.cfg.response_role if body.add_generation_prompt is not False else last.role
        events = self._run(stream, body, label, arrival)
        extra = {"prompt_logprobs": prompt_lp, **({"prompt_token_ids": ids} if body.return_token_ids else {})}
        if body.stream:
            return Result(None, self._stream_chat(resp, events, body, view, echo, extra, fmt, role), stream)
        return Result(await self._collect_chat(resp, events, body, view, echo, extra, fmt, role), None, stream)

    def _grammar_start(self, prompt: str) -> int | None:
        """With --reasoning-parser, a structured output holds the answer, not the reasoning (vLLM's): it starts after
        the `</think>` token, unless the prompt closed the reasoning already (thinking off); None: at once."""
        if (not self.cfg.reasoning_parser or self.cfg.structured_in_reasoning
                or reasoning_parser(self.cfg.reasoning_parser).first_mode(prompt) == "content"):
            return None
        end = self.tokenizer.token_id("</think>")
        if end is None:
            raise ApiError(400, f"structured outputs with --reasoning-parser {self.cfg.reasoning_parser} need "
                           "'</think>' to be one token of the vocabulary", "response_format")
        return end

    def _tools(self, body: ChatCompletionRequest):
        """(the tools the template renders, the parser of the reply's calls or None, the forced choice or None), as
        vLLM decides them."""
        mode = body.tool_mode()
        tools = template_tools(body.tools)
        if mode in ("required", "named"):  # held to a schema by structured outputs (forced_tools.py)
            if not tools:
                raise ApiError(400, f"tool_choice {mode!r} needs tools", "tool_choice")
            named = body.tool_choice.function.name if mode == "named" else None
            if named is not None and named not in {t.function.name for t in body.tools}:
                raise ApiError(400, f"tool_choice names {named!r}, which is not one of the request's tools",
                               "tool_choice")
            return tools, None, forced_tools(body.tool_choice, body.tools, body.parallel_tool_calls is not False)
        if mode == "none":
            return (None if self.cfg.exclude_tools_when_tool_choice_none else tools), None, None
        if not tools:
            return None, None, None
        if self.cfg.tool_call_parser is None:
            raise ApiError(400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
                           "set", "tool_choice")
        return tools, tool_parser(self.cfg.tool_call_parser), None

    def _reply_format(self, body: ChatCompletionRequest, parser, prompt: str, forced=None) -> ReplyFormat:
        """What the reply's text becomes (reply.py)."""
        reasoning = reasoning_parser(self.cfg.reasoning_parser) if self.cfg.reasoning_parser else None
        return ReplyFormat(parser, reasoning, prompt, body.parallel_tool_calls is not False,
                           body.include_reasoning is not False,
                           {t.function.name: t.function.parameters or {} for t in body.tools or ()}, forced)

    async def _collect_chat(self, resp: OpenAIResponse, events, body: ChatCompletionRequest, view: LogprobView,
                            echo: str, extra: dict, fmt: ReplyFormat, role: str) -> dict:
        n = body.choices
        texts, reasons, stops = [[] for _ in range(n)], [None] * n, [None] * n
        ids, lps = [[] for _ in range(n)], [[] for _ in range(n)]
        async for ev in events:
            texts[ev.index].append(ev.text)
            reasons[ev.index] = ev.finish_reason or reasons[ev.index]
            stops[ev.index] = ev.stop_reason
            ids[ev.index] += ev.token_ids
            if body.logprobs:
                lps[ev.index] += view.chat(ev.token_ids, ev.logprobs, ev.ends_on_stop_token)
            resp.count(ev)
        choices = []
        for i in range(n):
            message, called = fmt.message(role, echo, "".join(texts[i]))
            choices.append({"index": i, "message": message,
                            "logprobs": {"content": lps[i]} if body.logprobs else None,
                            "finish_reason": fmt.finish_reason(called, reasons[i]), "stop_reason": stops[i],
                            **self._choice_extras(body, None, ids[i])})
        return resp.body("chat.completion", choices, usage=resp.usage(), **extra)

    async def _stream_chat(self, resp: OpenAIResponse, events, body: ChatCompletionRequest, view: LogprobView,
                           echo: str, extra: dict, fmt: ReplyFormat, role: str):
        try:
            for i in range(body.choices):  # the first chunk carries the prompt's fields (prompt_logprobs, ...)
                first = {"index": i, "delta": {"role": role, "content": echo}, "logprobs": None,
                         "finish_reason": None}
                yield resp.body("chat.completion.chunk", [first], **resp.chunk_usage(), **(extra if i == 0 else {}))
            replies = [ReplyStream(fmt) for _ in range(body.choices)]
            async for ev in events:
                resp.count(ev)
                lp = None
                if body.logprobs and ev.token_ids:
                    lp = {"content": view.chat(ev.token_ids, ev.logprobs, ev.ends_on_stop_token)}
                reply = replies[ev.index]
                delta = reply.push(ev.text, ev.finish_reason is not None)
                if not delta and ev.finish_reason is None:
                    if lp is None:
                        continue
                    delta = {"content": ""}
                reason = fmt.finish_reason(reply.calls > 0, ev.finish_reason) if ev.finish_reason is not None else None
                choice = {"index": ev.index, "delta": delta, "logprobs": lp, "finish_reason": reason,
                          "stop_reason": ev.stop_reason, **self._choice_extras(body, None, ev.token_ids)}
                yield resp.body("chat.completion.chunk", [choice], **resp.chunk_usage())
            if resp.final_usage:
                yield resp.body("chat.completion.chunk", [], usage=resp.usage())
        except ApiError as e:
            yield e.body()


def _top(entries: list, k: int) -> list:
    """Engine logprob entries with at most k alternatives each."""
    return [(lp, rank, top[:k]) for lp, rank, top in entries]
