"""OpenAI's Responses API (POST /v1/responses) over the chat completions path.

A request becomes a chat completion: `instructions` a system message, `input` (a string, or items: messages with
text parts, earlier `function_call`s and their `function_call_output`s, `reasoning` items given to the next
assistant turn) the messages, `max_output_tokens` max_tokens, function tools the chat tools. The chat reply
(its reasoning with --reasoning-parser, content, tool calls with --tool-call-parser) becomes the response's output
items: `reasoning` (a `reasoning_text` part), `message` (an `output_text` part), `function_call`s. Streamed, the
chat chunks become the Responses events (`response.created`, `response.output_item.added`,
`response.output_text.delta`, ..., `response.completed`, or `response.incomplete` when max_output_tokens cut it).
Not kept: responses are not stored (`store` is accepted and changes nothing; `previous_response_id` and
`background` are refused: send the whole conversation as input). `text.format` json_schema / json_object is chat's
response_format (structured outputs).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError

from moelora.server.protocol import ANY, NONE, NONE_OR_EMPTY, ApiError, ChatCompletionRequest, NonNegFloat, _Body
from moelora.server.serving import Result


class ResponsesTool(_Body):
    accepted_at = {"strict": (ANY,)}

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ResponsesRequest(_Body):
    # advisory fields, and features left off at their neutral values (others: 400 naming them)
    accepted_at = {"store": (ANY,), "metadata": (ANY,), "service_tier": (ANY,), "user": (ANY,),
                   "prompt_cache_key": (ANY,), "safety_identifier": (ANY,),
                   "previous_response_id": NONE, "background": (None, False), "conversation": NONE, "prompt": NONE,
                   "truncation": (None, "disabled"), "include": NONE_OR_EMPTY, "max_tool_calls": NONE,
                   "top_logprobs": (None, 0), "stream_options": (ANY,)}

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: NonNegFloat | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    text: dict[str, Any] | None = None
    stream: bool | None = False
    reasoning: dict[str, Any] | None = None  # `effort`: chat's reasoning_effort (vLLM's); `summary` changes nothing


class ResponsesResult(Result):
    """A Result whose stream is the Responses API's events: `event: TYPE` lines, no `[DONE]`."""

    async def sse(self) -> AsyncIterator[str]:
        async for event in self.chunks:
            yield f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


async def create_response(serving, body: ResponsesRequest) -> Result:
    """POST /v1/responses on an `OpenAIServing`: its chat completion, as a response object or its events."""
    result = await serving.chat(chat_request(body))
    if body.stream:
        model = body.model or serving.cfg.served_model_names[0]
        return ResponsesResult(None, stream_of(body, result.chunks, model), result.stream)
    return Result(response_of(body, result.body), None, result.stream)


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion a Responses request asks for (ApiError 400 naming what cannot be)."""
    fmt = (body.text or {}).get("format") or {"type": "text"}
    if not isinstance(fmt, dict):
        raise ApiError(400, "text.format must be an object", "text")
    if fmt.get("type") == "json_schema":  # flat here, nested under json_schema in chat's response_format
        fmt = {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    choice = body.tool_choice
    if isinstance(choice, dict):  # {"type": "function", "name": ...}: the chat form
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    effort = (body.reasoning or {}).get("effort")
    chat = dict(model=body.model, messages=_messages(body), max_tokens=body.max_output_tokens, response_format=fmt,
                temperature=body.temperature, top_p=body.top_p, tool_choice=choice,
                parallel_tool_calls=body.parallel_tool_calls, stream=body.stream, reasoning_effort=effort,
                stream_options={"include_usage": True} if body.stream else None,
                tools=[{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                       for t in body.tools] if body.tools else None)
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        if where == "reasoning_effort":
            raise ApiError(400, f"reasoning.effort: {err['msg']}", "reasoning") from None
        raise ApiError(400, f"input: {where}: {err['msg']}", "input") from None


def _text(content, where: str) -> str:
    """A message's content: a string, or its text parts joined (other parts: 400)."""
    if isinstance(content, str):
        return content
    out = []
    for part in content or ():
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ApiError(400, f"{where}: content part {kind!r} is not supported (only text)", "input")
        out.append(part.get("text", ""))
    return "".join(out)


def _messages(body: ResponsesRequest) -> list[dict]:
    msgs = [{"role": "system", "content": body.instructions}] if body.instructions else []
    if isinstance(body.input, str):
        return [*msgs, {"role": "user", "content": body.input}]
    reasoning = None  # a reasoning item's text, for the assistant turn that follows it
    for i, item in enumerate(body.input):
        kind, where = item.get("type", "message"), f"input[{i}]"
        if kind == "message":
            msg = {"role": item.get("role"), "content": _text(item.get("content"), where)}
            if msg["role"] == "assistant" and reasoning:
                msg["reasoning_content"], reasoning = reasoning, None
            msgs.append(msg)
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            last = msgs[-1] if msgs else None
            if last is None or last["role"] != "assistant" or reasoning:
                last = {"role": "assistant", "content": None}
                if reasoning:
                    last["reasoning_content"], reasoning = reasoning, None
                msgs.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            msgs.append({"role": "tool", "tool_call_id": item.get("call_id"),
                         "content": output if isinstance(output, str) else _text(output, where)})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or ()
            reasoning = "".join(p.get("text", "") for p in parts if isinstance(p, dict))
        else:
            raise ApiError(400, f"{where}: input item type {kind!r} is not supported (message, function_call, "
                           "function_call_output, reasoning)", "input")
    return msgs


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _reasoning_item(text: str, item_id: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if text or status == "completed" else []}


