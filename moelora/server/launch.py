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


# generation_config.json fields that become request defaults (vLLM's --generation-config auto), as
# (their name there, the request field they default)
_GENERATION_DEFAULTS = (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"),
                        ("min_p", "min_p"), ("repetition_penalty", "repetition_penalty"),
                        ("max_new_tokens", "max_tokens"))


def generation_defaults(model: str | Path, generation_config: str = "auto",
                        override: dict | None = None) -> tuple[tuple[str, object], ...]:
    """Default sampling fields from a generation_config.json: `auto` the model's, `vllm` none, or a
    folder holding one; `override` (vLLM's --override-generation-config) over them, in generation_config.json's
    names. Only fields a request can set are taken; absent file: none."""
    data = dict(_generation_config(model, generation_config), **(override or {}))
    return tuple((field, data[key]) for key, field in _GENERATION_DEFAULTS
                 if isinstance(data.get(key), (int, float)) and not isinstance(data.get(key), bool))


def _generation_config(model: str | Path, generation_config: str) -> dict:
    if generation_config == "vllm":
        return {}
    folder = Path(model) if generation_config == "auto" else Path(generation_config)
    if generation_config != "auto" and not folder.is_dir():
        raise ConfigError(f"--generation-config {generation_config!r}: not 'auto', 'vllm' or a directory")
    file = folder / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{file}: {e}") from None
    return data if isinstance(data, dict) else {}


def build_server(model: str | Path, adapters: dict[str, str], engine_cfg: EngineConfig,
                 served_model_names: Iterable[str] = (), max_waiting_requests: int = 1024,
                 progress: bool = False, *, load_format: str = "auto", tokenizer: str | None = None,
                 chat_template: str | None = None, seed: int = 0, generation_config: str = "vllm",
                 override_generation_config: dict | None = None, **server_options) -> FastAPI:
    """Load the model and every adapter (any failure raises before serving), then the app.
    `server_options`: the other `ServerConfig` fields (api_keys, allow_runtime_lora_updating, ...)."""
    from moelora.engine.loader import build_engine, resolve_auto_targets
    from moelora.server.app import build_app

    names = tuple(served_model_names) or (str(model),)
    clash = set(names) & set(adapters)
    if clash:
        raise ConfigError(f"adapter names {sorted(clash)} clash with the served model name")
    defaults = generation_defaults(model, generation_config, override_generation_config)
    # the adapters are registered before the decode graphs are captured: captured once, their sites on
    engine = build_engine(model, resolve_auto_targets(model, adapters, engine_cfg), progress=progress,
                          adapters=adapters, load_format=load_format, tokenizer=tokenizer,
                          chat_template=chat_template, seed=seed)
    async_engine = AsyncEngine(engine, {n: str(p) for n, p in adapters.items()}, max_waiting_requests)
    cfg = ServerConfig(names, str(model), max_waiting_requests, default_sampling=defaults, **server_options)
    return build_app(async_engine, cfg)


def run_server(app: FastAPI, host: str, port: int, log_level: str = "info", *, access_log: bool = True,
               root_path: str = "", ssl_keyfile: str | None = None, ssl_certfile: str | None = None,
               ssl_ca_certs: str | None = None) -> None:
    """uvicorn on host:port; HTTPS with `ssl_certfile` and `ssl_keyfile` (vLLM's --ssl-* flags)."""
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5, access_log=access_log,
                root_path=root_path, ssl_keyfile=ssl_keyfile, ssl_certfile=ssl_certfile, ssl_ca_certs=ssl_ca_certs)
