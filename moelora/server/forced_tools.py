"""tool_choice "required" and a named function (vLLM's way): the reply is held to a JSON schema by structured outputs
(engine/structured.py) and becomes tool calls, with no --tool-call-parser.

  named     `{"type": "function", "function": {"name": NAME}}`: the output is NAME's arguments (its parameters schema;
            any object where it has none), always one call whose arguments are the output's text (vLLM's: cut short
            by max_tokens, they are the text so far); finish_reason the engine's ("stop", as OpenAI and vLLM answer
            a forced function, or "length"). Streamed: the call's id and name first, then its arguments as they come.
  required  the output is a JSON array of at least one `{"name": ..., "parameters": {...}}` of the offered tools (at
            most one with parallel_tool_calls false); finish_reason "tool_calls". Streamed, the calls come whole
            once the output ends (their JSON is only whole then); an output cut short that does not parse stays
            content, as a whole reply's does.
The content is null.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from moelora.server.tools import ToolCall, new_call_id

ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ForcedTools:
    name: str | None  # the named function; None: "required"
    parameters: tuple[tuple[str, dict], ...]  # each offered tool's (name, parameters schema)
    parallel: bool = True

    def finish_reason(self, called: bool, reason: str | None) -> str | None:
        """A reply's finish_reason from the engine's `reason`: "tool_calls" for required calls made."""
        return "tool_calls" if called and self.name is None else reason

    def schema(self) -> dict:
        """The JSON schema the output is held to."""
        params = dict(self.parameters)
        if self.name is not None:
            return params[self.name]
        items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [n]}, "parameters": p},
                  "required": ["name", "parameters"], "additionalProperties": False} for n, p in params.items()]
        return {"type": "array", "minItems": 1, **({} if self.parallel else {"maxItems": 1}),
                "items": items[0] if len(items) == 1 else {"anyOf": items}}

    def calls(self, text: str) -> list[ToolCall] | None:
        """The calls of a whole "required" output; None where it does not parse as them (cut short)."""
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return None
        if not isinstance(value, list) or not all(isinstance(c, dict) and isinstance(c.get("name"), str)
                                                  and isinstance(c.get("parameters"), dict) for c in value):
            return None
        return [ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False), new_call_id()) for c in value]


def forced_tools(choice, tools, parallel: bool) -> ForcedTools:
    """From a request's tool_choice ("required", or a named choice with `.function.name`) and its tools."""
    params = tuple((t.function.name, t.function.parameters or ANY_OBJECT) for t in tools or ())
    name = None if choice == "required" else choice.function.name
    return ForcedTools(name, params, parallel)


class ForcedStream:
    """A forced choice's reply as it streams: (content, `tool_calls` delta entries) of each piece of text."""

    def __init__(self, forced: ForcedTools):
        self.forced, self.buf, self.calls = forced, "", 0
        self.call_id = new_call_id()

    def push(self, text: str, last: bool) -> tuple[str, list[dict]]:
        f = self.forced
        if f.name is not None:  # one call: its head with the first text, then the arguments as they come
            if self.calls == 0:
                if not text and not last:  # the head waits for the arguments' first text
                    return "", []
                self.calls = 1
                return "", [{"index": 0, "id": self.call_id, "type": "function",
                             "function": {"name": f.name, "arguments": text}}]
            return "", [{"index": 0, "function": {"arguments": text}}] if text else []
        self.buf += text
        if not last:
            return "", []
        calls = f.calls(self.buf)
        if calls is None:
            return self.buf, []
        calls = calls if f.parallel else calls[:1]
        self.calls = len(calls)
        return "", [{"index": i, **c.body()} for i, c in enumerate(calls)]
