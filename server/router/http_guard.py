"""What the router checks before a request costs it more than its head: connections, the API key,
the head's size, and (for POSTs) the body's size, arrival time, JSON and field limits — the engine's
limits and messages (pagedmodel.server.http_common.http_limits), so both servers answer alike.

Every refusal, aiohttp's own 404/405 and the errors its HTTP parser raises before any handler runs (one
header line over --max-header-bytes: 431; a malformed request line or header: 400; a head still
incomplete after --request-read-timeout: 408) leave as the OpenAI error body (`JSONErrorsAppRunner`).
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import LineTooLong
from aiohttp.web_protocol import RequestHandler

from pagedmodel.server.http_common.api_key import key_matches, unauthorized
from pagedmodel.server.http_common.errors import APIError, write_raw_error
from pagedmodel.server.http_common.http_limits import HTTPLimits, read_body

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_response(exc: APIError) -> web.Response:
    return web.json_response(exc.body(), status=exc.status, headers=exc.headers or None)


def refusal(status: int, message: str, *, code: str | None = None, retry_after: int | None = None,
            err_type: str | None = None, param: str | None = None,
            headers: dict[str, str] | None = None) -> web.Response:
    """The router's own refusal of a request (429, 503, 404...) in the OpenAI shape."""
    headers = dict(headers or {})
    if retry_after is not None:
        headers["Retry-After"] = str(retry_after)
    return error_response(APIError(status, message, code=code, err_type=err_type, param=param, headers=headers))


def _head_size(request: web.Request) -> int:
    return len(request.raw_path) + sum(len(k) + len(v) + 4 for k, v in request.raw_headers)


def guard_middleware(limits: HTTPLimits, api_key: str | None, auth_exempt: tuple[str, ...],
                     connections: Callable[[], int],
                     count: Callable[[web.StreamResponse], web.StreamResponse]) -> Any:
    """The aiohttp middleware; `connections()` is the number of open client connections."""
    exempt = frozenset(auth_exempt)

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            if connections() > limits.max_connections:
                raise APIError(503, f"too many connections (--max-connections {limits.max_connections}); retry "
                                    f"shortly", code="too_many_connections",
                               headers={"Retry-After": "1", "Connection": "close"})
            if _head_size(request) > limits.max_header_bytes:
                raise APIError(431, f"request line and headers exceed the limit of {limits.max_header_bytes} bytes "
                                    f"(--max-header-bytes)", code="headers_too_large", headers={"Connection": "close"})
            if api_key is not None and request.path not in exempt and not key_matches(
                    request.headers.get("Authorization"), api_key):
                raise unauthorized()
            return await handler(request)
        except APIError as exc:
            return count(error_response(exc))
        except web.HTTPException as exc:   # no such route (404), wrong method (405)
            if exc.status < 400:
                raise
            return count(error_response(APIError(exc.status, f"{request.method} {request.path}: {exc.reason}",
                                                 headers={k: v for k, v in exc.headers.items()
                                                          if k.lower() == "allow"})))
    return guard


def protocol_error(status: int, exc: BaseException | None, max_header_bytes: int) -> APIError:
    """The OpenAI-style error for what aiohttp's parser refused (or, status 500, an error outside any handler)."""
    if isinstance(exc, LineTooLong):
        return APIError(431, f"a request line or header exceeds the limit of {max_header_bytes} bytes "
                             f"(--max-header-bytes)", code="headers_too_large")
    if status >= 500:
        return APIError(500, "internal server error", code="internal_error")
    reason = getattr(exc, "message", None) or "malformed HTTP request"
    return APIError(status, f"bad HTTP request: {reason}", code="invalid_http_request")


class _JSONErrorsRequestHandler(RequestHandler):
    """aiohttp's connection handler, whose own error answers (the parser's 400s, a 500 outside any
    handler) are JSON bodies instead of plain text; it still logs them and closes the connection.

    It also bounds the time a request head may take: aiohttp alone closes a connection that trickles
    its head at the keep-alive timeout, unanswered. Here the first byte of a head arms a deadline of
    ``request_read_timeout`` (the keep-alive close waits for it); a head still incomplete then gets
    the engine's JSON 408 and the connection is closed. The body has its own 408 (``read_body``)."""
    max_header_bytes = 0           # both set on the subclass JSONErrorsAppRunner makes
    request_read_timeout = 30.0
    _head_deadline: asyncio.TimerHandle | None = None

    def _idle(self) -> bool:
        """Between requests: bytes arriving now are the start of the next request head."""
        waiting = self._waiter is not None and not self._waiter.done()
        return not self._messages and not self._request_in_progress and (waiting or self._request_count == 0)

    def data_received(self, data: bytes) -> None:
        idle, heads = self._idle(), self._request_count
        super().data_received(data)
        if self._request_count != heads:
            self._cancel_head_deadline()
        elif idle and data and self._head_deadline is None:
            deadline = self._loop.time() + self.request_read_timeout
            self._head_deadline = self._loop.call_at(deadline, self._head_timed_out)
            self._next_keepalive_close_time = max(self._next_keepalive_close_time, deadline + 1.0)

    def _cancel_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_timed_out(self) -> None:
        self._head_deadline = None
        transport = self.transport
        if transport is None or transport.is_closing() or not self._idle():
            return
        write_raw_error(transport, APIError(408, f"request headers not received within "
                                                 f"{self.request_read_timeout:g}s", code="request_timeout"))
        self.force_close()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._cancel_head_deadline()
        super().connection_lost(exc)

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        super().handle_error(request, status, exc, message)   # logs; raises if a response was already started
        resp = error_response(protocol_error(status, exc, self.max_header_bytes))
        resp.force_close()
        return resp


class _JSONErrorsServer(web.Server):
    handler_class: type[RequestHandler] = _JSONErrorsRequestHandler

    def __call__(self) -> RequestHandler:
        return self.handler_class(self, loop=self._loop, **self._kwargs)


class JSONErrorsAppRunner(web.AppRunner):
    """`web.AppRunner` whose connections answer HTTP-level errors with the OpenAI error body."""

    def __init__(self, app: web.Application, *, max_header_bytes: int, request_read_timeout: float,
                 **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._max_header_bytes = max_header_bytes
        self._read_timeout = request_read_timeout

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        handler = type("JSONErrorsRequestHandler", (_JSONErrorsRequestHandler,),
                       {"max_header_bytes": self._max_header_bytes, "request_read_timeout": self._read_timeout})
        server.__class__ = type("JSONErrorsServer", (_JSONErrorsServer,), {"handler_class": handler})
        return server


async def read_json(request: web.Request, limits: HTTPLimits) -> tuple[dict[str, Any], bytes]:
    """The body as a JSON object and as the bytes to forward; raises the 400/408/413 APIError."""
    body = await read_body(request.headers.get("Content-Length"), request.content.iter_any(), limits)
    try:
        payload = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise APIError(400, "request body is not valid JSON: nested too deeply", code="invalid_json") from None
    if not isinstance(payload, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    limits.check_fields(payload)
    return payload, body
