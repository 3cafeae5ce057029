"""Tool calls: the hermes parser on whole and streamed outputs (the stream joined equals the whole, at any
cut), the tools and earlier calls through the chat template, and the server's `tool_calls` through the
`openai` client, whole and streamed (`--enable-auto-tool-choice --tool-call-parser hermes`), with vLLM's
refusals.

The server runs the tiny test model; its greedy text is random bytes, so the end-to-end tests replace each
generated event's text by a scripted reply's pieces (`scripted_replies`: the engine still runs the request,
its token counts, finish and metrics stand).
"""

from __future__ import annotations

import json
import random

import pytest

from moelora.server.tools import HermesParser, ToolStream, extract_tool_calls, tool_parser
from tests.helpers.server import BASE, TIMEOUT, cpu_app, make_client, post, serving, write_model

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

P = HermesParser()
CALL_A = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}\n</tool_call>'
CALL_B = '<tool_call>\n{"name": "get_time", "arguments": "{\\"tz\\": \\"CET\\"}"}\n</tool_call>'
A = ("get_weather", {"city": "Paris", "unit": "°C"})
B = ("get_time", {"tz": "CET"})


def calls_of(calls) -> list:
    return [(c.name, json.loads(c.arguments)) for c in calls]


# ------------------------------------------------------------------------------------------ the parser
OUTPUTS = {  # output -> (content, calls)
    "plain": ("It is sunny in Paris.\n", ("It is sunny in Paris.\n", [])),
    "whitespace only": ("\n \n", ("\n \n", [])),
    "one call": (CALL_A, (None, [A])),
    "text then two calls": ("Let me check.\n\n" + CALL_A + "\n" + CALL_B + "\n",
                            ("Let me check.", [A, B])),
    "open call at the end": ("<tool_call>" + json.dumps({"name": "get_weather", "arguments": A[1]}),
                             (None, [A])),
    "not json stays content": ("<tool_call>not json</tool_call> ok", ("<tool_call>not json</tool_call> ok", [])),
    "a bad block beside a call": (CALL_A + "<tool_call>[1]</tool_call>", ("<tool_call>[1]</tool_call>", [A])),
    "arguments not an object": ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
                                ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', [])),
    "a tag's start that is not one": ("a <tool_ca b <tool_call", ("a <tool_ca b <tool_call", [])),
    "thinking then a call": ("<think>need weather</think>\n\n" + CALL_A, ("<think>need weather</think>", [A])),
    "no arguments": ('<tool_call>{"name": "ping"}</tool_call>', (None, [("ping", {})])),
}


DS_BEGIN, DS_END, DS_CALL, DS_CALL_END, DS_SEP = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
                                                  "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>")
DS_A = DS_CALL + "function" + DS_SEP + 'get_weather\n```json\n{"city": "Paris", "unit": "°C"}\n```' + DS_CALL_END
DS_B = DS_CALL + "get_time" + DS_SEP + '{"tz": "CET"}' + DS_CALL_END  # DeepSeek-V3.1's form
DEEPSEEK = {
    "deepseek: text then two calls": ("Checking." + DS_BEGIN + DS_A + "\n" + DS_B + DS_END, ("Checking.", [A, B])),
    "deepseek: a block without a separator": (DS_BEGIN + DS_CALL + "oops" + DS_CALL_END + DS_END,
                                              (DS_CALL + "oops" + DS_CALL_END, [])),
    "deepseek: open at the end": (DS_BEGIN + DS_B.removesuffix(DS_CALL_END), (None, [B])),
}
GLM_SCHEMAS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"},
                                                                "days": {"type": "integer"}}}}
