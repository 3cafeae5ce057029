"""Reasoning (`--reasoning-parser`): the `<think>` parsers on whole and streamed outputs (the stream joined
equals the whole, at any cut), where the reasoning starts (the prompt's open or closed tag, the output's
start, the parser), and the server's `reasoning` / `reasoning_content` beside content and tool calls through
the `openai` client, whole and streamed (event texts scripted as in test_tools.py).
"""

from __future__ import annotations

import json
import random

import pytest

from moelora.server.reasoning import ReasoningStream, extract_reasoning, reasoning_parser
from tests.helpers.server import BASE, TIMEOUT, cpu_app, make_client, post, serving, thinking_server, write_model

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

R1, QWEN3 = reasoning_parser("deepseek_r1"), reasoning_parser("qwen3")
OPEN, CLOSED, PLAIN = "<|im_start|>assistant\n<think>\n", "assistant\n<think>\n\n</think>\n\n", "assistant\n"
CASES = {  # (parser, prompt, output) -> (reasoning, content)
    "opened by the output": (QWEN3, PLAIN, "<think>\nLet me add.\n</think>\n\nIt is 4.", ("Let me add.", "It is 4.")),
    "opened by the prompt": (QWEN3, OPEN, "Let me add.\n</think>\n\nIt is 4.", ("Let me add.", "It is 4.")),
    "closed by the prompt": (R1, CLOSED, "It is 4.</think> no", (None, "It is 4.</think> no")),
    "qwen3 without tags is content": (QWEN3, PLAIN, "  It is 4.\n", (None, "  It is 4.\n")),
    "r1 without tags is reasoning": (R1, PLAIN, "hmm, 2 + 2\n", ("hmm, 2 + 2", None)),
    "r1 with the tag left out": (R1, PLAIN, "hmm</think>4", ("hmm", "4")),
    "cut while thinking": (QWEN3, PLAIN, "<think>still going <", ("still going <", None)),
    "a start that is not the tag": (QWEN3, PLAIN, "<thin air>", (None, "<thin air>")),
    "empty reasoning": (QWEN3, OPEN, "\n</think>\n\n4", (None, "4")),
    "only the tag's start": (QWEN3, PLAIN, " <thi", (None, " <thi")),
    "minimax_m2: thinking until the tag": (reasoning_parser("minimax_m2"), PLAIN, "Add them.\n</think>\n\n4",
                                           ("Add them.", "4")),
    "minimax_m2_append_think: the prompt's tag leads the content": (
        reasoning_parser("minimax_m2_append_think"), "]~b]ai\n<think>\n", "Add them.\n</think>\n\n4",
        (None, "<think>Add them.\n</think>\n\n4")),
    "minimax_m2_append_think: an output's own tag kept once": (
        reasoning_parser("minimax_m2_append_think"), PLAIN, "<think>a</think>b", (None, "<think>a</think>b")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_think_parsers_split_reasoning_and_content(case):
    parser, prompt, text, expected = CASES[case]
    assert extract_reasoning(parser, prompt, text) == expected


@pytest.mark.parametrize("case", list(CASES))
def test_streamed_parts_join_to_the_whole_output_at_any_cut(case):
    parser, prompt, text, (reasoning, content) = CASES[case]
    rng = random.Random(case)
    for _ in range(40):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 10))))
        s, r, c = ReasoningStream(parser, prompt), "", ""
        for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True):
            dr, dc = s.push(text[i:j])
            r, c = r + dr, c + dc
        dr, dc = s.finish()
        assert (r + dr, c + dc) == (reasoning or "", content or ""), cuts


def test_reasoning_streams_before_the_tag_closes():
    s = ReasoningStream(QWEN3, PLAIN)
    assert s.push("<thi") == ("", "")  # maybe the tag
    assert s.push("nk>\nStep one. ") == ("Step one.", "")  # the trailing space waits for more reasoning
    assert s.push("Step two.</th") == (" Step two.", "")
    assert s.push("ink>\n\nDone") == ("", "Done")


def test_unknown_reasoning_parser_names_the_known_ones():
    with pytest.raises(ValueError, match="deepseek_r1, deepseek_v3, glm45, minimax_m2, minimax_m2_append_think, qwen3"):
        reasoning_parser("granite")


