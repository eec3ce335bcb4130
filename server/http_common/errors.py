"""The OpenAI error shape both servers answer with: ``{"error": {"message", "type", "param", "code"}}``.

The status is the one a client library maps to its exception class (400 BadRequestError, 401
AuthenticationError, 404 NotFoundError, 503 with ``Retry-After``...). Framework-free: the engine's
FastAPI handlers (server/api/errors.py) and the router's aiohttp responses both render `APIError.body()`.
"""
from __future__ import annotations

import asyncio
import json
from http import HTTPStatus
from typing import Any

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
    """A request a server refuses; handlers raise it and the app turns it into the JSON body."""

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


def write_raw_error(transport: asyncio.Transport, error: APIError) -> None:
    """Write `error` as a complete JSON response on a connection the app never saw, then close it.

    Written as raw bytes: the HTTP parser refuses to send a response while no request head was parsed
    (408) or after it rejected one (400/431), and nothing more will be read from this connection anyway.
    """
    body = json.dumps(error.body()).encode()
    head = [f"HTTP/1.1 {error.status} {HTTPStatus(error.status).phrase}", "content-type: application/json",
            f"content-length: {len(body)}", "connection: close", *(f"{k}: {v}" for k, v in error.headers.items())]
    transport.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
    transport.close()