GLM = {
    "glm45: typed by the schema": ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>2046</arg_value>\n"
                                   "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
                                   (None, [("get_weather", {"city": "2046", "days": 3})])),
    "glm45: untyped values as JSON where they parse": (
        "Sure.\n<tool_call>get_time\n<arg_key>tz</arg_key><arg_value>CET</arg_value>"
        "<arg_key>opts</arg_key><arg_value>{\"dst\": true}</arg_value></tool_call>",
        ("Sure.", [("get_time", {"tz": "CET", "opts": {"dst": True}})])),
    "glm45: no arguments": ("<tool_call>ping</tool_call>", (None, [("ping", {})])),
    "glm45: a broken pair stays content": ("<tool_call>f\n<arg_key>a</arg_key>x</tool_call>",
                                           ("<tool_call>f\n<arg_key>a</arg_key>x</tool_call>", [])),
}
CODER = {
    "qwen3_coder: typed by the schema": (
        "Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n2046\n</parameter>\n<parameter=days>\n3\n"
        "</parameter>\n</function>\n</tool_call>", ("Sure.", [("get_weather", {"city": "2046", "days": 3})])),
    "qwen3_coder: multi-line text kept": ("<tool_call><function=note><parameter=text>\na\n b\n</parameter></function>"
                                          "</tool_call>", (None, [("note", {"text": "a\n b"})])),
    "qwen3_coder: no function tag stays content": ("<tool_call>get_weather</tool_call>",
                                                   ("<tool_call>get_weather</tool_call>", [])),
}
KIMI_BEGIN, KIMI_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI = {
    "kimi_k2: two calls": (KIMI_BEGIN + '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
                           '{"city": "Paris", "unit": "°C"}<|tool_call_end|><|tool_call_begin|>functions.get_time:1'
                           '<|tool_call_argument_begin|>{"tz": "CET"}<|tool_call_end|>' + KIMI_END, (None, [A, B])),
}
HERMES_NESTED = {
    "hermes: an argument holding the opening tag": (
        '<tool_call>{"name": "f", "arguments": {"s": "<tool_call>"}}</tool_call>',
        (None, [("f", {"s": "<tool_call>"})])),
}
GLM47 = {
    "glm47: the name runs into its first pair": (
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key>"
        "<arg_value>2</arg_value></tool_call>", (None, [("get_weather", {"city": "Paris", "days": 2})])),
    "glm47: no arguments": ("Now.<tool_call>ping</tool_call>", ("Now.", [("ping", {})])),
}
MM_BEGIN, MM_END = "<minimax:tool_call>", "</minimax:tool_call>"
MINIMAX = {
    "minimax_m2: two calls, typed by the schema": (
        "Let me check.\n" + MM_BEGIN + '\n<invoke name="get_weather">\n<parameter name="city">2046</parameter>\n'
        '<parameter name="days">3</parameter>\n</invoke>\n<invoke name="get_time">\n<parameter name="tz">CET'
        "</parameter>\n</invoke>\n" + MM_END,
        ("Let me check.", [("get_weather", {"city": "2046", "days": 3}), ("get_time", {"tz": "CET"})])),
    "minimax_m2: no parameters": (MM_BEGIN + '<invoke name="ping"></invoke>' + MM_END, (None, [("ping", {})])),
    "minimax_m2: a stray opening tag, then the call": (
        '<invoke name=' + MM_BEGIN + '\n<invoke name="f">\n<parameter name="a">1</parameter>\n</invoke>\n' + MM_END,
        ("<invoke name=", [("f", {"a": 1})])),
    "minimax_m2: a broken parameter stays content": (
        MM_BEGIN + '<invoke name="f"><parameter name="a">1</invoke>' + MM_END,
        ('<invoke name="f"><parameter name="a">1</invoke>', [])),
}
CASES = {**{k: ("hermes", *v) for k, v in OUTPUTS.items()}, **{k: ("deepseek_v3", *v) for k, v in DEEPSEEK.items()},
         **{k: ("glm45", *v) for k, v in GLM.items()}, **{k: ("qwen3_coder", *v) for k, v in CODER.items()},
         **{k: ("kimi_k2", *v) for k, v in KIMI.items()}, **{k: ("minimax_m2", *v) for k, v in MINIMAX.items()},
         **{k: ("glm47", *v) for k, v in GLM47.items()}, **{k: ("hermes", *v) for k, v in HERMES_NESTED.items()}}


@pytest.mark.parametrize("case", list(CASES))
def test_parsers_extract_content_and_calls(case):
    name, text, (content, calls) = CASES[case]
    got_content, got_calls = extract_tool_calls(tool_parser(name), text, GLM_SCHEMAS)
    assert got_content == content and calls_of(got_calls) == calls
    ids = [c.id for c in got_calls]
    kimi = ["functions.get_weather:0", "functions.get_time:1"]  # Kimi's calls carry their own ids
    assert ids == kimi if name == "kimi_k2" else all(i.startswith("chatcmpl-tool-") for i in ids)
    assert len({c.id for c in got_calls}) == len(got_calls)


