"""OpenAI-style error bodies, and the exception handlers that make sure every rejection uses them.

Every non-2xx reply of the HTTP API is ``{"error": {"message", "type", "param", "code"}}`` with the
status a client library maps to its exception class (400 BadRequestError, 401 AuthenticationError,
404 NotFoundError, 503 with ``Retry-After``...). No handler lets a traceback reach a client: anything
unexpected becomes a generic 500 body and the details go to the server log only.
"""
from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("pagedmodel.server.api")

# Set on a 503 the engine sends before it has started the request (draining after SIGTERM, engine
# dead), naming the reason: any other replica may take the request, so a router retries it there
# instead of relaying it. A 503 without it is back-pressure from a live engine and is relayed.
UNSERVED_HEADER = "X-PagedModel-Unserved"

# OpenAI's `type` strings per status, as its SDKs and vLLM emit them.
_TYPE_BY_STATUS = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    415: "UnsupportedMediaTypeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """A request the API refuses; handlers raise it and the app turns it into the JSON body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 err_type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = int(status)
        self.message = message
        self.param = param
        self.code = code
        self.err_type = err_type or _TYPE_BY_STATUS.get(self.status) or _type_for(self.status)
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.err_type, self.param, self.code)


def _type_for(status: int) -> str:
    try:
        return HTTPStatus(status).phrase.replace(" ", "").replace("-", "") + "Error"
    except ValueError:   # non-standard codes such as 499
        return "ClientError" if 400 <= status < 500 else "APIError"


def error_body(message: str, err_type: str, param: str | None = None, code: str | int | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def _loc_to_param(loc: tuple[Any, ...] | list[Any]) -> str | None:
    """Pydantic's error location as the dotted name OpenAI puts in `param` (`messages.0.role`)."""
    parts = [str(p) for p in loc if p not in ("body",)]
    # Union members show up as extra location parts like 'str' or 'list[int]'; they name types, not fields.
    parts = [p for p in parts if not any(ch in p for ch in "[]") and p not in ("str", "int", "float", "bool")]
    return ".".join(parts) or None


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """One readable sentence for a pydantic error list, and the param of its first error."""
    if not errors:
        return "invalid request", None
    # A union field reports one error per member type; the deepest one names the member that matched
    # the shape (for `"stop": [1]` that is `stop.0`, not "stop should be a string").
    first = max(errors, key=lambda e: len(_loc_to_param(e.get("loc", ())) or ""))
    param = _loc_to_param(first.get("loc", ()))
    msg = str(first.get("msg", "invalid value"))
    if first.get("type"):   # pydantic's error type, as vLLM's messages carry it (clients match on it)
        msg += f" [type={first['type']}]"
    text = f"{param}: {msg}" if param else msg
    others = {p for p in (_loc_to_param(e.get("loc", ())) for e in errors)
              if p and p != param and not (param or "").startswith(p + ".")}
    if others:
        text += f" (and {len(others)} more invalid field{'s' if len(others) > 1 else ''}: {', '.join(sorted(map(str, others)))})"
    return text, param


def install_error_handlers(app: FastAPI) -> None:
    """Route every error path of FastAPI/Starlette through the OpenAI body format."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's default is 422 with its own shape; OpenAI clients expect 400 + error object.
        message, param = validation_message(list(exc.errors()))
        return error_response(APIError(400, message, param=param, code="invalid_request_error"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) and exc.detail else f"HTTP {exc.status_code}"
        return error_response(APIError(exc.status_code, detail, headers=dict(exc.headers or {})))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # The traceback goes to our log, never to the client.
        logger.exception("unhandled error serving %s %s", request.method, request.url.path)
        return error_response(APIError(500, "internal server error", code="internal_error"))
