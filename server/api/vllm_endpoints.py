"""vLLM's extra endpoints and response headers: /invocations (SageMaker), /tokenizer_info, /load, and the
X-Request-Id header of --enable-request-id-headers."""
from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from .api_key import route_path
from .chat import create_chat_completion
from .completions import create_completion
from .errors import APIError
from .protocol import ChatCompletionRequest, CompletionRequest
from .serving import OpenAIServing, ServerConfig

ASGIApp = Callable[..., Awaitable[None]]
Handler = Callable[[OpenAIServing, Request], Awaitable[Response]]
REQUEST_ID_HEADER = b"x-request-id"
# The routes whose requests occupy the engine; /load counts these (vLLM counts its model endpoints).
LOAD_TRACKED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/invocations"})


class RequestIdHeaderMiddleware:
    """Every response carries X-Request-Id: the client's own when it sent one (so a caller can correlate
    its logs with ours), else the id the endpoint gave the request, else a fresh one."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = next((v for k, v in scope["headers"] if k == REQUEST_ID_HEADER), None)

        async def send_with_id(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = with_request_id(list(message.get("headers", [])), sent)
            await send(message)
        await self.app(scope, receive, send_with_id)


def with_request_id(headers: list[tuple[bytes, bytes]], sent: bytes | None) -> list[tuple[bytes, bytes]]:
    """The response headers with exactly one X-Request-Id (see RequestIdHeaderMiddleware for which)."""
    own = next((v for k, v in headers if k.lower() == REQUEST_ID_HEADER), None)
    value = sent or own or uuid.uuid4().hex.encode()
    return [(k, v) for k, v in headers if k.lower() != REQUEST_ID_HEADER] + [(REQUEST_ID_HEADER, value)]


class ServerLoad:
    """The model requests in progress, from the first byte read to the last byte sent (streams included)."""

    def __init__(self) -> None:
        self.in_progress = 0


class ServerLoadMiddleware:
    """Counts LOAD_TRACKED_PATHS requests into a ServerLoad while they run (--enable-server-load-tracking)."""

    def __init__(self, app: ASGIApp, load: ServerLoad):
        self.app = app
        self.load = load

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http" or route_path(scope) not in LOAD_TRACKED_PATHS:
            await self.app(scope, receive, send)
            return
        self.load.in_progress += 1
        try:
            await self.app(scope, receive, send)
        finally:   # also when the client went away mid-stream
            self.load.in_progress -= 1


def invocation_kind(body: dict[str, Any]) -> str:
    """Which OpenAI endpoint a SageMaker /invocations body is for, by its shape (vLLM tries chat first,
    then completions): "chat" with `messages`, "completions" with `prompt`; anything else is a 400."""
    if "messages" in body:
        return "chat"
    if "prompt" in body:
        return "completions"
    raise APIError(400, "cannot tell which endpoint this /invocations body is for: expected a chat completions "
                        "body (with `messages`) or a completions body (with `prompt`)", code="invalid_request_error")


def tokenizer_info(tokenizer: Any) -> dict[str, Any]:
    """The tokenizer's configuration as vLLM's /tokenizer_info returns it: its init kwargs (those JSON can
    carry), the class name and the chat template."""
    info: dict[str, Any] = {}
    for key, value in getattr(tokenizer, "init_kwargs", {}).items():
        jsonable = _jsonable(value)
        if jsonable is not _SKIP:
            info[key] = jsonable
    info["tokenizer_class"] = type(tokenizer).__name__
    template = getattr(tokenizer, "chat_template", None)
    if template is not None:
        info["chat_template"] = template
    return info


_SKIP = object()


def _jsonable(value: Any) -> Any:
    """A JSON value for an init kwarg: AddedToken objects as their attribute dicts, containers
    recursively; _SKIP for what JSON cannot carry (paths to local files are strings and stay)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        items = [_jsonable(v) for v in value]
        return [v for v in items if v is not _SKIP]
    if isinstance(value, dict):
        pairs = {str(k): _jsonable(v) for k, v in value.items()}
        return {k: v for k, v in pairs.items() if v is not _SKIP}
    if hasattr(value, "__getstate__") and type(value).__name__ == "AddedToken":
        return _jsonable(value.__getstate__())
    return _SKIP


def json_response(payload: dict[str, Any]) -> Response:
    return Response(json.dumps(payload), media_type="application/json")


async def serve_tokenizer_info(serving: OpenAIServing, _: Request) -> Response:
    return json_response(tokenizer_info(serving.engine.tokenizer))


async def invocations(serving: OpenAIServing, request: Request) -> Response:
    """SageMaker's one inference route: the body's shape picks chat or completions, as in vLLM."""
    data = await serving.read_json(request)
    if invocation_kind(data) == "chat":
        return await create_chat_completion(serving, request, serving.validate_body(data, ChatCompletionRequest))
    return await create_completion(serving, request, serving.validate_body(data, CompletionRequest))


def install_vllm_endpoints(app: FastAPI, config: ServerConfig,
                           bound: Callable[[Handler], Callable[..., Awaitable[Response]]]) -> None:
    """/invocations, /load and (by its flag) /tokenizer_info, each bound to the serving state by ``bound`` (the API
    key middleware guards them as any path); and the middlewares of --enable-server-load-tracking and --enable-request-id-headers."""
    load = ServerLoad()
    app.post("/invocations")(bound(invocations))
    if config.enable_tokenizer_info_endpoint:
        app.get("/tokenizer_info")(bound(serve_tokenizer_info))

    async def server_load(_: OpenAIServing, __: Request) -> Response:
        # vLLM serves /load always; the count stays 0 unless --enable-server-load-tracking
        return json_response({"server_load": load.in_progress})
    app.get("/load")(bound(server_load))
    if config.enable_server_load_tracking:
        app.add_middleware(ServerLoadMiddleware, load=load)
    if config.enable_request_id_headers:   # added last, so outermost: the 401s and 503s inside carry it too
        app.add_middleware(RequestIdHeaderMiddleware)