@pytest.mark.parametrize("case", list(CASES))
def test_streamed_content_and_calls_join_to_the_whole_output_at_any_cut(case):
    name, text, (content, calls) = CASES[case]
    rng = random.Random(case)
    for _ in range(40):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12))))
        pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        s, got, got_calls = ToolStream(tool_parser(name), GLM_SCHEMAS), "", []
        for piece in pieces:
            c, k = s.push(piece)
            got, got_calls = got + c, got_calls + k
        c, k = s.finish()
        got, got_calls = got + c, got_calls + k
        assert got == (content or "") and calls_of(got_calls) == calls, pieces


def test_a_stream_sends_content_before_the_call_ends_and_holds_only_a_possible_tag():
    s = ToolStream(P)
    assert s.push("Checking <tool") == ("Checking", [])  # held: a trailing space, and "<tool" (maybe a tag)
    assert s.push("box> now") == (" <toolbox> now", [])
    content, calls = s.push(" " + CALL_A[:30])
    assert content == "" and calls == []
    content, calls = s.push(CALL_A[30:])
    assert content == "" and calls_of(calls) == [A]  # the call is sent as its closing tag arrives
    assert s.finish() == ("", [])  # the space before the call was whitespace: dropped with a call made


def test_unknown_parser_names_the_known_ones():
    known = "deepseek_v3, deepseek_v31, glm45, glm47, hermes, kimi_k2, minimax_m2, qwen3_coder"
    with pytest.raises(ValueError, match=known):
        tool_parser("mistral")


# ------------------------------------------------------------------------------------------ the server
TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %}\n{{ t | tojson }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ {'name': c.function.name, "
    "'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}"
    "{% elif m.role == 'tool' %}[{{ m.tool_call_id }}] {{ m['content'] }}{% else %}{{ m['content'] }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Température <now> & 'ici'",
                                            "parameters": {"type": "object"}}}  # short: the model holds 256 tokens
USER = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out, _ = write_model(tmp_path_factory.mktemp("server_tools"))
    (out / "chat_template.jinja").write_text(TEMPLATE)
    return out


@pytest.fixture(scope="module")
def url(model_dir):
    with serving(cpu_app(model_dir, tool_call_parser="hermes")) as u:
        yield u


@pytest.fixture(scope="module")
def plain_url(model_dir):
    """No --enable-auto-tool-choice; --exclude-tools-when-tool-choice-none."""
    with serving(cpu_app(model_dir, exclude_tools_when_tool_choice_none=True)) as u:
        yield u


def rendered(url, **body) -> str:
    r = post(url, "/tokenize", {"model": BASE, **body})
    assert r.status_code == 200, r.text
    return httpx.post(url + "/detokenize", json={"tokens": r.json()["tokens"]}, timeout=TIMEOUT).json()["prompt"]


def test_tools_and_earlier_calls_reach_the_chat_template_as_transformers_renders_them(url):
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call-1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": "21"}]
    text = rendered(url, messages=history, tools=[WEATHER])
    tool_json = json.dumps(WEATHER, ensure_ascii=False)  # transformers' tojson: no HTML escapes, unicode kept
    # /detokenize leaves the special tokens out; trim_blocks drops the newline after "{% for ... %}"
    assert text == ("system\nTools:" + tool_json + "\nuser\nWeather in Paris?\nassistant\n"
                    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
                    "tool\n[call-1] 21\nassistant\n")


def test_a_reply_with_calls_becomes_tool_calls(url, scripted_replies):
    scripted_replies += ["Let me look.\n" + CALL_A + "\n" + CALL_B]
    out = make_client(url).chat.completions.create(model=BASE, messages=USER, tools=[WEATHER], max_tokens=40,
                                                   temperature=0, extra_body={"ignore_eos": True})
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
    got = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert got == [A, B] and all(c.type == "function" and c.id for c in choice.message.tool_calls)
    assert out.usage.completion_tokens == 40  # the engine's tokens, whatever the text


