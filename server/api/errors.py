"""OpenAI-style error bodies, and the exception handlers that make sure every rejection uses them.

Every non-2xx reply of the HTTP API is ``{"error": {"message", "type", "param", "code"}}`` with the
status a client library maps to its exception class (400 BadRequestError, 401 AuthenticationError,
404 NotFoundError, 503 with ``Retry-After``...). No handler lets a traceback reach a client: anything
unexpected becomes a generic 500 body and the details go to the server log only. `APIError` and the
body itself live in server/http_common/errors.py, shared with the router.
"""
from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

# The shape itself is shared with the router (which loads no FastAPI); the API's modules import it from here.
from pagedmodel.server.http_common.errors import UNSERVED_HEADER, APIError, error_body  # noqa: F401

logger = logging.getLogger("pagedmodel.server.api")


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
