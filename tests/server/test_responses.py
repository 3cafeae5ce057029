"""POST /v1/responses (OpenAI's Responses API) through the `openai` client: text, instructions and a conversation
of items in, reasoning / message / function_call items out, whole and streamed (the SDK's `responses.stream`
helper accumulates the events into the same response); usage; max_output_tokens cutting it short; refusals."""

from __future__ import annotations

import json

import pytest

from tests.helpers.server import BASE, make_client, post, thinking_server

openai = pytest.importorskip("openai")

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
            "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
            "{% if m.tool_calls %}{% for c in m.tool_calls %}<call>{{ c.function.name }}</call>{% endfor %}{% endif %}"
            "{{ m['content'] or '' }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 2}}</tool_call>'
ADD = {"type": "function", "name": "add", "description": "a + b",
       "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    with thinking_server(tmp_path_factory.mktemp("server_responses"), TEMPLATE) as u:
        yield u


def create(url, **kw):
    return make_client(url).responses.create(model=BASE, **{"max_output_tokens": 40, "temperature": 0, **kw})


def test_text_in_reasoning_and_message_out(url, scripted_replies):
    scripted_replies += ["<think>\nAdd them.\n</think>\n\nIt is 4."]
    r = create(url, input="2 + 2?", instructions="Be brief.")  # the tiny model runs to max_output_tokens
    assert r.object == "response" and r.model == BASE
    assert r.status == "incomplete" and r.usage.output_tokens == 40
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "Add them." and r.output_text == "It is 4."
    assert r.instructions == "Be brief." and r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_function_calls_out_and_their_outputs_back_in(url, scripted_replies):
    scripted_replies += [CALL, "It is 4."]
    first = create(url, input=[{"role": "user", "content": [{"type": "input_text", "text": "2 + 2?"}]}], tools=[ADD])
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "add" and json.loads(call.arguments) == {"a": 2, "b": 2} and call.call_id
    second = create(url, tools=[ADD], input=[
        {"role": "user", "content": "2 + 2?"},
        {"type": "function_call", "call_id": call.call_id, "name": "add", "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "4"}])
    assert second.output_text == "It is 4."


def test_a_stream_accumulates_to_the_whole_response(url, scripted_replies):
    reply = "<think>\nAdd them.\n</think>\n\nIt is 4. " + CALL
    scripted_replies += [reply, reply]
    whole = create(url, input="2 + 2?", tools=[ADD])
    with make_client(url).responses.stream(model=BASE, input="2 + 2?", tools=[ADD], max_output_tokens=40,
                                           temperature=0) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds and "response.reasoning_text.delta" in kinds
    assert "response.function_call_arguments.done" in kinds
    shape = [(i.type, getattr(i, "name", None)) for i in whole.output]
    assert [(i.type, getattr(i, "name", None)) for i in final.output] == shape == [
        ("reasoning", None), ("message", None), ("function_call", "add")]
    assert final.output_text == whole.output_text == "It is 4."
    assert final.usage.output_tokens == whole.usage.output_tokens > 0


def test_a_reply_that_stops_is_completed():
    from moelora.server.responses import ResponsesRequest, response_of

    chat = {"model": BASE, "choices": [{"message": {"role": "assistant", "content": "4"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
    r = response_of(ResponsesRequest(input="2 + 2?"), chat)
    assert (r["status"], r["incomplete_details"], r["output"][0]["content"][0]["text"]) == ("completed", None, "4")
    assert r["usage"]["input_tokens"] == 3 and r["usage"]["output_tokens"] == 2


def test_max_output_tokens_makes_it_incomplete(url, scripted_replies):
    scripted_replies += ["It is"]
    r = create(url, input="2 + 2?", max_output_tokens=1)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 1


REFUSED = [({"previous_response_id": "resp_1"}, "previous_response_id"), ({"background": True}, "background"),
           ({"text": {"format": "json"}}, "text"),
           ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
           ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input")]


@pytest.mark.parametrize("extra,param", REFUSED)
def test_what_is_not_served_is_refused(url, extra, param):
    r = post(url, "/v1/responses", {"model": BASE, "input": "hi", **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.json()