def test_a_streamed_reply_gives_the_same_calls_and_content(url, scripted_replies):
    reply = "Let me look.\n" + CALL_A + "\n" + CALL_B
    scripted_replies += [reply, reply]
    kw = dict(model=BASE, messages=USER, tools=[WEATHER], max_tokens=40, temperature=0, n=2,
              extra_body={"ignore_eos": True})
    chunks = list(make_client(url).chat.completions.create(stream=True, **kw))
    for i in range(2):
        deltas = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        content = "".join(d.delta.content or "" for d in deltas)
        calls = {}
        for d in deltas:
            for t in d.delta.tool_calls or ():
                calls.setdefault(t.index, []).append(t)
        assert content == "Let me look." and deltas[-1].finish_reason == "tool_calls"
        assert [(p[0].function.name, json.loads("".join(x.function.arguments for x in p)))
                for _, p in sorted(calls.items())] == [A, B]
        assert all(p[0].id.startswith("chatcmpl-tool-") and p[0].type == "function" for p in calls.values())


def test_parallel_tool_calls_false_keeps_the_first_call(url, scripted_replies):
    scripted_replies += [CALL_A + CALL_B, CALL_A + CALL_B]
    kw = dict(model=BASE, messages=USER, tools=[WEATHER], max_tokens=40, temperature=0, parallel_tool_calls=False,
              extra_body={"ignore_eos": True})
    whole = make_client(url).chat.completions.create(**kw)
    assert [c.function.name for c in whole.choices[0].message.tool_calls] == ["get_weather"]
    streamed = [t for c in make_client(url).chat.completions.create(stream=True, **kw) if c.choices
                for t in c.choices[0].delta.tool_calls or ()]
    assert [t.function.name for t in streamed] == ["get_weather"]


def test_a_plain_reply_with_tools_stays_content(url, scripted_replies):
    scripted_replies += ["No tool needed <tool"]
    out = make_client(url).chat.completions.create(model=BASE, messages=USER, tools=[WEATHER], max_tokens=10,
                                                   temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].message.content == "No tool needed <tool" and not out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "length"


def test_tool_choice_none_parses_nothing(url, scripted_replies):
    scripted_replies += [CALL_A]
    out = make_client(url).chat.completions.create(model=BASE, messages=USER, tools=[WEATHER], tool_choice="none",
                                                   max_tokens=30, temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].message.content == CALL_A and not out.choices[0].message.tool_calls


