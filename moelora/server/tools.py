"""Tool calls in chat completions: the model writes them as text in its family's format; a parser
(`--tool-call-parser`, vLLM's names) turns that text into `tool_calls` of the OpenAI response, whole or
while streaming.

Every format is blocks between an opening and a closing tag, one call a block:
  hermes        `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`: Qwen2.5 / Qwen3 (their MoE
                models included), Hermes.
  deepseek_v3   `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` and the arguments in a ```json fence, then
                `<｜tool▁call▁end｜>`, the blocks inside `<｜tool▁calls▁begin｜>` ... `<｜tool▁calls▁end｜>`
                (DeepSeek-V3 / R1); also DeepSeek-V3.1's `NAME<｜tool▁sep｜>ARGUMENTS` blocks (`deepseek_v31`
                names the same parser). The tags are special tokens: decoded with skip_special_tokens off.
  glm45         `<tool_call>NAME` then `<arg_key>K</arg_key><arg_value>V</arg_value>` pairs, `</tool_call>`
                (GLM-4.5 / 4.6): a value is JSON where the tool's schema types the parameter as other than a
                string (or, unknown, where it parses as JSON), else the text as it is. `glm47` (GLM-4.7, 4.7-Flash:
                the name then the first pair with no newline between, or no pair) names the same parser.
  qwen3_coder   `<tool_call><function=NAME><parameter=K>V</parameter>...</function></tool_call>` (Qwen3-Coder,
                its MoE models included): values as glm45's, less the newline the model writes around each.
  kimi_k2       `<|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>{...}<|tool_call_end|>`
                inside `<|tool_calls_section_begin|>` ... `<|tool_calls_section_end|>` (Kimi-K2): the call's id is
                the model's `functions.NAME:INDEX`; special tokens, decoded as deepseek's.
  minimax_m2    `<invoke name="NAME"><parameter name="K">V</parameter>...</invoke>` blocks inside
                `<minimax:tool_call>` ... `</minimax:tool_call>` (MiniMax-M2 / M2.1 / M2.5): values as glm45's, less
                the newline around each; decoded as deepseek's.
The message's content is the text outside the blocks (and outside a format's wrapper tags), null if only
whitespace is left; a block whose body is not a call stays in the content, tags and all, so no text is lost
(but wrapper tags: never content); one whose body holds another opening tag is, from the last one, a block again.

Streaming: content is sent as it comes, except a tail that may be the start of a tag (held until it is known
not to be) and trailing whitespace (held until other content follows; dropped at the end if the output made
calls, so a call's surrounding newlines are not content). A call is sent as one `tool_calls` delta (index,
id, type, name and the whole arguments) once its closing tag arrives, or at the end of the output for a block
left open whose body parses. A whole output is parsed by the same machine, so the streamed content and calls
join to the whole response's.
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


class ToolParser:
    """A format's tags (module docstring) and how a block's body becomes a call."""

    start = end = ""
    wrappers: tuple[str, ...] = ()  # tags around a run of blocks: neither content nor calls
    keeps_special_tokens = False  # the tags are special tokens: decode with skip_special_tokens off

    def call(self, body: str, schemas: dict[str, dict]) -> ToolCall | None:
        """A block's body as a call (None: not a call); `schemas`: each offered tool's parameters schema."""
        raise NotImplementedError


def _call(name: str, args, call_id: str | None = None) -> ToolCall | None:
    """A call of `name` with an arguments object (or its JSON text); None if they are not one. `call_id`: the
    model's own (Kimi's), else a new one."""
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return None
    if not name or not isinstance(args, dict):
        return None
    return ToolCall(name, json.dumps(args, ensure_ascii=False), call_id or new_call_id())


class HermesParser(ToolParser):
    start, end = "<tool_call>", "</tool_call>"

    def call(self, body: str, schemas: dict[str, dict]) -> ToolCall | None:
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        return _call(obj["name"], obj.get("arguments", {}))


class DeepSeekParser(ToolParser):
    start, end = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
    wrappers = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
    keeps_special_tokens = True
    sep = "<｜tool▁sep｜>"

    def call(self, body: str, schemas: dict[str, dict]) -> ToolCall | None:
        left, sep, right = body.partition(self.sep)
        if not sep:
            return None
        if left.strip() == "function" and "\n" in right:  # V3 / R1: the name, then a ```json fence
            name, _, args = right.partition("\n")
            args = args.strip()
            if args.startswith("```"):
                args = args[3:].removeprefix("json").removesuffix("```")
            return _call(name.strip(), args)
        return _call(left.strip(), right)  # V3.1


class Glm45Parser(ToolParser):
    start, end = "<tool_call>", "</tool_call>"
    key, key_end, value, value_end = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"

    def call(self, body: str, schemas: dict[str, dict]) -> ToolCall | None:
        name, has_args, pairs = body.partition(self.key)
        name = name.strip()
        if not name or "\n" in name:
            return None
        props = (schemas.get(name) or {}).get("properties") or {}
        args, pairs = {}, (self.key + pairs).strip() if has_args else ""
        while pairs:
            key, ok, pairs = pairs.removeprefix(self.key).partition(self.key_end)
            pairs = pairs.lstrip()
            if not ok or not pairs.startswith(self.value):
                return None
            value, ok, pairs = pairs[len(self.value):].partition(self.value_end)
            if not ok:
                return None
            key, pairs = key.strip(), pairs.strip()
            args[key] = _typed(value, (props.get(key) or {}).get("type"))
            if pairs and not pairs.startswith(self.key):
                return None
        return _call(name, args)


class Qwen3CoderParser(ToolParser):
    start, end = "<tool_call>", "</tool_call>"
    fn, fn_end, param, param_end = "<function=", "</function>", "<parameter=", "</parameter>"

    def call(self, body: str, schemas: dict[str, dict]) -> ToolCall | None:
        body = body.strip()
        if not (body.startswith(self.fn) and body.endswith(self.fn_end)):
            return None
        name, ok, params = body[len(self.fn):-len(self.fn_end)].partition(">")
        name, params = name.strip(), params.strip()
        if not ok:
            return None
        args = _parameters(params, self.param, self.param_end, schemas.get(name), str.strip)
        return None if args is None else _call(name, args)


class KimiK2Parser(ToolParser):
    start, end = "<|tool_call_begin|>", "<|tool_call_end|>"
    wrappers = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")
    keeps_special_tokens = True
    args_tag = "<|tool_call_argument_begin|>"

    def call(self, body: str, schemas: dict[str, dict]) -> ToolCall | None:
        call_id, ok, args = body.partition(self.args_tag)
        call_id = call_id.strip()  # functions.NAME:INDEX, the call's id
        name = call_id.rpartition(":")[0].removeprefix("functions.")
        return _call(name, args, call_id) if ok and name else None


class MinimaxM2Parser(ToolParser):
    start, end = "<invoke name=", "</invoke>"
    wrappers = ("<minimax:tool_call>", "</minimax:tool_call>")
    keeps_special_tokens = True
    param, param_end = "<parameter name=", "</parameter>"

    def call(self, body: str, schemas: dict[str, dict]) -> ToolCall | None:
        name, ok, params = body.partition(">")
        name, params = _unquoted(name), params.strip()
        if not ok or not name:
            return None
        args = _parameters(params, self.param, self.param_end, schemas.get(name), _unquoted)
        return None if args is None else _call(name, args)


def _parameters(params: str, tag: str, tag_end: str, schema: dict | None, key_of) -> dict | None:
    """Qwen3-Coder's and MiniMax's arguments: `TAG` KEY `>` VALUE `TAG_END` runs (whitespace between them), each
    value `_typed` by the tool's schema less a newline at either end; None where the text is not only such runs."""
    props, args = (schema or {}).get("properties") or {}, {}
    params = params.strip()
    while params:
        if not params.startswith(tag):
            return None
        key, ok1, params = params[len(tag):].partition(">")
        value, ok2, params = params.partition(tag_end)
        key, params = key_of(key), params.strip()
        if not (ok1 and ok2 and key):
            return None
        args[key] = _typed(value.removeprefix("\n").removesuffix("\n"), (props.get(key) or {}).get("type"))
    return args


