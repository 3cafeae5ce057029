"""Build a ready server (engine, adapters, app) and run it with uvicorn; `moelora serve` calls these."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from fastapi import FastAPI

from moelora.engine.config import EngineConfig
from moelora.errors import ConfigError
from moelora.server.async_engine import AsyncEngine
from moelora.server.serving import ServerConfig


def parse_lora_modules(items: Iterable[str] | None) -> dict[str, str]:
    """vLLM's --lora-modules entries: `name=path` or JSON {"name": ..., "path": ...}."""
    out: dict[str, str] = {}
    for item in items or ():
        if item.lstrip().startswith("{"):
            try:
                spec = json.loads(item)
            except json.JSONDecodeError as e:
                raise ConfigError(f"--lora-modules: {item!r} is not valid JSON: {e}") from None
            unknown = set(spec) - {"name", "path", "base_model_name"}
            if not isinstance(spec.get("name"), str) or not isinstance(spec.get("path"), str) or unknown:
                raise ConfigError(f"--lora-modules: {item!r} needs string 'name' and 'path'"
                                  + (f" (unknown keys {sorted(unknown)})" if unknown else ""))
            name, path = spec["name"], spec["path"]
        else:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise ConfigError(f"--lora-modules expects name=path or JSON, got {item!r}")
        if name in out:
            raise ConfigError(f"adapter name {name!r} is given twice")
        out[name] = path
    return out


def build_server(model: str | Path, adapters: dict[str, str], engine_cfg: EngineConfig,
                 served_model_names: Iterable[str] = (), max_waiting_requests: int = 1024,
                 progress: bool = False) -> FastAPI:
    """Load the model and every adapter (any failure raises before serving), then the app."""
    from moelora.engine.loader import build_engine, resolve_auto_targets
    from moelora.server.app import build_app

    names = tuple(served_model_names) or (str(model),)
    clash = set(names) & set(adapters)
    if clash:
        raise ConfigError(f"adapter names {sorted(clash)} clash with the served model name")
    # the adapters are registered before the decode graphs are captured: captured once, their sites on
    engine = build_engine(model, resolve_auto_targets(model, adapters, engine_cfg), progress=progress,
                          adapters=adapters)
    async_engine = AsyncEngine(engine, {n: str(p) for n, p in adapters.items()}, max_waiting_requests)
    return build_app(async_engine, ServerConfig(names, str(model), max_waiting_requests))


def run_server(app: FastAPI, host: str, port: int, log_level: str = "info") -> None:
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