# short tools: the tiny model holds 256 tokens, prompt and reply
W = {"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}
T = {"type": "function", "function": {"name": "t"}}
NAMED = {"type": "function", "function": {"name": "w"}}


def message_calls(calls) -> list:
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("choice,reply,want,reason", [
    (NAMED, '{"city": "Paris"}', [("w", {"city": "Paris"})], "stop"),
    ("required", '[{"name": "w", "parameters": {"city": "Paris"}}, {"name": "t", "parameters": {}}]',
     [("w", {"city": "Paris"}), ("t", {})], "tool_calls"),
], ids=["named", "required"])
def test_required_and_named_tool_choice_make_calls(url, scripted_replies, choice, reply, want, reason, stream):
    """The reply (held to the calls' schema: test_structured.py) becomes the calls, content null; a named choice
    finishes "stop" as OpenAI's and vLLM's do, "required" "tool_calls"."""
    scripted_replies += [reply]
    kw = dict(model=BASE, messages=USER, tools=[W, T], tool_choice=choice, max_tokens=30, temperature=0)
    client = make_client(url)
    if not stream:
        out = client.chat.completions.create(**kw).choices[0]
        assert out.message.content is None and out.finish_reason == reason
        assert message_calls(out.message.tool_calls) == want and all(c.id for c in out.message.tool_calls)
        return
    names, args, content, finish, pieces = {}, {}, "", None, 0
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            finish = c.finish_reason or finish
            for t in c.delta.tool_calls or ():  # a call's id and name first, its arguments in pieces after
                names[t.index] = names.get(t.index) or t.function.name
                args[t.index] = args.get(t.index, "") + (t.function.arguments or "")
                pieces += 1
    assert content == "" and finish == reason
    assert [(names[i], json.loads(args[i])) for i in sorted(names)] == want
    if choice == NAMED:  # its arguments streamed as they came (the scripted reply: 7-character pieces)
        assert pieces >= len(reply) // 7


def test_required_without_parallel_calls_keeps_one(url, scripted_replies):
    scripted_replies += ['[{"name": "t", "parameters": {}}, {"name": "t", "parameters": {}}]']
    out = make_client(url).chat.completions.create(model=BASE, messages=USER, tools=[W, T], max_tokens=30,
                                                   tool_choice="required", parallel_tool_calls=False, temperature=0)
    assert message_calls(out.choices[0].message.tool_calls) == [("t", {})]


def test_a_forced_reply_cut_short(url, scripted_replies):
    """vLLM's: a named function's call carries the text so far as its arguments; a "required" reply that does not
    parse stays content."""
    scripted_replies += ['{"city": "Par', '[{"name": "w", "param']  # cut short by max_tokens
    client = make_client(url)
    out = client.chat.completions.create(model=BASE, messages=USER, tools=[W], tool_choice=NAMED, max_tokens=30,
                                         temperature=0).choices[0]
    assert out.message.content is None and message_calls_raw(out.message.tool_calls) == [("w", '{"city": "Par')]
    out = client.chat.completions.create(model=BASE, messages=USER, tools=[W], tool_choice="required", max_tokens=30,
                                         temperature=0).choices[0]
    assert out.message.content == '[{"name": "w", "param' and not out.message.tool_calls
    assert out.finish_reason in ("stop", "length")


def message_calls_raw(calls) -> list:
    return [(c.function.name, c.function.arguments) for c in calls]


@pytest.mark.parametrize("body,message", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [W]}, "not one of"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tool_choice": "required", "tools": [W], "response_format": {"type": "json_object"}}, "send no other"),
])
def test_forced_tool_choices_refused_naming_why(url, body, message):
    r = post(url, "/v1/chat/completions", {"model": BASE, "messages": USER, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
    assert message in r.json()["error"]["message"]


def test_without_the_parser_auto_is_refused_and_none_renders_no_tools(plain_url):
    r = post(plain_url, "/v1/chat/completions", {"model": BASE, "messages": USER, "tools": [WEATHER]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    assert "--enable-auto-tool-choice" in r.json()["error"]["message"]
    r = post(plain_url, "/v1/chat/completions", {"model": BASE, "messages": USER, "tools": [WEATHER],
                                                 "tool_choice": "none", "max_tokens": 2})
    assert r.status_code == 200, r.text
    no_tools = post(plain_url, "/v1/chat/completions", {"model": BASE, "messages": USER, "max_tokens": 2})
    assert r.json()["usage"]["prompt_tokens"] == no_tools.json()["usage"]["prompt_tokens"]


def test_a_call_in_a_user_message_is_refused(url):
    r = post(url, "/v1/chat/completions", {"model": BASE, "messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]})
    assert r.status_code == 400 and "assistant" in r.json()["error"]["message"]
    r = post(url, "/v1/chat/completions", {"model": BASE, "messages": [*USER, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]})
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]


def test_a_parser_whose_tags_are_special_tokens_decodes_them(model_dir):
    """deepseek_v3's tags are special tokens in DeepSeek's tokenizer: with tools, the reply is decoded with
    skip_special_tokens off (here: the test tokenizer's <|im_start|>, forced by logit_bias)."""
    body = {"model": BASE, "messages": USER, "tools": [WEATHER], "max_tokens": 3, "temperature": 0,
            "logit_bias": {"257": 100}}
    with serving(cpu_app(model_dir, tool_call_parser="deepseek_v3")) as ds:
        kept = post(ds, "/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    with serving(cpu_app(model_dir, tool_call_parser="hermes")) as hermes:
        skipped = post(hermes, "/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    assert (kept, skipped) == ("<|im_start|>" * 3, "")


def test_llm_chat_renders_tools_as_the_server_does(model_dir, url):
    from moelora import LLM, SamplingParams

    llm = LLM(model_dir, device="cpu", dtype="float32")
    out = llm.chat(USER, SamplingParams(max_tokens=1, temperature=0), tools=[WEATHER])[0]
    assert out.prompt_token_ids == post(url, "/tokenize", {"model": BASE, "messages": USER, "tools": [WEATHER]}).json()[
        "tokens"]
    assert json.dumps(WEATHER, ensure_ascii=False) in out.prompt


def test_the_openai_stream_helper_accumulates_the_calls(url, scripted_replies):
    """The SDK's `chat.completions.stream` (its ChatCompletionStreamState checks each tool_calls delta and merges
    them by index) ends with the same message as the whole response."""
    scripted_replies += ["Let me look.\n" + CALL_A + "\n" + CALL_B]
    with make_client(url).chat.completions.stream(model=BASE, messages=USER, tools=[WEATHER], max_tokens=40,
                                                  temperature=0, extra_body={"ignore_eos": True}) as stream:
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [A, B]
