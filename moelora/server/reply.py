"""What a chat reply's generated text becomes: `reasoning` (`--reasoning-parser`), `content` and
`tool_calls` (`--tool-call-parser`), whole or streamed. The reasoning is split off first; calls are looked
for in the content only. The whole reply goes through the streaming machines at once, so a stream's
deltas join to the whole response's message.
"""

from __future__ import annotations

from dataclasses import dataclass

from moelora.server.forced_tools import ForcedStream, ForcedTools
from moelora.server.reasoning import ReasoningStream, ThinkParser
from moelora.server.tools import ToolParser, ToolStream


@dataclass(frozen=True)
class ReplyFormat:
    tools: ToolParser | None  # tool_choice "auto" with tools: the parser of calls
    reasoning: ThinkParser | None
    prompt: str  # the rendered prompt (where the reasoning starts)
    parallel_tool_calls: bool = True  # false: the first call only
    include_reasoning: bool = True  # false: the reasoning is split off but not returned
    schemas: dict | None = None  # each offered tool's parameters schema, by name (glm45 / qwen3_coder value types)
    forced: ForcedTools | None = None  # tool_choice "required" or named: the reply is the calls (forced_tools.py)

    @property
    def plain(self) -> bool:
        return self.tools is None and self.reasoning is None and self.forced is None

    def finish_reason(self, called: bool, reason: str | None) -> str | None:
        """The choice's finish_reason from the engine's `reason` ("tool_calls" for calls a parser found)."""
        if self.forced is not None:
            return self.forced.finish_reason(called, reason)
        return "tool_calls" if called else reason

    def message(self, role: str, echo: str, text: str) -> tuple[dict, bool]:
        """(the message of a whole reply after `echo`, whether it made calls); an empty content is null once a
        parser split the reply (it may all be reasoning or calls), "" otherwise."""
        if self.plain:
            return {"role": role, "content": echo + text}, False
        out = ReplyStream(self).push(text, last=True)
        called = "tool_calls" in out
        empty = None if self.reasoning is not None or called else ""
        message = {"role": role, "content": (echo + out.get("content", "")) or empty}
        if self.reasoning is not None and self.include_reasoning:
            message["reasoning"] = message["reasoning_content"] = out.get("reasoning")
        if called:
            message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in out["tool_calls"]]
        return message, called


class ReplyStream:
    """One choice's text as delta fields: reasoning, content, tool_calls entries (indexed from 0)."""

    def __init__(self, fmt: ReplyFormat):
        self.fmt = fmt
        self.reasoning = ReasoningStream(fmt.reasoning, fmt.prompt) if fmt.reasoning is not None else None
        self.tools = ToolStream(fmt.tools, fmt.schemas) if fmt.tools is not None else None
        self.forced = ForcedStream(fmt.forced) if fmt.forced is not None else None
        self.calls = 0

    def push(self, text: str, last: bool) -> dict:
        """The delta fields of the next text (`last`: the reply ends with it); {} if nothing is decided yet."""
        reasoning, content, calls = "", text, []
        if self.reasoning is not None:
            reasoning, content = self.reasoning.push(text)
            if last:
                more = self.reasoning.finish()
                reasoning, content = reasoning + more[0], content + more[1]
        entries = []
        if self.tools is not None:
            content, calls = self.tools.push(content)
            if last:
                more = self.tools.finish()
                content, calls = content + more[0], calls + more[1]
            if not self.fmt.parallel_tool_calls:
                calls = calls[:max(0, 1 - self.calls)]
            entries = [{"index": self.calls + i, **c.body()} for i, c in enumerate(calls)]
            self.calls += len(calls)
        elif self.forced is not None:
            content, entries = self.forced.push(content, last)
            self.calls = self.forced.calls
        delta = {}
        if reasoning and self.fmt.include_reasoning:
            delta["reasoning"] = delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        if entries:
            delta["tool_calls"] = entries
        return delta
