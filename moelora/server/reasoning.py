"""Reasoning in chat completions (`--reasoning-parser`, vLLM's names): a thinking model's `<think> ...
</think>` text becomes the message's `reasoning` (also as `reasoning_content`, its older name) and only
what follows is `content` (where tool calls are then looked for).

Where the reasoning starts: a prompt that ends in `<think>` (the chat template opened it: DeepSeek-R1's,
Qwen3-2507 thinking models') starts the output in reasoning; one that ends in `</think>` (the template
closed it: Qwen3's `enable_thinking: false`) starts it in content. Otherwise an output that opens with
`<think>` is in reasoning from there; one that does not is reasoning for `deepseek_r1` (R1 may leave the
tag out) and content for `qwen3`. Reasoning ends at `</think>`; an output that never closes it (cut by
max_tokens) is all reasoning. The reasoning is trimmed of whitespace, the content of what follows
`</think>` right after it; an empty part is null.

`minimax_m2_append_think` (vLLM's, for MiniMax-M2, whose guides ask clients to send the thinking back in the
next turn's content) splits nothing: the whole output is content, after the `<think>` that a prompt ending in
it opened, so the content holds the whole think block.

Streaming: the same machine, so the streamed parts join to the whole response's: text is sent as it
comes, except a tail that may start a tag and whitespace that may turn out to be a part's end.
"""

from __future__ import annotations

from moelora.server.tools import partial_tag

_START, _END = "<think>", "</think>"


class ThinkParser:
    """`<think> ... </think>` reasoning (module docstring); `bare_reasoning`: an output that does not open
    the tag (in a prompt that did not either) is reasoning until `</think>`."""

    def __init__(self, bare_reasoning: bool, in_content: bool = False):
        self.bare_reasoning, self.in_content = bare_reasoning, in_content

    def first_mode(self, prompt: str) -> str:
        """"reasoning", "content" or "open" (decided by the output's start) for an output after `prompt`."""
        tail = prompt.rstrip()
        if tail.endswith(_START):
            return "reasoning"
        if tail.endswith(_END):
            return "content"
        return "open"


# vLLM's names: deepseek_r1 (R1, QwQ); qwen3; glm45 (GLM-4.5 / 4.6 thinking); deepseek_v3 (V3.1, whose template
# opens <think> with thinking on and closes it with thinking off: the prompt decides); minimax_m2 (its output is
# thinking until </think>, as R1's) and minimax_m2_append_think (module docstring)
REASONING_PARSERS = {"deepseek_r1": lambda: ThinkParser(bare_reasoning=True),
                     "qwen3": lambda: ThinkParser(bare_reasoning=False),
                     "glm45": lambda: ThinkParser(bare_reasoning=False),
                     "deepseek_v3": lambda: ThinkParser(bare_reasoning=False),
                     "minimax_m2": lambda: ThinkParser(bare_reasoning=True),
                     "minimax_m2_append_think": lambda: ThinkParser(bare_reasoning=True, in_content=True)}


def reasoning_parser(name: str) -> ThinkParser:
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; this server has: {', '.join(sorted(REASONING_PARSERS))}")
    return REASONING_PARSERS[name]()


class _Trim:
    """A part's text as it streams, without its leading (`lead`) and trailing (`trail`) whitespace."""

    def __init__(self, lead: bool, trail: bool):
        self.lead, self.trail, self.pending = lead, trail, ""

    def push(self, text: str) -> str:
        if self.lead:
            text = text.lstrip()
            self.lead = not text
        if not self.trail:
            return text
        self.pending += text
        out = self.pending.rstrip()
        self.pending = self.pending[len(out):]
        return out


class ReasoningStream:
    """One choice's output split into reasoning and content as it streams (module docstring)."""

    def __init__(self, parser: ThinkParser, prompt: str):
        self.parser, self.mode, self.buf = parser, parser.first_mode(prompt), ""
        self.reasoning, self.content = _Trim(lead=True, trail=True), _Trim(lead=False, trail=False)
        if parser.in_content:  # all content, the tag the prompt opened first
            self.buf, self.mode = (_START if self.mode == "reasoning" else ""), "content"

    def push(self, text: str) -> tuple[str, str]:
        """(reasoning, content) to send now."""
        self.buf += text
        reasoning, content = "", ""
        while True:
            if self.mode == "open":
                head = self.buf.lstrip()
                if head.startswith(_START):
                    self.buf, self.mode = head[len(_START):], "reasoning"
                elif _START.startswith(head):
                    break  # nothing yet, or a tag's start: wait
                else:
                    self.mode = "reasoning" if self.parser.bare_reasoning else "content"
            elif self.mode == "reasoning":
                at = self.buf.find(_END)
                if at < 0:
                    cut = len(self.buf) - partial_tag(self.buf, _END)
                    reasoning += self.reasoning.push(self.buf[:cut])
                    self.buf = self.buf[cut:]
                    break
                reasoning += self.reasoning.push(self.buf[:at])
                self.buf, self.mode = self.buf[at + len(_END):], "content"
                self.content.lead = True  # the blank line after </think> is not content
            else:
                content += self.content.push(self.buf)
                self.buf = ""
                break
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """At the output's end: what is held goes to the part it is in (an undecided start: as never opened)."""
        if self.mode == "open":
            self.mode = "reasoning" if self.parser.bare_reasoning else "content"
        rest, self.buf = self.buf, ""
        if self.mode == "reasoning":
            return self.reasoning.push(rest), ""
        return "", self.content.push(rest)


def extract_reasoning(parser: ThinkParser, prompt: str, text: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole output; an empty part is None."""
    s = ReasoningStream(parser, prompt)
    r1, c1 = s.push(text)
    r2, c2 = s.finish()
    return (r1 + r2) or None, (c1 + c2) or None