def _message_item(text: str, item_id: str, status: str = "completed") -> dict:
    parts = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": parts}


def _call_item(call: dict, item_id: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"] if status == "completed" else "", "status": status}


class ResponseBody:
    """The response object around a request's output items."""

    def __init__(self, body: ResponsesRequest, model: str):
        self.body, self.model = body, model
        self.id, self.created = _id("resp"), int(time.time())

    def dump(self, status: str, output: list, usage: dict | None) -> dict:
        b = self.body
        incomplete = status == "incomplete"
        return {"id": self.id, "object": "response", "created_at": self.created, "model": self.model,
                "status": status, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "metadata": {},
                "output": output, "parallel_tool_calls": b.parallel_tool_calls is not False,
                "temperature": 1.0 if b.temperature is None else b.temperature,
                "top_p": 1.0 if b.top_p is None else b.top_p, "tool_choice": b.tool_choice or "auto",
                "tools": [t.model_dump(exclude_none=True) for t in b.tools or ()],
                "text": {"format": _text_format(b)}, "truncation": "disabled", "store": False,
                "previous_response_id": None, "reasoning": None, "usage": _usage(usage) if usage else None}


def _text_format(body: ResponsesRequest) -> dict:
    """The response's `text.format`: the request's, "text" by default."""
    return (body.text or {}).get("format") or {"type": "text"}


def _usage(u: dict) -> dict:
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"input_tokens": u["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["total_tokens"]}


def response_of(body: ResponsesRequest, chat: dict) -> dict:
    """A whole chat completion as the Responses API's response object."""
    choice = chat["choices"][0]
    msg = choice["message"]
    output = []
    if msg.get("reasoning") or msg.get("reasoning_content"):
        output.append(_reasoning_item(msg.get("reasoning") or msg.get("reasoning_content"), _id("rs")))
    if msg.get("content"):
        output.append(_message_item(msg["content"], _id("msg")))
    output += [_call_item(call, _id("fc")) for call in msg.get("tool_calls") or ()]
    status = "incomplete" if choice["finish_reason"] == "length" else "completed"
    return ResponseBody(body, chat["model"]).dump(status, output, chat.get("usage"))


async def stream_of(body: ResponsesRequest, chunks, model: str):
    """The chat stream's chunk bodies as the Responses API's events."""
    resp, seq = ResponseBody(body, model), 0

    def event(kind: str, **fields) -> dict:
        nonlocal seq
        seq += 1
        return {"type": kind, "sequence_number": seq - 1, **fields}

    output, usage, finish = [], None, None
    open_item = None  # (kind, item id, output index, text so far)
    yield event("response.created", response=resp.dump("in_progress", [], None))
    yield event("response.in_progress", response=resp.dump("in_progress", [], None))

    def close():
        nonlocal open_item
        if open_item is None:
            return
        kind, item_id, index, text = open_item
        open_item = None
        if kind == "reasoning":
            item = _reasoning_item(text, item_id)
            yield event("response.reasoning_text.done", item_id=item_id, output_index=index, content_index=0,
                        text=text)
        else:
            item = _message_item(text, item_id)
            yield event("response.output_text.done", item_id=item_id, output_index=index, content_index=0,
                        text=text, logprobs=[])
        yield event("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                    part=item["content"][0])
        output.append(item)
        yield event("response.output_item.done", output_index=index, item=item)

    def add(kind: str, delta: str):
        nonlocal open_item
        if open_item is not None and open_item[0] != kind:
            yield from close()
        if open_item is None:
            item_id, index = _id("rs" if kind == "reasoning" else "msg"), len(output)
            open_item = (kind, item_id, index, "")
            item = (_reasoning_item("", item_id, "in_progress") if kind == "reasoning"
                    else _message_item("", item_id, "in_progress"))
            yield event("response.output_item.added", output_index=index, item=item)
            part = ({"type": "reasoning_text", "text": ""} if kind == "reasoning"
                    else {"type": "output_text", "text": "", "annotations": [], "logprobs": []})
            yield event("response.content_part.added", item_id=item_id, output_index=index, content_index=0,
                        part=part)
        k, item_id, index, text = open_item
        open_item = (k, item_id, index, text + delta)
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        yield event(name, item_id=item_id, output_index=index, content_index=0, delta=delta, **extra)

    async for chunk in chunks:
        if "error" in chunk:
            err = chunk["error"]
            yield event("error", code=str(err.get("code")), message=err.get("message"), param=err.get("param"))
            return
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning") or delta.get("reasoning_content")
            if reasoning:
                for e in add("reasoning", reasoning):
                    yield e
            if delta.get("content"):
                for e in add("message", delta["content"]):
                    yield e
            for call in delta.get("tool_calls") or ():
                for e in close():
                    yield e
                item_id, index = _id("fc"), len(output)
                yield event("response.output_item.added", output_index=index,
                            item=_call_item(call, item_id, "in_progress"))
                args = call["function"]["arguments"]
                yield event("response.function_call_arguments.delta", item_id=item_id, output_index=index,
                            delta=args)
                yield event("response.function_call_arguments.done", item_id=item_id, output_index=index,
                            arguments=args, name=call["function"]["name"])
                item = _call_item(call, item_id)
                output.append(item)
                yield event("response.output_item.done", output_index=index, item=item)
            finish = choice.get("finish_reason") or finish
    for e in close():
        yield e
    status = "incomplete" if finish == "length" else "completed"
    yield event(f"response.{status}", response=resp.dump(status, output, usage))
