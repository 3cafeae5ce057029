"""The FastAPI app: OpenAI-compatible routes, adapter management, health and metrics.

Routes (vLLM's names): POST /v1/completions, POST /v1/chat/completions, POST /v1/responses (`responses.py`),
GET /v1/models,
POST /v1/load_lora_adapter {lora_name, lora_path}, POST /v1/unload_lora_adapter {lora_name},
POST /tokenize {prompt | messages}, POST /detokenize {tokens}, GET /tokenizer_info (when
`enable_tokenizer_info_endpoint`), GET /health, GET and POST /ping (as /health), GET /metrics, GET /version,
GET /load {"server_load": generation requests in flight, counted with `enable_server_load_tracking`, else 0}.

Every error has OpenAI's body {"error": {"message", "type", "param", "code"}}: 400 for an invalid
or unimplemented parameter, a malformed body, a prompt that does not fit max_model_len, or an
adapter that fails to load (the server and the other adapters are untouched); 404 for an unknown
model/adapter; 409 for unloading an adapter that has requests in flight (nothing is cancelled:
retry once they finish); 503 with Retry-After when too many requests wait to be scheduled.

Access (`auth.py`): with `api_keys`, every route but /health, /ping, /metrics, /version and /load needs
`Authorization: Bearer KEY` (401 otherwise). The adapter load / unload routes answer 404 unless
`allow_runtime_lora_updating` (vLLM does not register them then); with `lora_roots`, a load may
only read inside those directories (403).

A client that disconnects aborts its request: for streams, Starlette cancels the response
iterator (and a background task aborts whatever is left); for whole responses, `_unless_disconnected`
races the handler against the client's disconnect.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from moelora.errors import MoeLoRAError
from moelora.server.async_engine import AdapterBusy, AsyncEngine, EngineDead, UnknownAdapter
from moelora.server.auth import ApiKeyMiddleware, check_lora_path, route_path
from moelora.server.metrics import ServerMetrics
from moelora.server.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
    error_body,
)
from moelora.server.responses import ResponsesRequest, create_response
from moelora.server.serving import OpenAIServing, Result, ServerConfig
from moelora.server.stats_log import log_stats_while_serving

log = logging.getLogger("moelora.server")


def build_app(engine: AsyncEngine, cfg: ServerConfig) -> FastAPI:
    """An app serving `engine`; its lifespan starts and stops the engine thread."""
    if engine.engine.tokenizer is None:
        raise MoeLoRAError("the server needs a model with a tokenizer (tokenizer.json, or tiktoken.model)")
    ecfg = engine.engine.cfg
    cache_config = dict(block_size=ecfg.block_size, cache_dtype=ecfg.dtype,
                        enable_prefix_caching=ecfg.enable_prefix_caching,
                        gpu_memory_utilization=ecfg.gpu_memory_utilization, num_gpu_blocks=ecfg.num_kv_blocks)
    metrics = ServerMetrics(lambda: engine.stats, cfg.served_model_names[0], ecfg.max_model_len, cache_config,
                            ecfg.max_loras)
    engine.observe(metrics.observer)
    serving = OpenAIServing(engine, cfg, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        logger = asyncio.ensure_future(log_stats_while_serving(lambda: engine.stats, metrics.vllm,
                                                                cfg.log_stats_interval_s))
        try:
            yield
        finally:
            logger.cancel()
            engine.shutdown()

    docs = {"docs_url": None, "redoc_url": None, "openapi_url": None} if cfg.disable_fastapi_docs else {}
    app = FastAPI(title="moelora", lifespan=lifespan, **docs)
    app.state.engine, app.state.metrics, app.state.serving = engine, metrics, serving
    _error_handlers(app, metrics)
    if cfg.api_keys:
        app.add_middleware(ApiKeyMiddleware, api_keys=cfg.api_keys,
                           on_refused=lambda: metrics.errors.labels("401").inc())
    load = _Load()
    if cfg.enable_server_load_tracking:  # a request counts until its response (a stream's last byte) is sent
        app.add_middleware(_LoadTracking, load=load)
    # added last, so outermost: a preflight (OPTIONS, no credentials) is answered before the key check
    app.add_middleware(CORSMiddleware, allow_origins=list(cfg.allowed_origins), allow_methods=list(cfg.allowed_methods),
                       allow_headers=list(cfg.allowed_headers), allow_credentials=cfg.allow_credentials)

    async def respond(request: Request, handler, body) -> Response:
        if cfg.enable_log_requests:
            log.info("request %s: %s", request.url.path, body.model_dump_json(exclude_unset=True)[:cfg.max_log_len])
        if not body.stream:
            result = await _unless_disconnected(request, handler(body))
            return JSONResponse(result.body) if result is not None else Response(status_code=499)
        result: Result = await handler(body)
        return StreamingResponse(result.sse(), media_type="text/event-stream",
                                 background=BackgroundTask(result.stream.abort) if result.stream else None)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await respond(request, serving.completion, body)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await respond(request, serving.chat, body)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request):
        return await respond(request, lambda b: create_response(serving, b), body)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": serving.model_cards()}

    def runtime_lora_updating() -> None:
        if not cfg.allow_runtime_lora_updating:
            raise ApiError(404, "loading and unloading adapters at run time is off; start the server with "
                                "--allow-runtime-lora-updating or VLLM_ALLOW_RUNTIME_LORA_UPDATING=True")

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        runtime_lora_updating()
        path = check_lora_path(body.lora_path, cfg.lora_roots)
        if body.lora_name in cfg.served_model_names:
            raise ApiError(400, f"'{body.lora_name}' is the base model's name", "lora_name")
        try:
            await engine.load_adapter(body.lora_name, path)
        except EngineDead as e:
            raise ApiError(503, str(e)) from None
        except Exception as e:  # the adapter's own error: bad path, files, shapes, values
            log.info("adapter %r from %s refused: %s", body.lora_name, body.lora_path, e)
            raise ApiError(400, f"failed to load adapter '{body.lora_name}': {type(e).__name__}: {e}",
                           "lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        runtime_lora_updating()
        try:
            await engine.unload_adapter(body.lora_name)
        except UnknownAdapter as e:
            raise ApiError(404, str(e), "lora_name") from None
        except AdapterBusy as e:
            raise ApiError(409, str(e), "lora_name") from None
        except EngineDead as e:
            raise ApiError(503, str(e)) from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        return serving.tokens.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return serving.tokens.detokenize(body)

    if cfg.enable_tokenizer_info_endpoint:
        @app.get("/tokenizer_info")
        async def tokenizer_info():
            return serving.tokens.tokenizer_info()

    @app.get("/health")
    async def health():
        if not engine.alive:
            raise ApiError(503, "the engine thread is not running")
        if not engine.ready:  # not an error to count in the metrics: probes poll this while the server starts
            return JSONResponse(error_body(503, "warming up (running every kernel shape once); retry shortly"),
                                status_code=503, headers={"Retry-After": "1"})
        return Response(status_code=200)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():  # vLLM's (SageMaker's) liveness route: the same answer as /health
        return await health()

    @app.get("/metrics")
    async def metrics_route():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/load")
    async def server_load():  # vLLM's route: the generation requests in flight (0 without the tracking flag)
        return {"server_load": load.value}

    @app.get("/version")
    async def version():
        from moelora import __version__

        return {"version": __version__}

    return app


class _Load:
    value = 0


LOAD_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses"})


class _LoadTracking:
    """ASGI middleware: `load.value` counts the requests to LOAD_PATHS whose responses are not fully sent."""

    def __init__(self, app, load: _Load):
        self.app, self.load = app, load

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or route_path(scope) not in LOAD_PATHS:
            return await self.app(scope, receive, send)
        self.load.value += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.load.value -= 1


async def _unless_disconnected(request: Request, work):
    """Run `work`; if the client disconnects first, cancel it (its cleanup aborts the request)."""
    task = asyncio.ensure_future(work)

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            # a cancelled task is done only once its cancellation has run (its cleanup aborts the request): until
            # then `task.cancelled()` is False and `task.result()` raises InvalidStateError (a 500 a disconnect)
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        return None
    return task.result()


def _error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    def reply(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
        metrics.errors.labels(str(status)).inc()
        return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return reply(exc.status, exc.message, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        return reply(400, *validation_message(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return reply(exc.status_code, str(exc.detail), None, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception):
        log.exception("internal error")
        return reply(500, f"internal error: {type(exc).__name__}: {exc}")


def _field_path(loc) -> str:
    """A pydantic error location as a field path, without union-member tags ('str', 'list[int]')."""
    parts = []
    for part in loc:
        if part == "body" and not parts:
            continue
        if isinstance(part, str) and (part in ("str", "int", "float", "bool") or not part.isidentifier()
                                      or part[:1].isupper()):
            continue
        parts.append(str(part))
    return ".".join(parts)


def validation_message(errors) -> tuple[str, str | None]:
    """(message, param) for the first pydantic error; unknown fields and malformed JSON named as such."""
    if not errors:
        return "invalid request body", None
    err = errors[0]
    path = _field_path(err.get("loc", ()))
    kind = err.get("type", "")
    if kind == "json_invalid":
        return f"malformed JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}", None
    if kind == "extra_forbidden":
        return f"unknown field '{path}' (not part of this API, or not implemented)", path
    if kind == "missing":
        return f"'{path}' is required", path
    if not path:
        return f"invalid request body: {err.get('msg')}", None
    return f"invalid value for '{path}': {err.get('msg')}", path
