"""vLLM's serve flags, end to end through `moelora serve` (uvicorn swapped for test_server's in-thread
server): --load-format dummy on a directory with only config.json, --tokenizer, --chat-template (file and
inline), --generation-config, --enable-log-requests, and the periodic stats line."""

from __future__ import annotations

import json
import logging

import pytest

from moelora.server.async_engine import EngineStats
from moelora.server.stats_log import stats_line
from tests.helpers.oracle import tiny_hf_config
from tests.helpers.server import CHAT_TEMPLATE, byte_tokenizer, make_client, post, serving


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """A model directory with config.json only, and a tokenizer directory beside it."""
    root = tmp_path_factory.mktemp("flags")
    tiny_hf_config("qwen3_moe", vocab_size=260, max_position_embeddings=256, eos_token_id=258).save_pretrained(
        str(root / "model"))
    tok = root / "tok"
    tok.mkdir()
    byte_tokenizer().save(str(tok / "tokenizer.json"))
    (tok / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    (tok / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return root


def serve(monkeypatch, *argv):
    """`moelora serve ARGV` up to the app it would run."""
    from moelora import cli
    from moelora.server import launch

    seen = {}
    monkeypatch.setattr(launch, "run_server", lambda app, host, port, level, **kw: seen.update(app=app))
    assert cli.main(["serve", *argv, "--device", "cpu", "--max-model-len", "128", "--max-loras", "1",
                     "--max-lora-rank", "4", "--served-model-name", "dummy"]) == 0
    return seen["app"]


def chat(client, **kw):
    return client.chat.completions.create(model="dummy", messages=[{"role": "user", "content": "hi"}], **kw)


def test_dummy_weights_tokenizer_and_chat_templates(dirs, monkeypatch, tmp_path):
    model, tok = str(dirs / "model"), str(dirs / "tok")
    app = serve(monkeypatch, model, "--load-format", "dummy", "--tokenizer", tok, "--seed", "1")
    with serving(app) as url:
        out = chat(make_client(url), max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
        # three special tokens around "user\nhi" "\n" "assistant\n", one byte a token
        assert out.usage.completion_tokens == 5 and out.usage.prompt_tokens == 3 + len("user\nhi\nassistant\n")
        ids = post(url, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()["tokens"]
        assert ids[0] == 257 and ids[-1] == ord("\n")  # <|im_start|> ... assistant\n: the tokenizer dir's template
    inline = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    template_file = tmp_path / "t.jinja"
    template_file.write_text("{% for m in messages %}<{{ m['content'] }}>{% endfor %}")
    for template, text in ((inline, "[hi]"), (str(template_file), "<hi>")):
        app = serve(monkeypatch, model, "--load-format", "dummy", "--tokenizer", tok, "--chat-template", template)
        with serving(app) as url:
            ids = post(url, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()["tokens"]
            assert ids == list(text.encode())


def test_generation_config_defaults_unset_fields(dirs, monkeypatch, tmp_path):
    model, tok = str(dirs / "model"), str(dirs / "tok")
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 3,
                                                                 "eos_token_id": 258}))
    for flag, greedy_and_3 in (("vllm", False), (str(tmp_path), True)):
        app = serve(monkeypatch, model, "--load-format", "dummy", "--tokenizer", tok, "--generation-config", flag)
        with serving(app) as url:
            client = make_client(url)
            outs = [chat(client, seed=s, extra_body={"ignore_eos": True}) for s in (1, 2)]
            lengths = {o.usage.completion_tokens for o in outs}
            if greedy_and_3:
                assert lengths == {3} and outs[0].choices[0].message.content == outs[1].choices[0].message.content
                assert chat(client, max_tokens=6, extra_body={"ignore_eos": True}).usage.completion_tokens == 6
            else:  # vLLM's own defaults: room to max_model_len, temperature 1
                assert min(lengths) > 3


def test_seed_makes_unseeded_sampling_reproducible(dirs, monkeypatch):
    def sampled(seed: str) -> str:
        app = serve(monkeypatch, str(dirs / "model"), "--load-format", "dummy", "--tokenizer", str(dirs / "tok"),
                    "--seed", seed)
        with serving(app) as url:  # near-uniform logits (dummy weights): 12 draws over 260 tokens
            return chat(make_client(url), max_tokens=12, temperature=1, extra_body={"ignore_eos": True}).choices[0]\
                .message.content

    first = sampled("5")
    assert sampled("5") == first and sampled("6") != first


def test_enable_log_requests_logs_each_request(dirs, monkeypatch, caplog):
    app = serve(monkeypatch, str(dirs / "model"), "--load-format", "dummy", "--tokenizer", str(dirs / "tok"),
                "--enable-log-requests")
    with caplog.at_level(logging.INFO, logger="moelora.server"), serving(app) as url:
        chat(make_client(url), max_tokens=2)
    assert any("/v1/chat/completions" in r.message and '"max_tokens":2' in r.message for r in caplog.records)


def test_stats_line():
    busy = EngineStats(running=3, waiting=1, kv_used=25, kv_total=100)
    line = stats_line((0.0, 0, 0, 0, 0), (10.0, 500, 200, 80, 20), busy)
    assert line == ("Avg prompt throughput: 50.0 tokens/s, Avg generation throughput: 20.0 tokens/s, Running: 3 reqs, "
                    "Waiting: 1 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 25.0%")
    assert stats_line((0.0, 5, 5, 0, 0), (10.0, 5, 5, 0, 0), EngineStats()) is None  # idle: silent
