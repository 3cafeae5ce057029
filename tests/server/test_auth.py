"""Access control of the server: API keys (401 in OpenAI's error shape; probes and scrapers stay open),
runtime adapter loading off unless asked for, and --lora-root confining the paths a load may read."""

from __future__ import annotations

import shutil

import httpx
import pytest

from tests.helpers.server import (
    ADAPTERS,
    BASE,
    TIMEOUT,
    cpu_app,
    make_assets,
    make_client,
    openai,
    post,
    running_server,
    serving,
    wait_idle,
    write_model,
)

KEYS = ("first-key", "second-key")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("server_auth")
    return root, *make_assets(root)


@pytest.fixture(scope="module")
def server(assets):
    root, model_dir, adapters = assets
    opts = dict(api_keys=KEYS, allow_runtime_lora_updating=True, lora_roots=(str(root / "adapters"),))
    with running_server(model_dir, {n: adapters[n] for n in ADAPTERS}, server_kw=opts) as (url, app):
        yield url, app


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_every_route_but_the_probes_needs_a_key(server):
    url, _ = server
    calls = [("GET", "/v1/models", None), ("POST", "/v1/completions", {"model": BASE, "prompt": "hi"}),
             ("POST", "/v1/chat/completions", {"model": BASE, "messages": [{"role": "user", "content": "hi"}]}),
             ("POST", "/tokenize", {"prompt": "hi"}), ("POST", "/detokenize", {"tokens": [104]}),
             ("POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/tmp"}),
             ("POST", "/v1/unload_lora_adapter", {"lora_name": "alpha"}), ("GET", "/openapi.json", None)]
    bad_headers = [{}, auth("wrong"), auth(KEYS[0][:-1]), auth(KEYS[0] + "x"), {"Authorization": f"Basic {KEYS[0]}"},
                   {"Authorization": KEYS[0]}]
    with httpx.Client(base_url=url, timeout=TIMEOUT) as http:
        for method, path, body in calls:
            for headers in bad_headers:
                r = http.request(method, path, json=body, headers=headers)
                assert r.status_code == 401, (path, headers, r.text)
                assert r.headers["www-authenticate"] == "Bearer"
                err = r.json()["error"]
                assert err["code"] == 401 and err["type"] == "AuthenticationError" and "API key" in err["message"]
        for path in ("/health", "/metrics", "/version", "/load"):  # probes, scrapers, load balancers
            assert http.get(path).status_code == 200, path
        assert http.get("/ping").status_code != 401  # open (served by the request-fields branch)
        for key in KEYS:
            assert http.get("/v1/models", headers=auth(key)).status_code == 200
            assert http.post("/tokenize", json={"prompt": "hi"}, headers=auth(key)).json()["count"] == 2
            assert http.get("/v1/models", headers={"Authorization": f"bearer {key}"}).status_code == 200
        errors = [s for line in http.get("/metrics").text.splitlines() if line.startswith(
            'moelora:request_errors_total{status="401"}') for s in line.split()[-1:]]
        assert errors and float(errors[0]) >= len(calls) * len(bad_headers)


def test_cors_preflight_is_answered_before_the_key_check(server):
    """vLLM's CORS defaults (every origin, method and header; no credentials): a browser's preflight, which carries
    no credentials, gets its Access-Control headers, while the request itself still needs the key."""
    url, _ = server
    origin = {"Origin": "http://dashboard.example"}
    with httpx.Client(base_url=url, timeout=TIMEOUT) as http:
        r = http.options("/v1/completions", headers={**origin, "Access-Control-Request-Method": "POST",
                                                     "Access-Control-Request-Headers": "authorization,content-type"})
        assert r.status_code == 200, r.text
        assert r.headers["access-control-allow-origin"] == "*"
        assert "POST" in r.headers["access-control-allow-methods"]
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        r = http.get("/v1/models", headers=origin)
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "*"
        assert http.get("/v1/models", headers={**origin, **auth(KEYS[0])}).status_code == 200


def test_the_openai_client_with_and_without_the_key(server):
    url, _ = server
    with pytest.raises(openai.AuthenticationError):
        make_client(url).models.list()  # its api_key "unused"
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEYS[1], max_retries=0, timeout=TIMEOUT)
    out = client.completions.create(model="alpha", prompt="hello", max_tokens=4, temperature=0)
    assert out.usage.completion_tokens >= 1


