"""Random replies through the reply machines (hypothesis): for every tool and reasoning parser, replies built from
whole calls in the parser's format, tag-like text, whitespace and think tags, streamed at random cuts, join to the
whole reply's message (a stream that sent a tag's start as content, or reasoning's, fails it); no text is lost
where no call parsed (the content is the reply, less a format's wrapper tags); reasoning plus content keep every
non-whitespace character of a reply with no tags."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from moelora.server.reasoning import REASONING_PARSERS, extract_reasoning, reasoning_parser
from moelora.server.reply import ReplyFormat, ReplyStream
from moelora.server.tools import TOOL_PARSERS, tool_parser

# a whole call in each parser's format, and text around it: plain runs, tag-like text, whitespace, think tags
CALLS = {
    "hermes": '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>',
    "deepseek_v3": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{\"a\": 1}\n```"
                   "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    "deepseek_v31": '<｜tool▁call▁begin｜>f<｜tool▁sep｜>{"a": 1}<｜tool▁call▁end｜>',
    "glm45": "<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call>",
    "glm47": "<tool_call>f<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",
    "qwen3_coder": "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>",
    "kimi_k2": '<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{"a": 1}'
               "<|tool_call_end|><|tool_calls_section_end|>",
    "minimax_m2": '<minimax:tool_call>\n<invoke name="f">\n<parameter name="a">1</parameter>\n</invoke>\n'
                  "</minimax:tool_call>",
}
TEXT = ["text", " ", "\n", "é", "<", ">", "<tool", "<tool_call>", "</tool_call>", "<think>", "</think>", '"', "{",
        "<invoke name=", "</invoke>"]
prompts = st.sampled_from(["user\nhi\nassistant\n", "assistant\n<think>\n", "assistant\n<think>\n\n</think>\n\n"])


def replies(tool: str | None):
    return st.lists(st.sampled_from(TEXT + ([CALLS[tool]] * 4 if tool else [])), max_size=10).map("".join)


def streamed(fmt: ReplyFormat, text: str, cuts: list[int]) -> dict:
    s, out = ReplyStream(fmt), {"reasoning": "", "content": "", "calls": []}
    bounds = [0, *sorted(c % (len(text) + 1) for c in cuts), len(text)]
    for i, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
        delta = s.push(text[a:b], last=i == len(bounds) - 2)
        out["reasoning"] += delta.get("reasoning", "")
        out["content"] += delta.get("content", "")
        out["calls"] += [(c["function"]["name"], c["function"]["arguments"]) for c in delta.get("tool_calls", ())]
    return out


@settings(max_examples=300, deadline=None)
@given(data=st.data(), tool=st.sampled_from([None, *sorted(TOOL_PARSERS)]),
       think=st.sampled_from([None, *sorted(REASONING_PARSERS)]), prompt=prompts,
       cuts=st.lists(st.integers(0, 400), max_size=12))
def test_a_streamed_reply_joins_to_the_whole_message(data, tool, think, prompt, cuts):
    text = data.draw(replies(tool))
    fmt = ReplyFormat(tool_parser(tool) if tool else None, reasoning_parser(think) if think else None, prompt)
    message, called = fmt.message("assistant", "", text)
    got = streamed(fmt, text, cuts)
    assert got["content"] == (message["content"] or "")
    assert got["reasoning"] == (message.get("reasoning") or "")
    assert got["calls"] == [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", ())]
    assert called == bool(got["calls"])
    if tool is not None and not called and think is None:  # nothing parsed: the reply is the content
        wrappers = tool_parser(tool).wrappers
        expected = text
        for w in wrappers:
            expected = expected.replace(w, "")
        assert message["content"] == expected


@settings(max_examples=150, deadline=None)
@given(think=st.sampled_from(sorted(REASONING_PARSERS)), prompt=prompts,
       text=st.lists(st.sampled_from(["a", "b c", "\n", " ", "é", "<", ">", "/"]), max_size=12).map("".join))
def test_reasoning_and_content_keep_every_character_of_a_tagless_reply(think, prompt, text):
    parser = reasoning_parser(think)
    reasoning, content = extract_reasoning(parser, prompt, text)
    if parser.in_content:  # nothing split off: the whole reply, after the tag the prompt opened
        opened = "<think>" if prompt.rstrip().endswith("<think>") else ""
        assert reasoning is None and content == ((opened + text) or None)
        return
    assert "".join(((reasoning or "") + (content or "")).split()) == "".join(text.split())
