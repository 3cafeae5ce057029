"""Tool calls in chat completions: the model writes them as text in its family's format; a parser
(`--tool-call-parser`, vLLM's names) turns that text into `tool_calls` of the OpenAI response, whole or
while streaming.

Parsers:
  hermes  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block a call, as the chat
          templates of Qwen2.5 / Qwen3 (their MoE models included) and the Hermes models instruct the model
          to write. Text before the first block is the message's content (null if only whitespace);
          text between and after the blocks is dropped. A block whose body is not a JSON object with a
          string `name` makes the whole output plain content (no call), as an unparsable output should
          never lose text.

Streaming: content is sent as it comes, except a tail that may be the start of an opening tag (held until
it is known not to be) and trailing whitespace (held until other content follows; dropped at the end if the
output made calls, so a call's surrounding newlines are not content). A call is sent as one
`tool_calls` delta (index, id, type, name and the whole arguments) once its closing tag arrives, or at the end of
the output for a block left open whose body parses. A block whose body is not a call is content, tags and all.
A whole output is parsed by the same machine, so the streamed content and calls join to the whole response's.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object
    id: str = ""

    def body(self) -> dict:
        """OpenAI's `tool_calls` entry of a message."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class HermesParser:
    """`<tool_call>` JSON `</tool_call>` blocks (module docstring)."""

    start, end = "<tool_call>", "</tool_call>"

    def call(self, body: str) -> ToolCall | None:
        """A block's body as a call: a JSON object with a string `name` and an `arguments` object (also as JSON
        text); None: not a call."""
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return None
        if not isinstance(args, dict):
            return None
        return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False), new_call_id())


TOOL_PARSERS = {"hermes": HermesParser}


def tool_parser(name: str) -> HermesParser:
    """The parser `--tool-call-parser NAME` names (ValueError naming the ones there are)."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; this server has: {', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]()


def extract_tool_calls(parser: HermesParser, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole output: the streaming machine over all of it. With no calls the content is
    the text as it is; with calls, null if nothing but whitespace is left."""
    s = ToolStream(parser)
    content, calls = s.push(text)
    rest, more = s.finish()
    content, calls = content + rest, calls + more
    return (content or None) if calls else content, calls


class ToolStream:
    """One choice's output split into content and calls as it streams (module docstring)."""

    def __init__(self, parser: HermesParser):
        self.parser = parser
        self.buf = ""  # not yet decided: a possible opening tag's start, or an open block's body
        self.in_block = False
        self.pending = ""  # trailing whitespace of the content, held until other content follows
        self.calls = 0  # calls made so far

    def _content(self, text: str) -> str:
        """Content to send now: all but the trailing whitespace, which waits for more content."""
        self.pending += text
        out = self.pending.rstrip()
        self.pending = self.pending[len(out):]
        return out

    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content to send now, calls completed by this text)."""
        p, out, calls = self.parser, [], []
        self.buf += text
        while True:
            if not self.in_block:
                at = self.buf.find(p.start)
                if at < 0:
                    cut = len(self.buf) - partial_tag(self.buf, p.start)
                    out.append(self._content(self.buf[:cut]))
                    self.buf = self.buf[cut:]
                    break
                out.append(self._content(self.buf[:at]))
                self.buf, self.in_block = self.buf[at + len(p.start):], True
            else:
                at = self.buf.find(p.end)
                if at < 0:
                    break
                body, self.buf, self.in_block = self.buf[:at], self.buf[at + len(p.end):], False
                call = p.call(body)
                if call is None:
                    out.append(self._content(p.start + body + p.end))
                else:
                    calls.append(call)
        self.calls += len(calls)
        return "".join(out), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the output's end: an open block's call if its body parses, else what is held is content."""
        p, calls, out = self.parser, [], ""
        if self.in_block:
            call = p.call(self.buf)
            if call is None:
                out = self._content(p.start + self.buf)
            else:
                calls.append(call)
        else:
            out = self._content(self.buf)
        self.buf, self.in_block = "", False
        self.calls += len(calls)
        if not self.calls:
            out, self.pending = out + self.pending, ""
        return out, calls


def partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