@pytest.mark.parametrize("name", ["glm45", "deepseek_v3"])
def test_the_template_led_parsers_read_a_bare_reply_as_content(name):
    """GLM-4.5's and DeepSeek-V3.1's templates open <think> (thinking on) or close it (off); a reply that opens no
    tag after a prompt that did neither is content, unlike deepseek_r1's."""
    parser = reasoning_parser(name)
    assert extract_reasoning(parser, PLAIN, "It is 4.") == (None, "It is 4.")
    assert extract_reasoning(parser, OPEN, "add</think>4") == ("add", "4")
    assert extract_reasoning(parser, CLOSED, "4") == (None, "4")


# ------------------------------------------------------------------------------------------ the server
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
            "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
            "{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
USER = [{"role": "user", "content": "2 + 2?"}]
CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 2}}</tool_call>'
ADD = {"type": "function", "function": {"name": "add"}}


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    with thinking_server(tmp_path_factory.mktemp("server_reasoning"), TEMPLATE) as u:
        yield u


def create(url, **kw):
    return make_client(url).chat.completions.create(model=BASE, messages=USER, max_tokens=40, temperature=0,
                                                    extra_body={"ignore_eos": True, **kw.pop("extra", {})}, **kw)


def test_reasoning_content_and_calls_whole_and_streamed(url, scripted_replies):
    reply = "<think>\nI should add.\n</think>\n\n" + CALL
    scripted_replies += [reply, reply]
    r = post(url, "/v1/chat/completions", {"model": BASE, "messages": USER, "max_tokens": 40, "ignore_eos": True,
                                           "tools": [ADD]})
    whole = r.json()["choices"][0]
    message = whole["message"]
    assert message["reasoning"] == message["reasoning_content"] == "I should add." and message["content"] is None
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"a": 2, "b": 2}
    assert whole["finish_reason"] == "tool_calls"
    chunks = [c.choices[0] for c in create(url, tools=[ADD], stream=True) if c.choices]
    reasoning = "".join(getattr(c.delta, "reasoning_content", None) or "" for c in chunks)
    content = "".join(c.delta.content or "" for c in chunks)
    calls = [t for c in chunks for t in c.delta.tool_calls or ()]
    assert (reasoning, content, [t.function.name for t in calls]) == ("I should add.", "", ["add"])
    assert chunks[-1].finish_reason == "tool_calls"


def test_thinking_off_in_the_template_makes_all_content_and_include_reasoning_false_drops_it(url, scripted_replies):
    scripted_replies += ["It is 4. </think> really", "<think>hmm</think>4"]
    off = create(url, extra={"chat_template_kwargs": {"enable_thinking": False}}).choices[0].message
    assert off.content == "It is 4. </think> really" and off.reasoning_content is None
    dropped = create(url, extra={"include_reasoning": False}).choices[0].message
    assert dropped.content == "4" and getattr(dropped, "reasoning_content", None) is None


def test_a_plain_server_keeps_the_think_text_in_the_content(tmp_path, scripted_replies):
    out, _ = write_model(tmp_path)
    with serving(cpu_app(out)) as plain:
        scripted_replies += ["<think>hmm</think>4"]
        r = post(plain, "/v1/chat/completions", {"model": BASE, "messages": USER, "max_tokens": 20,
                                                 "ignore_eos": True})
        message = r.json()["choices"][0]["message"]
        assert message == {"role": "assistant", "content": "<think>hmm</think>4"}


def test_a_resent_reply_gives_its_reasoning_to_the_template(url, scripted_replies):
    scripted_replies += ["<think>add them</think>4"]
    message = make_client(url).chat.completions.create(model=BASE, messages=USER, max_tokens=30, temperature=0,
                                                       extra_body={"ignore_eos": True}).choices[0].message
    history = [*USER, message.model_dump(exclude_none=False), {"role": "user", "content": "and 3 + 3?"}]
    r = post(url, "/tokenize", {"model": BASE, "messages": history})
    assert r.status_code == 200, r.text
    text = httpx.post(url + "/detokenize", json={"tokens": r.json()["tokens"]}, timeout=TIMEOUT).json()["prompt"]
    assert "assistant\n<think>add them</think>4\n" in text
    for key in ("reasoning", "reasoning_content"):  # either name alone (older / newer clients)
        turn = {"role": "assistant", "content": "4", key: "x"}
        r = post(url, "/tokenize", {"model": BASE, "messages": [*USER, turn]})
        assert "<think>x</think>4" in httpx.post(url + "/detokenize", json={"tokens": r.json()["tokens"]},
                                                 timeout=TIMEOUT).json()["prompt"]