def _unquoted(text: str) -> str:
    """A MiniMax tag's name attribute: the text in its double quotes (or the bare text)."""
    text = text.strip()
    return text[1:-1] if len(text) >= 2 and text[0] == text[-1] == '"' else text


def _typed(text: str, schema_type) -> object:
    """A GLM / Qwen3-Coder argument value: the text for a string parameter, else its JSON value if it parses."""
    if schema_type == "string":
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


TOOL_PARSERS = {"hermes": HermesParser, "deepseek_v3": DeepSeekParser, "deepseek_v31": DeepSeekParser,
                "glm45": Glm45Parser, "glm47": Glm45Parser, "qwen3_coder": Qwen3CoderParser, "kimi_k2": KimiK2Parser,
                "minimax_m2": MinimaxM2Parser}


def tool_parser(name: str) -> ToolParser:
    """The parser `--tool-call-parser NAME` names (ValueError naming the ones there are)."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; this server has: {', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]()


def extract_tool_calls(parser: ToolParser, text: str, schemas: dict[str, dict] | None = None
                       ) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole output: the streaming machine over all of it. With no calls the content is
    the text as it is (less any wrapper tags); with calls, null if nothing but whitespace is left."""
    s = ToolStream(parser, schemas)
    content, calls = s.push(text)
    rest, more = s.finish()
    content, calls = content + rest, calls + more
    return (content or None) if calls else content, calls