def test_streams_pass_the_key_check_and_a_dropped_one_still_aborts(server):
    url, app = server
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEYS[0], max_retries=0, timeout=TIMEOUT)
    chunks = list(client.completions.create(model="beta", prompt="stream me", max_tokens=6, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert sum(len(c.choices[0].text) > 0 for c in chunks if c.choices) >= 1
    body = {"model": BASE, "prompt": "long", "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=TIMEOUT) as http, http.stream("POST", url + "/v1/completions", json=body,
                                                            headers=auth(KEYS[1])) as r:
        assert r.status_code == 200
        lines = (line for line in r.iter_lines() if line.startswith("data: "))
        next(lines), next(lines), next(lines)  # (the stats are published just after a step's tokens go out)
        assert app.state.engine.stats.kv_used > 0
    wait_idle(app)  # the disconnect reached the handler through the middleware: aborted, blocks freed


def test_lora_root_confines_runtime_loads(server, assets, tmp_path):
    url, _ = server
    root, _, adapters = assets
    key = auth(KEYS[0])
    outside = shutil.copytree(adapters["delta"], tmp_path / "outside")
    (root / "adapters" / "link").symlink_to(outside, target_is_directory=True)
    mixed = root / "adapters" / "mixed"  # a directory inside whose weights file points outside
    mixed.mkdir()
    for f in adapters["delta"].iterdir():
        (mixed / f.name).symlink_to(outside / f.name) if f.suffix == ".safetensors" else shutil.copy(f, mixed)
    for path in (outside, root / "adapters" / "link", root / "adapters" / ".." / ".." / outside.name, mixed,
                 "/etc"):
        r = post(url, "/v1/load_lora_adapter", {"lora_name": "evil", "lora_path": str(path)}, headers=key)
        assert r.status_code == 403, (path, r.text)
        err = r.json()["error"]
        assert err["param"] == "lora_path" and "--lora-root" in err["message"]
    inside = root / "adapters" / "sub" / ".." / "delta"
    r = post(url, "/v1/load_lora_adapter", {"lora_name": "delta", "lora_path": str(inside)}, headers=key)
    assert r.status_code == 200, r.text
    # vLLM's unload schema has lora_int_id beside lora_name (clients send both): accepted, the name decides
    r = post(url, "/v1/unload_lora_adapter", {"lora_name": "delta", "lora_int_id": 7}, headers=key)
    assert r.status_code == 200, r.text


def test_runtime_lora_updating_is_off_by_default(assets):
    _, model_dir, adapters = assets
    with running_server(model_dir, {"alpha": adapters["alpha"]}, server_kw={"allow_runtime_lora_updating": False}) \
            as (url, _):
        for path, body in (("/v1/load_lora_adapter", {"lora_name": "delta", "lora_path": str(adapters["delta"])}),
                           ("/v1/unload_lora_adapter", {"lora_name": "alpha"})):
            r = post(url, path, body)
            assert r.status_code == 404, r.text
            msg = r.json()["error"]["message"]
            assert "--allow-runtime-lora-updating" in msg and "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in msg
        assert [m.id for m in make_client(url).models.list().data] == [BASE, "alpha"]  # nothing changed


def test_behind_a_root_path_the_probes_stay_open_and_load_counts(tmp_path):
    """uvicorn's --root-path puts the prefix in front of every path the app sees (/api/health): the key check and
    the load counter match the route's path, as the router does."""
    import time

    model, _ = write_model(tmp_path)
    app = cpu_app(model, api_keys=KEYS, enable_server_load_tracking=True)
    engine = app.state.engine.engine
    step = engine.step
    engine.step = lambda: time.sleep(0.01) or step()  # a 240-token stream lasts seconds
    body = {"prompt": "abc", "max_tokens": 240, "stream": True, "ignore_eos": True}
    with serving(app, root_path="/api") as url, httpx.Client(base_url=url, timeout=TIMEOUT) as http:
        for path in ("/health", "/ping", "/version", "/metrics", "/load"):
            assert http.get(path).status_code == 200, path
        assert http.get("/v1/models").status_code == 401
        assert http.get("/v1/models", headers=auth(KEYS[1])).json()["data"][0]["id"] == BASE
        with http.stream("POST", "/v1/completions", json=body, headers=auth(KEYS[0])) as stream:
            lines = stream.iter_lines()
            next(lines)
            assert http.get("/load").json()["server_load"] == 1
