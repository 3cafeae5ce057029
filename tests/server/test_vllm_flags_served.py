"""vLLM serve flags with a meaning here, through the served app: --default-chat-template-kwargs (a chat's template
variables under the request's own), --enable-server-load-tracking (GET /load), --max-log-len,
--override-generation-config (sampling defaults over generation_config.json's)."""

from __future__ import annotations

import json
import logging

from moelora.server.launch import generation_defaults
from tests.helpers.server import cpu_app, httpx, serving, write_model

TEMPLATE = ("{% for m in messages %}[{{ flavor | default('plain') }}:{{ m['content'] }}]{% endfor %}"
            "{% if add_generation_prompt %}>{% endif %}")


def test_default_chat_template_kwargs_sit_under_the_requests(tmp_path, caplog):
    model, _ = write_model(tmp_path)
    (model / "chat_template.jinja").write_text(TEMPLATE)
    app = cpu_app(model, default_chat_template_kwargs={"flavor": "salty"}, enable_log_requests=True, max_log_len=20)
    msgs = [{"role": "user", "content": "hi"}]

    def text(url, **kw):
        ids = httpx.post(url + "/tokenize", json={"messages": msgs, **kw}, timeout=60).json()["tokens"]
        return httpx.post(url + "/detokenize", json={"tokens": ids}, timeout=60).json()["prompt"]

    with serving(app) as url, caplog.at_level(logging.INFO, logger="moelora.server"):
        assert text(url) == "[salty:hi]>"
        assert text(url, chat_template_kwargs={"flavor": "sweet"}) == "[sweet:hi]>"
        r = httpx.post(url + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 1, "echo": True,
                                                           "chat_template_kwargs": {"other": 1}}, timeout=60)
        assert r.status_code == 200, r.text
        logged = [rec.getMessage() for rec in caplog.records if rec.getMessage().startswith("request ")]
        assert logged and all(len(m.partition(": ")[2]) == 20 for m in logged)


def test_load_counts_generation_requests_in_flight(tmp_path):
    """A stream of 240 tokens (steps slowed to 10 ms: seconds) counts from its first chunk until it ends; the client
    leaving early ends it too."""
    import time

    model, _ = write_model(tmp_path)
    body = {"prompt": "abc", "max_tokens": 240, "stream": True, "ignore_eos": True}

    def load(url):
        return httpx.get(url + "/load", timeout=60).json()["server_load"]

    app = cpu_app(model, enable_server_load_tracking=True)
    engine = app.state.engine.engine
    step = engine.step
    engine.step = lambda: time.sleep(0.01) or step()  # >= 2.4 s of steps: in flight whatever the machine's speed
    with serving(app) as url:
        assert load(url) == 0
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as stream:
            lines = stream.iter_lines()  # kept: a dropped iterator closes the response
            next(lines)  # the first chunk: generating, 200-odd tokens to go
            assert load(url) == 1  # this request counts; a /load request does not
        deadline = time.monotonic() + 30  # closed early: the server aborts it and its response ends
        while load(url) != 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    with serving(cpu_app(model)) as url:  # without the flag the route answers 0, as vLLM's
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as stream:
            lines = stream.iter_lines()
            next(lines)
            assert load(url) == 0


def test_override_generation_config(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.95, "top_k": 20}))
    over = {"temperature": 0.2, "max_new_tokens": 64, "do_sample": True}
    assert dict(generation_defaults(tmp_path, "auto", over)) == dict(temperature=0.2, top_p=0.95, top_k=20,
                                                                      max_tokens=64)
    assert dict(generation_defaults(tmp_path, "vllm", over)) == dict(temperature=0.2, max_tokens=64)
    assert dict(generation_defaults(tmp_path, "auto")) == dict(temperature=0.6, top_p=0.95, top_k=20)

