"""tool_choice "required" and a named function (vLLM's way): the reply is held to a JSON schema by structured outputs
(engine/structured.py) and becomes tool calls, with no --tool-call-parser.

  named     `{"type": "function", "function": {"name": NAME}}`: the output is NAME's arguments object (its parameters
            schema; any object where it has none); one call, finish_reason "stop" (as OpenAI and vLLM answer a forced
            function).
  required  the output is a JSON array of at least one `{"name": ..., "parameters": {...}}` of the offered tools (at
            most one with parallel_tool_calls false); finish_reason "tool_calls".
The content is null. Streamed, the calls come as `tool_calls` deltas once the output ends (their JSON is only whole
then); an output cut short by max_tokens that does not parse stays content, as a whole reply's does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from moelora.server.tools import ToolCall, new_call_id

ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ForcedTools:
    name: str | None  # the named function; None: "required"
    parameters: tuple[tuple[str, str], ...]  # each offered tool's (name, parameters schema as JSON text)
    parallel: bool = True

    @property
    def finish_reason(self) -> str:
        return "stop" if self.name is not None else "tool_calls"

    def schema(self) -> dict:
        """The JSON schema the output is held to."""
        params = {n: json.loads(p) for n, p in self.parameters}
        if self.name is not None:
            return params[self.name]
        items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [n]}, "parameters": p},
                  "required": ["name", "parameters"], "additionalProperties": False} for n, p in params.items()]
        return {"type": "array", "minItems": 1, **({} if self.parallel else {"maxItems": 1}),
                "items": items[0] if len(items) == 1 else {"anyOf": items}}

    def calls(self, text: str) -> list[ToolCall] | None:
        """The calls of a whole output; None where it does not parse as them (cut short)."""
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return None
        if self.name is not None:
            ok = isinstance(value, dict)
            return [ToolCall(self.name, json.dumps(value, ensure_ascii=False), new_call_id())] if ok else None
        if not isinstance(value, list) or not all(isinstance(c, dict) and isinstance(c.get("name"), str)
                                                  and isinstance(c.get("parameters"), dict) for c in value):
            return None
        return [ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False), new_call_id()) for c in value]


def forced_tools(choice, tools, parallel: bool) -> ForcedTools:
    """From a request's tool_choice ("required", or a named choice with `.function.name`) and its tools."""
    params = tuple((t.function.name, json.dumps(t.function.parameters or ANY_OBJECT)) for t in tools or ())
    name = None if choice == "required" else choice.function.name
    return ForcedTools(name, params, parallel)


class ForcedStream:
    """The `ToolStream` interface (push / finish) for a forced choice: everything is held until the end."""

    def __init__(self, forced: ForcedTools):
        self.forced, self.buf, self.calls = forced, "", 0

    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        self.buf += text
        return "", []

    def finish(self) -> tuple[str, list[ToolCall]]:
        calls = self.forced.calls(self.buf)
        if calls is None:
            return self.buf, []
        self.calls = len(calls)
        return "", calls
