"""On CUDA (decode graphs, overlapped scheduling): the demo served by a real uvicorn; 48 streams dropped by
their clients after three chunks while other requests run, then the engine holds no KV block (issue 27:
`kv_cache_blocks_used` stayed at 1 after such a run on the H200)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from moelora.demo import ADAPTER_NAMES, adapter_dir, model_dir
from moelora.engine.config import EngineConfig
from moelora.server.launch import build_server
from tests.helpers.server import serving, wait_idle

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
MODELS = ["moelora-demo", *ADAPTER_NAMES]


def chat(model: str, i: int, **kw) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": f"request {i}: spell cat"}], **kw}


async def dropped_stream(http: httpx.AsyncClient, url: str, body: dict) -> int:
    """Read three chunks of a long stream, then close the connection."""
    chunks = 0
    async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            chunks += line.startswith("data: ")
            if chunks == 3:
                break
    return chunks


async def load(url: str) -> tuple[list[int], list[int]]:
    async with httpx.AsyncClient(timeout=120) as http:
        whole = [http.post(url + "/v1/chat/completions", json=chat(MODELS[i % len(MODELS)], i, max_tokens=64))
                 for i in range(32)]
        streams = [dropped_stream(http, url, chat(MODELS[i % len(MODELS)], 100 + i, max_tokens=400, stream=True,
                                                  ignore_eos=True)) for i in range(48)]
        done = await asyncio.gather(*whole, *streams)
    return [r.status_code for r in done[:32]], done[32:]


def test_streams_dropped_mid_decode_leave_no_block_in_use():
    cfg = EngineConfig(device="cuda", max_num_seqs=64, enable_prefix_caching=False)
    app = build_server(model_dir(), {n: str(adapter_dir(n)) for n in ADAPTER_NAMES}, cfg, ["moelora-demo"])
    eng = app.state.engine.engine
    assert eng.graphs is not None and eng.cfg.async_scheduling
    with serving(app) as url:
        warmed = app.state.engine.warmup  # the full GPU warm-up ran, and left no block in use
        assert warmed is not None and "error" not in warmed and warmed["forwards"] > 50, warmed
        assert app.state.engine.stats.kv_used == 0
        for _ in range(2):
            statuses, chunks = asyncio.run(load(url))
            assert statuses == [200] * 32 and chunks == [3] * 48
            stats = wait_idle(app, timeout=60)
            assert stats.kv_used == 0 and stats.running == stats.waiting == 0
            assert eng.cache.allocator.num_free == eng.cache.allocator.num_blocks
        assert httpx.get(url + "/metrics").status_code == 200
