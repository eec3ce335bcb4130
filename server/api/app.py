"""The FastAPI app in front of one LLMEngine: routes, API-key check and the request log.

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with SSE streaming), GET /v1/models,
POST /tokenize, POST /detokenize, POST /v1/load_lora_adapter, POST /v1/unload_lora_adapter (lora_adapters.py),
GET /version, GET /health, GET|POST /ping (= /health), GET /metrics;
GET /debug/kv_blocks with --enable-debug-endpoints (debug.py);
vLLM's POST /invocations, GET /load and GET /tokenizer_info (with --enable-tokenizer-info-endpoint):
vllm_endpoints.py.
"""
from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from .api_key import APIKeyMiddleware
from .chat import create_chat_completion
from .chat_batch import BatchChatCompletionRequest, create_chat_batch
from .completions import create_completion
from .drain_cutoff import DrainCutoffMiddleware
from .errors import APIError, install_error_handlers
from .kv_events import stream_kv_events
from .lora_adapters import (LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest, adapter_cards, load_lora_adapter,
                            unload_lora_adapter)
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .openapi import install_openapi, request_body
from .protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from .serving import OpenAIServing, ServerConfig
from .tokenize import DetokenizeRequest, TokenizeRequest, detokenize, tokenize
from .vllm_endpoints import install_vllm_endpoints

if TYPE_CHECKING:
    from pagedmodel.server.engine.engine_client import EngineClient

logger = logging.getLogger("pagedmodel.server.api")


class RequestLogMiddleware:
    """One INFO line per request once its response body is complete (streams included)."""

    def __init__(self, app: Callable[..., Awaitable[None]]):
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = [0]
        logged = [False]

        def log(note: str = "") -> None:
            logged[0] = True
            info = scope.get("state", {}).get("log_info", "")
            client = scope.get("client") or ("-", 0)
            logger.info("%s %s %s %d %.1fms %s%s", client[0], scope["method"], scope["path"], status[0],
                        (time.perf_counter() - start) * 1000, info, note)

        async def logging_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                log()
        try:
            await self.app(scope, receive, logging_send)
        finally:
            if not logged[0]:   # the body never completed: the client went away mid-stream
                log(" (client disconnected)")


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("pagedmodel")
    except PackageNotFoundError:   # running from a source tree that was never installed
        return "unknown"


def build_app(engine: EngineClient, config: ServerConfig) -> FastAPI:
    """The FastAPI app serving `engine`; the engine loop thread runs for the app's lifespan."""
    serving = OpenAIServing(engine, config)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        serving.async_engine.start()
        try:
            yield
        finally:
            serving.close()

    # --root-path on the app, not uvicorn: paths with the proxy's prefix and without it both route, as in vLLM
    app = FastAPI(title="pagedmodel", lifespan=lifespan, docs_url=None, redoc_url=None, root_path=config.root_path,
                  openapi_url="/openapi.json")
    app.state.serving = serving
    install_error_handlers(app)
    app.add_middleware(DrainCutoffMiddleware, is_draining=lambda: serving.draining)
    if config.api_key is not None:   # every path but --auth-exempt (api_key.py); inside the request log
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key, exempt=config.auth_exempt)
    if config.log_requests:
        app.add_middleware(RequestLogMiddleware)

    # The API key is decided in one place, APIKeyMiddleware (every path but --auth-exempt); routes only serve.
    def bound(handler: Callable[[OpenAIServing, Request], Awaitable[Response]]) -> Callable[..., Awaitable[Response]]:
        async def route(request: Request) -> Response:
            return await handler(serving, request)
        return route

    # The POST routes that use the model.
    # Each names its body model for the OpenAPI document only (openapi.py); parsing stays in serving.py.
    routes = (("/v1/completions", create_completion, CompletionRequest),
              ("/v1/chat/completions", create_chat_completion, ChatCompletionRequest),
              ("/v1/chat/completions/batch", create_chat_batch, BatchChatCompletionRequest),
              ("/tokenize", tokenize, TokenizeRequest), ("/detokenize", detokenize, DetokenizeRequest),
              ("/v1/load_lora_adapter", load_lora_adapter, LoadLoRAAdapterRequest),
              ("/v1/unload_lora_adapter", unload_lora_adapter, UnloadLoRAAdapterRequest))
    for path, handler, body in routes:
        app.post(path, openapi_extra=request_body(body))(bound(handler))
    install_openapi(app, [body for _, _, body in routes])
    # The prefix-cache change stream a router subscribes to (kv_events.py).
    app.get("/v1/kv_events")(bound(stream_kv_events))

    # vLLM's /invocations, /load, /tokenizer_info; its X-Request-Id middleware is added last, so outermost
    install_vllm_endpoints(app, config, bound)

    @app.get("/v1/models")
    async def models() -> Response:
        card = ModelCard(id=serving.model_name, root=config.model_root or serving.model_name,
                         max_model_len=serving.max_model_len)
        cards = [card, *adapter_cards(serving)]   # LoRA adapters, each with parent = the base model
        return Response(ModelList(data=cards).model_dump_json(), media_type="application/json")

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": _package_version()})

    # /ping is SageMaker's and vLLM's name for the health check; the same answer.
    @app.api_route("/ping", methods=["GET", "POST"])
    @app.get("/health")
    async def health() -> Response:
        if not serving.async_engine.is_healthy:
            raise APIError(503, f"engine is not running: {serving.async_engine.dead_reason}", code="engine_dead")
        if serving.draining:
            raise APIError(503, "server is shutting down", code="shutting_down")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(serving.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    if config.enable_debug_endpoints:
        @app.get("/debug/kv_blocks")
        async def debug_kv_blocks() -> Response:
            return JSONResponse(await serving.async_engine.call(lambda engine: engine.kv_blocks_report()))

    return app
