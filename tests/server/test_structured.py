"""Structured outputs through the real server and the `openai` client: chat's response_format (json_schema, the SDK's
`parse` with a pydantic model, json_object), vLLM's structured_outputs and guided_* fields on chat and completions,
the Responses API's text.format, a stream joined; refusals naming the field. Outputs checked with Python's json / re.
The tiny byte-level model samples (seeded): a constrained output ends by EOS once its format is complete."""

from __future__ import annotations

import json
import re
from typing import Literal

import pytest

from tests.helpers.server import BASE, cpu_app, httpx, make_client, post, serving, thinking_server, write_model

openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "pet": {"enum": ["cat", "dog"]}},
          "required": ["n", "pet"], "additionalProperties": False}
USER = [{"role": "user", "content": "a pet and a number, as JSON"}]
SAMPLED = dict(temperature=1.0, seed=3, max_tokens=200, n=4)


class Pet(pydantic.BaseModel):
    n: int
    pet: Literal["cat", "dog"]


def pet_ok(text: str) -> bool:
    obj = json.loads(text)
    return set(obj) == {"n", "pet"} and type(obj["n"]) is int and obj["pet"] in ("cat", "dog")


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    model_dir, _ = write_model(tmp_path_factory.mktemp("server_structured"))
    with serving(cpu_app(model_dir)) as u:
        yield u


@pytest.fixture(scope="module")
def client(url):
    return make_client(url)


def finished(choices) -> list:
    done = [c for c in choices if c.finish_reason == "stop"]
    assert len(done) >= 2, [(c.finish_reason, getattr(c, "text", None) or c.message.content) for c in choices]
    return done


def test_chat_response_format_json_schema(client):
    r = client.chat.completions.create(model=BASE, messages=USER, **SAMPLED, response_format={
        "type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}})
    for c in finished(r.choices):
        assert pet_ok(c.message.content), c.message.content


def test_the_sdks_parse_with_a_pydantic_model(client):
    r = client.chat.completions.parse(model=BASE, messages=USER, response_format=Pet, temperature=1.0, seed=5,
                                      max_tokens=200)
    parsed = r.choices[0].message.parsed  # the SDK sends Pet's strict JSON schema and validates the reply with it
    assert isinstance(parsed, Pet) and r.choices[0].finish_reason == "stop"


def test_chat_json_object_mode(client):
    r = client.chat.completions.create(model=BASE, messages=USER, **SAMPLED, response_format={"type": "json_object"})
    for c in finished(r.choices):
        assert isinstance(json.loads(c.message.content), dict), c.message.content


@pytest.mark.parametrize("extra,check", [
    ({"guided_choice": ["red", "green", "blue (dark)"]}, lambda t: t in ("red", "green", "blue (dark)")),
    ({"guided_regex": r"[0-9]{2}:[0-9]{2}"}, lambda t: re.fullmatch(r"[0-9]{2}:[0-9]{2}", t)),
    ({"structured_outputs": {"regex": r"(yes|no)!"}}, lambda t: t in ("yes!", "no!")),
    ({"structured_outputs": {"json": SCHEMA}}, pet_ok),
    ({"guided_json": json.dumps(SCHEMA), "guided_decoding_backend": "xgrammar"}, pet_ok),
    ({"guided_grammar": 'root ::= "id-" [a-f]+ "."'}, lambda t: re.fullmatch(r"id-[a-f]+\.", t)),
], ids=["guided_choice", "guided_regex", "structured_outputs regex", "structured_outputs json",
        "guided_json text", "guided_grammar"])
def test_vllm_fields_on_completions_and_chat(client, extra, check):
    comp = client.completions.create(model=BASE, prompt="answer:", extra_body=extra, **SAMPLED)
    for c in finished(comp.choices):
        assert check(c.text), c.text
    chat = client.chat.completions.create(model=BASE, messages=USER, extra_body=extra, **SAMPLED)
    for c in finished(chat.choices):
        assert check(c.message.content), c.message.content


def test_a_stream_joins_to_a_valid_output(client):
    stream = client.chat.completions.create(model=BASE, messages=USER, temperature=1.0, seed=3, max_tokens=200,
                                            stream=True, extra_body={"guided_json": SCHEMA})
    parts, reason = [], None
    for chunk in stream:
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            reason = c.finish_reason or reason
    assert reason == "stop" and pet_ok("".join(parts)), "".join(parts)


def test_responses_text_format_json_schema(client):
    r = client.responses.create(model=BASE, input="a pet", temperature=1.0, max_output_tokens=200, text={
        "format": {"type": "json_schema", "name": "pet", "schema": SCHEMA, "strict": True}})
    assert r.status == "completed" and pet_ok(r.output_text), r.output_text
    assert r.text.format.type == "json_schema"


@pytest.mark.parametrize("body,param,message", [
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "more than one"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"guided_regex": "a(("}, None, "invalid regex"),
    ({"guided_choice": []}, None, "non-empty list"),
    ({"guided_json": "{not json"}, None, "not valid JSON"),
])
def test_bad_structured_outputs_are_refused(url, body, param, message):
    r = post(url, "/v1/chat/completions", {"model": BASE, "messages": USER, "max_tokens": 4, **body})
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    if param:
        assert r.json()["error"]["param"] == param


TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not "
            "enable_thinking %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}")


def test_with_a_reasoning_parser_the_answer_is_held(tmp_path):
    """vLLM's rule: the reasoning is free, the answer after `</think>` held. Thinking off (the prompt closed it): held
    from the first token, the content valid. Thinking on: this byte-level vocabulary has no `</think>` token to
    start after, so refused."""
    with thinking_server(tmp_path, TEMPLATE) as u:
        body = {"model": BASE, "messages": USER, "max_tokens": 150, "temperature": 1.0, "seed": 3, "n": 4,
                "response_format": {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}}
        r = post(u, "/v1/chat/completions", {**body, "chat_template_kwargs": {"enable_thinking": False}})
        assert r.status_code == 200, r.text
        done = [c for c in r.json()["choices"] if c["finish_reason"] == "stop"]
        assert len(done) >= 2 and all(pet_ok(c["message"]["content"]) for c in done), r.text
        assert all(c["message"].get("reasoning_content") is None for c in done)
        r = post(u, "/v1/chat/completions", body)
        assert r.status_code == 400 and "'</think>' to be one token" in r.json()["error"]["message"], r.text


PET_TOOL = {"type": "function", "function": {"name": "pick", "parameters": {
    "type": "object", "properties": {"pet": {"enum": ["cat", "dog"]}}, "required": ["pet"],
    "additionalProperties": False}}}
NUM_TOOL = {"type": "function", "function": {"name": "num", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}}}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "num"}}],
                         ids=["required", "named"])
def test_forced_tool_choices_hold_the_model_to_the_tools(client, choice):
    """No tool parser on this server: the sampled reply is held to the calls' schema (forced_tools.py) and every
    finished choice's calls are the offered tools with valid arguments."""
    r = client.chat.completions.create(model=BASE, messages=USER, tools=[PET_TOOL, NUM_TOOL], tool_choice=choice,
                                       **{**SAMPLED, "max_tokens": 120})
    done = [c for c in r.choices if c.message.tool_calls]
    assert len(done) >= 2, [(c.finish_reason, c.message.content) for c in r.choices]
    for c in done:
        assert c.message.content is None
        for call in c.message.tool_calls:
            args = json.loads(call.function.arguments)
            assert call.function.arguments == json.dumps(args)  # one space after "," and ":", no other whitespace
            if call.function.name == "pick":
                assert args in ({"pet": "cat"}, {"pet": "dog"}), args
            else:
                assert call.function.name == "num" and set(args) == {"n"} and type(args["n"]) is int, args
        if choice != "required":
            assert [t.function.name for t in c.message.tool_calls] == ["num"] and c.finish_reason == "stop"


def test_formats_compile_off_the_engine_thread(client, monkeypatch):
    """A new format is compiled in a worker thread before the engine adds the request (the engine thread finds it
    compiled): a large schema never holds the steps of the requests already running."""
    import threading

    from moelora.engine.structured import Grammars

    threads, compile_ = [], Grammars._compile

    def spy(self, so):
        threads.append(threading.current_thread().name)
        return compile_(self, so)

    monkeypatch.setattr(Grammars, "_compile", spy)
    r = client.completions.create(model=BASE, prompt="x", max_tokens=8, temperature=0,
                                  extra_body={"guided_regex": "[q-z]{3}"})
    assert threads and "moelora-engine" not in threads, threads
    assert re.fullmatch("[q-z]{3}", r.choices[0].text) and r.choices[0].finish_reason == "stop"  # 3 + EOS


def test_enable_in_reasoning_holds_the_whole_output(tmp_path):
    """vLLM's --structured-outputs-config enable_in_reasoning: the format holds from the first token even with a
    reasoning parser (no `</think>` needed), so the thinking prompt's output is all format (parsed as reasoning:
    the prompt opened <think>)."""
    from tests.helpers.server import write_model

    out, _ = write_model(tmp_path)
    (out / "chat_template.jinja").write_text(TEMPLATE)
    with serving(cpu_app(out, reasoning_parser="qwen3", structured_in_reasoning=True)) as u:
        r = post(u, "/v1/chat/completions", {"model": BASE, "messages": USER, "max_tokens": 20, "temperature": 1.0,
                                             "seed": 1, "n": 3, "guided_choice": ["yes", "no"]})
    assert r.status_code == 200, r.text
    texts = [c["message"].get("reasoning_content") or c["message"]["content"] for c in r.json()["choices"]]
    assert all(t in ("yes", "no") for t in texts), texts


def test_structured_outputs_are_ready_with_the_server(tmp_path):
    """The structured-output compiler (the vocabulary read into xgrammar: seconds at 150k tokens) is built beside the
    warm-up, so the first request with a format finds it; without a tokenizer nothing is built."""
    model, _ = write_model(tmp_path)
    app = cpu_app(model)
    engine = app.state.engine.engine
    assert engine._grammar_set is None  # not at construction: with the engine thread
    with serving(app) as url:  # /health answers 200 only once the thread reports ready
        assert engine._grammar_set is not None
        r = httpx.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 3,
                                                      "structured_outputs": {"choice": ["xy", "z"]}}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("xy", "z")