class ToolStream:
    """One choice's output split into content and calls as it streams (module docstring)."""

    def __init__(self, parser: ToolParser, schemas: dict[str, dict] | None = None):
        self.parser, self.schemas = parser, schemas or {}
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
                found = [(at, tag) for tag in (p.start, *p.wrappers) if (at := self.buf.find(tag)) >= 0]
                if not found:
                    cut = len(self.buf) - max(partial_tag(self.buf, tag) for tag in (p.start, *p.wrappers))
                    out.append(self._content(self.buf[:cut]))
                    self.buf = self.buf[cut:]
                    break
                at, tag = min(found)
                out.append(self._content(self.buf[:at]))
                self.buf, self.in_block = self.buf[at + len(tag):], tag == p.start
            else:
                at = self.buf.find(p.end)
                if at < 0:
                    break
                body, self.buf, self.in_block = self.buf[:at], self.buf[at + len(p.end):], False
                text, call = self._close(body, p.end)
                out.append(self._content(text))
                calls += [call] if call is not None else []
        self.calls += len(calls)
        return "".join(out), calls

    def _close(self, body: str, end: str) -> tuple[str, ToolCall | None]:
        """(content, call) of a block's `body` closed by `end` ("" at the output's end): its call; else, where the
        body holds another opening tag, the call of the block from the last one, the text before it content;
        else the block's text as content. Wrapper tags are never content."""
        p = self.parser
        call = p.call(body, self.schemas)
        if call is None and p.start in body:  # a tag that began no call, then the block of the last one
            head, _, tail = body.rpartition(p.start)
            if (call := p.call(tail, self.schemas)) is not None:
                return self._unwrapped(p.start + head), call
        if call is not None:
            return "", call
        return self._unwrapped(p.start + body + end), None

    def _unwrapped(self, text: str) -> str:
        for tag in self.parser.wrappers:
            text = text.replace(tag, "")
        return text

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the output's end: an open block's call if its body parses, else what is held is content."""
        calls, out = [], ""
        if self.in_block:
            text, call = self._close(self.buf, "")
            out = self._content(text)
            calls += [call] if call is not None else []
        else:
            out = self._content(self.buf)  # a wrapper's start left at the end is text after all
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
