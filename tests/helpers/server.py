"""The OpenAI server in tests: a tiny Qwen3-MoE with a byte-level tokenizer and chat template, per-expert
adapters, a real uvicorn on a free loopback port in a thread, the `openai` client, and polling helpers."""

from __future__ import annotations

import json
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

# the server's packages first: a GPU image without them skips every module that imports this one
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")
text_string_to_metric_families = pytest.importorskip("prometheus_client.parser").text_string_to_metric_families

from moelora.engine.config import EngineConfig  # noqa: E402
from moelora.server.launch import build_server  # noqa: E402
from tests.helpers import oracle_lora as ol  # noqa: E402
from tests.helpers.oracle import tiny_hf_model  # noqa: E402

SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>")  # ids 256..259
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


BASE = "tiny-base"
ADAPTERS = ("alpha", "beta", "gamma")


GREEDY = dict(temperature=0, max_tokens=12)
TIMEOUT = 60.0


def byte_tokenizer():
    """Byte-level BPE without merges (token id == byte), then the four special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from moelora.engine.tiktoken_vocab import byte_chars

    tok = Tokenizer(models.BPE(vocab={c: b for b, c in enumerate(byte_chars())}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL))
    return tok


def write_model(root: Path) -> tuple[Path, object]:
    hf = tiny_hf_model("qwen3_moe", seed=11, vocab_size=260, max_position_embeddings=256, bos_token_id=256,
                       eos_token_id=258, pad_token_id=259)
    out = root / "model"
    hf.save_pretrained(str(out))
    byte_tokenizer().save(str(out / "tokenizer.json"))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "bos_token": None}))
    return out, hf


def byte_engine(root: Path, async_scheduling: bool = True, device: str = "cpu"):
    """The tiny byte-level model (`write_model`) in an fp32 engine with overlapped scheduling on (engine tests of
    what the tokenizer decides: structured outputs, bad words)."""
    from moelora.engine.loader import build_engine

    model_dir, _ = write_model(root)
    return build_engine(model_dir, EngineConfig(device=device, dtype="float32", max_loras=1, max_lora_rank=8,
                                                max_num_seqs=16, block_size=4, num_kv_blocks=1024,
                                                async_scheduling=async_scheduling))


def make_assets(root: Path) -> tuple[Path, dict[str, Path]]:
    """The model directory and four adapters (ADAPTERS served from the start, "delta" to load later)."""
    model_dir, hf = write_model(root)
    adapters = {}
    for i, name in enumerate((*ADAPTERS, "delta")):
        raw = ol.per_expert_lora(hf, seed=100 + i, r=4, std=0.3)
        adapters[name] = ol.write_per_expert(raw, root / "adapters" / name)
    return model_dir, adapters


def free_port() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@contextmanager
def running_server(model_dir, adapters, max_waiting=1024, server_kw=None, **engine_kw):
    """The test model with `adapters`, served (runtime adapter loading on, unless `server_kw` says otherwise);
    yields (base_url, app)."""
    kw = dict(device="cpu", dtype="float32", max_loras=2, max_cpu_loras=2, max_lora_rank=8, max_num_seqs=64,
              block_size=4, num_kv_blocks=2048)
    cfg = EngineConfig(**{**kw, **engine_kw})
    app = build_server(model_dir, {n: str(p) for n, p in adapters.items()}, cfg, [BASE], max_waiting,
                       **{"allow_runtime_lora_updating": True, **(server_kw or {})})
    with serving(app) as url:
        yield url, app


def cpu_app(model_dir, **server_kw):
    """The test model in an fp32 CPU engine (one adapter slot), served with `ServerConfig(**server_kw)`."""
    from moelora.engine.loader import build_engine
    from moelora.server.app import build_app
    from moelora.server.async_engine import AsyncEngine
    from moelora.server.serving import ServerConfig

    cfg = EngineConfig(device="cpu", dtype="float32", max_loras=1, max_lora_rank=8, max_num_seqs=16, block_size=4,
                       num_kv_blocks=512)
    return build_app(AsyncEngine(build_engine(model_dir, cfg)), ServerConfig((BASE,), str(model_dir), **server_kw))


@contextmanager
def serving(app, root_path: str = ""):
    """uvicorn in a thread on a kernel-chosen loopback port, started and stopped within bounded waits (`root_path`:
    uvicorn's, as behind a proxy that strips that prefix: the app sees it in front of every path)."""
    sock = free_port()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=2,
                                           root_path=root_path))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    host, port = sock.getsockname()
    url = f"http://{host}:{port}"
    while httpx.get(url + "/health", timeout=TIMEOUT).status_code != 200:  # 503 while the engine warms up
        assert time.monotonic() < deadline + 600, "server not ready (warm-up: cold Triton compiles on a GPU)"
        time.sleep(0.05)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()
        assert not thread.is_alive(), "server did not stop"


def make_client(url: str):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)


def wait_idle(app, timeout=15.0):
    """Poll until the engine holds no request and no KV block (bounded)."""
    engine = app.state.engine
    deadline = time.monotonic() + timeout
    while True:
        s = engine.stats
        if s.waiting == s.running == s.kv_used == 0 and not s.in_flight and engine.queue_length() == 0:
            return s
        assert time.monotonic() < deadline, f"engine not idle after {timeout}s: {s}"
        time.sleep(0.02)


def metrics(url) -> dict:
    """{(sample name, frozenset(labels)): value} of every sample on /metrics."""
    text = httpx.get(url + "/metrics", timeout=TIMEOUT).text
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def metric(m: dict, name: str, **labels) -> float:
    return sum(v for (n, ls), v in m.items() if n == name and set(labels.items()) <= ls)


PROMPTS = ["the cat sat on", "hello world", "abc xyz", "moe lora!", "serve me", "tokens out", "q", "12345"]


def complete(client, model, prompt, **kw):
    return client.completions.create(model=model, prompt=prompt, **{**GREEDY, **kw})


def streamed_text(stream) -> tuple[dict[int, str], dict[int, str], object]:
    """(text by choice, finish_reason by choice, usage) of a streamed completion or chat."""
    texts, reasons, usage = {}, {}, None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            piece = c.text if hasattr(c, "text") else (c.delta.content or "")
            texts[c.index] = texts.get(c.index, "") + piece
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    return texts, reasons, usage


def post(url, path, body, **kw):
    return httpx.post(url + path, json=body, timeout=TIMEOUT, **kw)


@contextmanager
def thinking_server(root: Path, template: str):
    """The tiny model's server under `template`, reasoning (qwen3) and hermes tool calls parsed: its URL."""
    out, _ = write_model(root)
    (out / "chat_template.jinja").write_text(template)
    with serving(cpu_app(out, reasoning_parser="qwen3", tool_call_parser="hermes")) as u:
        yield u
