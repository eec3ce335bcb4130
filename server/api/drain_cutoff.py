"""What a request still unanswered when the drain runs out gets: a 503 marked unserved, not a plain 500.

When `--shutdown-timeout` ends, uvicorn cancels the requests left. One whose response has not
started (a non-streamed completion still generating) has shown its client nothing, so a router may
run it again on another replica: the engine answers 503 `shutting_down` with X-PagedModel-Unserved,
which the router retries instead of relaying (without this uvicorn sends a plain "Internal Server
Error"). A started stream is cut as before: its client has seen output.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from .errors import UNSERVED_HEADER, error_body

ASGIApp = Callable[[dict[str, Any], Callable[..., Any], Callable[..., Any]], Awaitable[None]]


class DrainCutoffMiddleware:
    """ASGI middleware: a request cancelled while the server drains, before its response started, gets
    the unserved 503; the cancellation then goes on as uvicorn meant it."""

    def __init__(self, app: ASGIApp, is_draining: Callable[[], bool]):
        self.app = app
        self.is_draining = is_draining

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: dict[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)
        try:
            await self.app(scope, receive, tracking_send)
        except asyncio.CancelledError:
            if not started and self.is_draining():
                await _send_unserved(send)
            raise


async def _send_unserved(send: Callable[..., Any]) -> None:
    body = json.dumps(error_body("server shut down before the request finished; it was not answered",
                                 "ServiceUnavailableError", None, "shutting_down")).encode()
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (UNSERVED_HEADER.lower().encode(), b"shutting_down")]})
    await send({"type": "http.response.body", "body": body})
