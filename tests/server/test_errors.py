"""The server's refusals, each with OpenAI's error body and the right status, and the server still
serving right after: bad input, broken adapters, unloading a busy adapter, overload; and `moelora serve`.

Builds its model, adapters and server with test_server.py's helpers (one uvicorn per module).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from moelora.engine.config import EngineConfig
from tests.helpers.server import (
    ADAPTERS,
    BASE,
    PROMPTS,
    TIMEOUT,
    complete,
    make_assets,
    make_client,
    openai,
    post,
    running_server,
    serving,
    wait_idle,
)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_assets(tmp_path_factory.mktemp("server_errors"))


@pytest.fixture(scope="module")
def server(assets):
    model_dir, adapters = assets
    with running_server(model_dir, {n: adapters[n] for n in ADAPTERS}) as (url, app):
        yield url, app


@pytest.fixture(scope="module")
def client(server):
    return make_client(server[0])


def test_unload_with_requests_in_flight_is_refused(server, client):
    url, app = server
    stream = complete(client, "alpha", PROMPTS[5], max_tokens=200, stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))  # the request is running
    r = post(url, "/v1/unload_lora_adapter", {"lora_name": "alpha"})
    assert r.status_code == 409 and "in flight" in r.json()["error"]["message"]
    stream.close()
    wait_idle(app)
    assert "alpha" in [m.id for m in client.models.list().data]
    assert complete(client, "alpha", PROMPTS[5]).choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("extra", [{}, {"echo": True, "logprobs": 1, "max_tokens": 0}, {"prompt_logprobs": 1}],
                         ids=["generate", "score", "prompt_logprobs"])
def test_an_adapter_unloaded_after_the_request_named_it_is_a_404(extra, server, monkeypatch):
    """The model field resolves against the published adapter list; an adapter unloaded between that and the
    engine thread's turn is `model` 404 (vLLM's unknown model) on the generation and the scoring paths alike."""
    url, app = server
    monkeypatch.setattr(app.state.serving, "resolve_model", lambda name: name)  # listed when it arrived
    r = post(url, "/v1/completions", {"model": "ghost", "prompt": "hi", "max_tokens": 2, **extra})
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert "`ghost` does not exist" in err["message"] and "not loaded" in err["message"] and err["param"] == "model"
    monkeypatch.undo()
    assert post(url, "/v1/completions", {"model": "alpha", "prompt": "hi", "max_tokens": 2}).status_code == 200


def _edit_adapter(src: Path, dst: Path, tensors=None, remove=None) -> Path:
    shutil.copytree(src, dst)
    if remove:
        (dst / remove).unlink()
    if tensors:
        sd = load_file(str(dst / "adapter_model.safetensors"))
        tensors(sd)
        save_file(sd, str(dst / "adapter_model.safetensors"))
    return dst


def _first_key(sd, part="q_proj.lora_A"):
    return next(k for k in sorted(sd) if part in k)


def _wrong_shape(sd):
    key = _first_key(sd)
    sd[key] = torch.randn(sd[key].shape[0], sd[key].shape[1] + 3)


def _nan(sd):
    key = _first_key(sd, "lora_B")
    sd[key] = sd[key].clone()
    sd[key][0, 0] = float("nan")


BROKEN = {
    "missing_weights": (dict(remove="adapter_model.safetensors"), "no adapter_model.safetensors"),
    "missing_config": (dict(remove="adapter_config.json"), "no adapter_config.json"),
    "wrong_shape": (dict(tensors=_wrong_shape), "q_proj.lora_A.weight"),
    "nan": (dict(tensors=_nan), "NaN"),
}


@pytest.mark.parametrize("case", [*BROKEN, "not_a_directory"])
def test_broken_adapter_is_refused_and_nothing_else_changes(case, server, client, assets, tmp_path):
    url, _ = server
    before = complete(client, "beta", PROMPTS[6]).choices[0].text
    if case == "not_a_directory":
        path, needle = tmp_path / "nowhere", "not a directory"
    else:
        edit, needle = BROKEN[case]
        path = _edit_adapter(assets[1]["delta"], tmp_path / case, **edit)
    r = post(url, "/v1/load_lora_adapter", {"lora_name": "broken", "lora_path": str(path)})
    err = r.json()["error"]
    assert r.status_code == 400 and needle in err["message"] and err["type"] == "BadRequestError", err
    assert [m.id for m in client.models.list().data] == [BASE, *ADAPTERS]
    assert complete(client, "beta", PROMPTS[6]).choices[0].text == before


# ------------------------------------------------------------------------------------ bad input

LONG = "x" * 300  # byte-level: 300 tokens > max_model_len 256
BAD = {
    "unknown_model": ({"model": "nope", "prompt": "hi"}, 404, "does not exist", "model"),
    "missing_prompt": ({"model": BASE}, 400, "'prompt' is required", "prompt"),  # model is optional (the base)
    "wrong_type": ({"model": BASE, "prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens", "max_tokens"),
    "bool_for_int": ({"model": BASE, "prompt": "hi", "n": True}, 400, "'n'", "n"),
    "prompt_type": ({"model": BASE, "prompt": 5}, 400, "'prompt'", "prompt"),
    "negative_max_tokens": ({"model": BASE, "prompt": "hi", "max_tokens": -3}, 400, "greater than", "max_tokens"),
    "temperature": ({"model": BASE, "prompt": "hi", "temperature": -1}, 400, "temperature", "temperature"),
    "top_p": ({"model": BASE, "prompt": "hi", "top_p": 0}, 400, "top_p", "top_p"),
    "top_k": ({"model": BASE, "prompt": "hi", "top_k": -5}, 400, "top_k", "top_k"),
    "too_long_prompt": ({"model": BASE, "prompt": LONG}, 400, "maximum context length", "prompt"),
    "too_long_total": ({"model": BASE, "prompt": "hi", "max_tokens": 255}, 400, "maximum context length",
                       "max_tokens"),
    "empty_prompt": ({"model": BASE, "prompt": ""}, 400, "empty", "prompt"),
    "token_outside_vocab": ({"model": BASE, "prompt": [1, 99999]}, 400, "outside the vocabulary", "prompt"),
    "token_outside_vocab_echo": ({"model": BASE, "prompt": [1, 99999], "echo": True, "logprobs": 1}, 400,
                                 "outside the vocabulary", "prompt"),
    "unknown_field": ({"model": BASE, "prompt": "hi", "frobnicate": 1}, 400, "unknown field 'frobnicate'",
                      "frobnicate"),
    "unimplemented": ({"model": BASE, "prompt": "hi", "best_of": 3}, 400, "not implemented", "best_of"),
    "logit_bias_range": ({"model": BASE, "prompt": "hi", "logit_bias": {"5": 101}}, 400, "less than",
                         "logit_bias"),
    "logit_bias_key": ({"model": BASE, "prompt": "hi", "logit_bias": {"five": 1}}, 400, "logit_bias", None),
    "presence_penalty_range": ({"model": BASE, "prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty",
                               "presence_penalty"),
    "repetition_penalty_zero": ({"model": BASE, "prompt": "hi", "repetition_penalty": 0}, 400,
                                "repetition_penalty", "repetition_penalty"),
    "unimplemented_suffix": ({"model": BASE, "prompt": "hi", "suffix": "x"}, 400, "not implemented", "suffix"),
    "max_tokens_zero_without_echo": ({"model": BASE, "prompt": "hi", "max_tokens": 0}, 400, "echo", "max_tokens"),
    "stream_options_without_stream": ({"model": BASE, "prompt": "hi", "stream_options": {"include_usage": True}},
                                      400, "stream", "stream_options"),
}
BAD_CHAT = {
    "chat_unknown_adapter": ({"model": "nope", "messages": [{"role": "user", "content": "hi"}]}, 404,
                             "does not exist", "model"),
    "chat_messages_type": ({"model": BASE, "messages": "hi"}, 400, "messages", "messages"),
    "chat_role": ({"model": BASE, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "role",
                  "messages.0.role"),
    "chat_tool_without_function": ({"model": BASE, "messages": [{"role": "user", "content": "hi"}],
                                    "tools": [{"type": "function"}]}, 400, "function", "tools.0.function"),
    "chat_tools_auto_without_parser": ({"model": BASE, "messages": [{"role": "user", "content": "hi"}],
                                        "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
                                       "--enable-auto-tool-choice", "tool_choice"),
    "chat_too_long": ({"model": BASE, "messages": [{"role": "user", "content": LONG}]}, 400,
                      "maximum context length", "messages"),
    "chat_top_logprobs_alone": ({"model": BASE, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
                                400, "logprobs", "top_logprobs"),
}


@pytest.mark.parametrize("case", [*BAD, *BAD_CHAT, "malformed_json", "body_not_object", "unknown_route"])
def test_bad_input_gets_status_and_message_then_server_still_works(case, server, client):
    url, _ = server
    if case in BAD or case in BAD_CHAT:
        body, status, needle, param = {**BAD, **BAD_CHAT}[case]
        path = "/v1/completions" if case in BAD else "/v1/chat/completions"
        r = post(url, path, body)
    elif case == "unknown_route":
        r, status, needle, param = httpx.get(url + "/v1/nothing", timeout=TIMEOUT), 404, "Not Found", None
    else:
        content = b'{"model": "tiny-base", "prompt": ' if case == "malformed_json" else b'["a"]'
        r = httpx.post(url + "/v1/completions", content=content, headers={"content-type": "application/json"},
                       timeout=TIMEOUT)
        status, needle, param = 400, "JSON" if case == "malformed_json" else "body", None
    err = r.json()["error"]
    assert r.status_code == status and err["code"] == status, (r.status_code, err)
    assert needle in err["message"] and err["param"] == param, err
    assert set(err) == {"message", "type", "param", "code"}
    assert complete(client, BASE, PROMPTS[7], max_tokens=2).choices[0].finish_reason in ("stop", "length")


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.NotFoundError) as e:
        complete(client, "nope", "hi")
    assert e.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as e:
        complete(client, BASE, "hi", max_tokens=-1)
    assert e.value.body["param"] == "max_tokens"


# ------------------------------------------------------------------------------------- overload


def test_overload_answers_503_with_retry_after(assets):
    model_dir, adapters = assets
    with running_server(model_dir, {"alpha": adapters["alpha"]}, max_waiting=1, max_num_seqs=1) as (url, app):
        client = make_client(url)
        long = dict(max_tokens=200, stream=True, extra_body={"ignore_eos": True})
        first = complete(client, BASE, PROMPTS[0], **long)
        next(iter(first))  # running: the one sequence slot is taken
        second = complete(client, "alpha", PROMPTS[1], **long)  # admitted, waits
        with pytest.raises(openai.InternalServerError) as e:
            complete(client, BASE, PROMPTS[2])
        assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "1"
        assert "waiting" in e.value.body["message"]
        first.close()
        assert next(iter(second)).choices  # the waiting one runs once the first is gone
        second.close()
        wait_idle(app)
        assert complete(client, BASE, PROMPTS[2]).choices[0].finish_reason in ("stop", "length")


# --------------------------------------------------------------------------- lora_target_modules


def test_lora_target_modules_refuse_adapters_outside_and_serve_those_inside(assets, tmp_path):
    """Through build_engine (the memory plan path): adapters with router LoRA are refused when
    loaded; one without is served and changes the output."""
    from tests.helpers import oracle_lora as ol
    from tests.helpers.oracle import tiny_hf_model

    model_dir, adapters = assets
    hf = tiny_hf_model("qwen3_moe", seed=11, vocab_size=260, max_position_embeddings=256, bos_token_id=256,
                       eos_token_id=258, pad_token_id=259)  # the served model (test_server.write_model)
    no_router = ol.write_per_expert(ol.per_expert_lora(hf, seed=7, r=4, std=0.3, router=False), tmp_path / "nr")
    targets = ("self_attn", "experts", "gate_proj", "up_proj", "down_proj")  # all but the router ("gate")
    with running_server(model_dir, {}, lora_target_modules=targets) as (url, app):
        engine = app.state.engine.engine
        assert not engine.model.model.layers[0].mlp.gate.has_lora
        r = post(url, "/v1/load_lora_adapter", {"lora_name": "delta", "lora_path": str(adapters["delta"])})
        assert r.status_code == 400 and "mlp.gate" in r.text and "lora_target_modules" in r.text, r.text
        r = post(url, "/v1/load_lora_adapter", {"lora_name": "nr", "lora_path": str(no_router)})
        assert r.status_code == 200, r.text
        client = make_client(url)
        outs = {m: complete(client, m, PROMPTS[0]).choices[0].text for m in (BASE, "nr")}
        assert outs[BASE] != outs["nr"]


def test_lora_target_modules_auto_keeps_the_start_adapters_sites(assets, tmp_path):
    """'auto' (SGLang's default): the sites of the adapters given at start, site by site (layer 1 only
    here: layer 0 keeps no LoRA at all); an adapter with LoRA elsewhere is refused later."""
    from moelora.errors import ConfigError
    from moelora.server.launch import build_server
    from tests.helpers import oracle_lora as ol
    from tests.helpers.oracle import tiny_hf_model

    model_dir, adapters = assets
    hf = tiny_hf_model("qwen3_moe", seed=11, vocab_size=260, max_position_embeddings=256, bos_token_id=256,
                       eos_token_id=258, pad_token_id=259)
    one_layer = ol.write_per_expert(ol.per_expert_lora(hf, seed=8, r=4, std=0.3, layers_to_transform=[1]),
                                    tmp_path / "l1")
    with running_server(model_dir, {"l1": one_layer}, lora_target_modules=("auto",)) as (url, app):
        layers = app.state.engine.engine.model.model.layers
        assert not any(m.has_lora for m in layers[0].modules() if hasattr(m, "has_lora"))
        assert layers[1].self_attn.o_proj.has_lora
        assert any(getattr(m, "has_lora", False) for m in layers[1].mlp.modules())
        r = post(url, "/v1/load_lora_adapter", {"lora_name": "delta", "lora_path": str(adapters["delta"])})
        assert r.status_code == 400 and "lora_target_modules" in r.text, r.text
        client = make_client(url)
        assert complete(client, "l1", PROMPTS[0]).choices[0].text != complete(client, BASE, PROMPTS[0]).choices[0].text
    with pytest.raises(ConfigError, match="auto"):
        build_server(model_dir, {}, EngineConfig(device="cpu", lora_target_modules=("auto",)))
    from moelora.llm import LLM

    llm = LLM(model_dir, {"l1": one_layer}, device="cpu", max_lora_rank=8, max_loras=2, num_kv_blocks=64,
              lora_target_modules="auto")  # the offline API resolves it the same way
    assert not llm.engine.model.model.layers[0].self_attn.o_proj.has_lora
    assert llm.engine.model.model.layers[1].self_attn.o_proj.has_lora


# -------------------------------------------------------------------------------------------- CLI


def test_cli_serve_builds_the_configured_server(assets, monkeypatch):
    from moelora import cli
    from moelora.server import launch

    model_dir, adapters = assets
    seen = {}
    monkeypatch.setattr(launch, "run_server",
                        lambda app, host, port, level, **kw: seen.update(app=app, host=host, port=port, **kw))
    spec = json.dumps({"name": "beta", "path": str(adapters["beta"])})
    # vLLM's serve flags a command line carries over: CORS, uvicorn's access log and root path, and the accepted
    # no-ops (--trust-remote-code, --enable-chunked-prefill, --kv-cache-dtype auto, --swap-space, --download-dir)
    rc = cli.main(["serve", str(model_dir), "--lora", f"alpha={adapters['alpha']}", "--lora-modules",
                   f"gamma={adapters['gamma']}", spec, "--served-model-name", "base-a", "base-b",
                   "--device", "cpu", "--max-loras", "2", "--max-lora-rank", "8", "--max-model-len", "64",
                   "--max-num-seqs", "4", "--enforce-eager", "--port", "0", "--trust-remote-code",
                   "--enable-chunked-prefill", "--kv-cache-dtype", "auto", "--disable-uvicorn-access-log",
                   "--root-path", "/llm", "--allowed-origins", '["http://a.example"]', "--allow-credentials",
                   "--swap-space", "4", "--download-dir", "/tmp"])
    assert rc == 0 and seen["host"] == "127.0.0.1" and seen["port"] == 0
    assert seen["access_log"] is False and seen["root_path"] == "/llm"
    serving = seen["app"].state.serving
    assert serving.cfg.allowed_origins == ("http://a.example",) and serving.cfg.allow_credentials
    assert serving.cfg.served_model_names == ("base-a", "base-b")
    assert [n for n, _ in seen["app"].state.engine.stats.adapters] == ["alpha", "gamma", "beta"]
    cfg = seen["app"].state.engine.engine.cfg
    assert (cfg.max_model_len, cfg.max_num_seqs, cfg.max_loras, cfg.enforce_eager) == (64, 4, 2, True)


def test_lora_modules_parsing():
    from moelora.errors import ConfigError
    from moelora.server.launch import parse_lora_modules

    assert parse_lora_modules(["a=/x", '{"name": "b", "path": "/y", "base_model_name": "m"}']) == {"a": "/x", "b": "/y"}
    for bad in (["a"], ['{"name": "b"}'], ["{oops"], ["a=/x", "a=/y"], ['{"name": "b", "path": "/y", "z": 1}']):
        with pytest.raises(ConfigError):
            parse_lora_modules(bad)


def test_serve_without_model_serves_the_bundled_demo(monkeypatch):
    """`moelora serve` alone: the demo model and its adapters, each computing its task."""
    from moelora import cli, demo
    from moelora.demo import tasks
    from moelora.server import launch

    if not (demo.model_dir() / "model.safetensors").is_file():
        pytest.skip("the bundled demo model is not built yet")
    seen = {}
    monkeypatch.setattr(launch, "run_server", lambda app, host, port, level, **kw: seen.update(app=app))
    assert cli.main(["serve", "--device", "cpu", "--port", "0"]) == 0
    with serving(seen["app"]) as url:
        client = make_client(url)
        names = [m.id for m in client.models.list().data]
        assert names == ["moelora-demo", *demo.ADAPTER_NAMES]
        inputs = tasks.heldout_inputs(4, seed=7)
        for model, task in zip(names, ("copy", *demo.ADAPTER_NAMES), strict=True):
            right = sum(client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": text}], temperature=0, max_tokens=64,
            ).choices[0].message.content == tasks.transform(task, text) for text in inputs)
            assert right >= 3, (model, right)

