"""uvicorn's h11 protocol with the connection-level limits of docs/limits.md.

uvicorn alone leaves three holes: a client that trickles its headers keeps the connection forever
(every received byte cancels the keep-alive timer), too many connections get a plain-text 503, and
a malformed or oversized request head gets a plain-text 400. Here a connection must deliver each
request head within ``request_read_timeout`` (else 408 and close), connections beyond
``max_connections`` get a JSON 503 with Retry-After once their request head is in, and protocol
errors are answered with the OpenAI error body (431 for a head over ``max_header_bytes``).
"""
from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagedmodel.server.http_common.errors import APIError, write_raw_error
from pagedmodel.server.http_common.http_limits import HTTPLimits


def _head_size(scope: dict[str, Any]) -> int:
    return (len(scope.get("raw_path", b"")) + len(scope.get("query_string", b""))
            + sum(len(k) + len(v) + 4 for k, v in scope["headers"]))


def _json_answer(error: APIError) -> Callable[..., Awaitable[None]]:
    """An ASGI app answering `error` with the OpenAI body and closing the connection."""
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = json.dumps(error.body()).encode()
        await send({"type": "http.response.start", "status": error.status,
                    "headers": [(b"content-type", b"application/json"), (b"connection", b"close"),
                                *((k.lower().encode(), v.encode()) for k, v in error.headers.items())]})
        await send({"type": "http.response.body", "body": body})
    return app


def _head_checked(app: Callable[..., Awaitable[None]], limits: HTTPLimits) -> Callable[..., Awaitable[None]]:
    """h11 bounds a head that arrives in pieces; one that arrives whole is measured here."""
    too_large = _json_answer(APIError(431, f"request line and headers exceed the limit of {limits.max_header_bytes} "
                                           f"bytes (--max-header-bytes)", code="headers_too_large"))

    async def checked(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and _head_size(scope) > limits.max_header_bytes:
            await too_large(scope, receive, send)
        else:
            await app(scope, receive, send)
    return checked


def limited_protocol(limits: HTTPLimits) -> type[H11Protocol]:
    """An H11Protocol class enforcing `limits` (uvicorn.Config(http=...) takes the class)."""

    class LimitedH11Protocol(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:   # answered once its head is in, then closed
                self.app = _json_answer(APIError(503, f"too many connections (--max-connections "
                                                      f"{limits.max_connections}); retry shortly",
                                                 code="too_many_connections", headers={"Retry-After": "1"}))
            else:
                self.app = _head_checked(self.app, limits)
            self._head_deadline: asyncio.TimerHandle | None = None
            self._arm_head_deadline()

        def _arm_head_deadline(self) -> None:
            self._cancel_head_deadline()
            self._head_deadline = self.loop.call_later(limits.request_read_timeout, self._head_timed_out)

        def _cancel_head_deadline(self) -> None:
            if getattr(self, "_head_deadline", None) is not None:
                self._head_deadline.cancel()   # type: ignore[union-attr]
                self._head_deadline = None

        def _head_timed_out(self) -> None:
            self._head_deadline = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            if self.conn.trailing_data[0]:   # part of a request head came, the rest never did: 408
                write_raw_error(self.transport, APIError(
                    408, f"request headers not received within {limits.request_read_timeout:g}s",
                    code="request_timeout"))
            else:
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:   # the head is in: the body has its own timeout
                self._cancel_head_deadline()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_head_deadline()   # the next request on this keep-alive connection

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_head_deadline()
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            # uvicorn calls this inside its `except h11.RemoteProtocolError`: the hint says 400 or 431.
            exc = sys.exc_info()[1]
            status = getattr(exc, "error_status_hint", 400)
            if status == 431:
                error = APIError(431, f"request line and headers exceed the limit of {limits.max_header_bytes} "
                                      f"bytes (--max-header-bytes)", code="headers_too_large")
            else:
                error = APIError(status, f"invalid HTTP request: {exc or msg}", code="invalid_http_request")
            write_raw_error(self.transport, error)

    return LimitedH11Protocol
