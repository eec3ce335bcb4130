"""--api-key on the engine: the ASGI middleware that applies the check server/http_common/api_key.py
shares with the router.

Every path needs the key except the ones named by --auth-exempt (default: the probes and the scrape
endpoint, which kubelets and Prometheus call without credentials, and /version). Guarding by default means a new
route (an admin or debug endpoint) is never left open by omission.
"""
from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from pagedmodel.server.http_common.api_key import key_matches, unauthorized


def route_path(scope: dict[str, Any]) -> str:
    """The path the app routes on: uvicorn puts --root-path in front of every request's path (the ASGI
    spec's way), and a prefix a proxy adds must not change which paths are exempt."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] or "/" if root and path.startswith(root) else path


class APIKeyMiddleware:
    """ASGI middleware: 401 with the OpenAI error body for any non-exempt path without the key."""

    def __init__(self, app: Callable[..., Awaitable[None]], api_key: str, exempt: Iterable[str]):
        self.app = app
        self.api_key = api_key
        self.exempt = frozenset(exempt)

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http" or route_path(scope) in self.exempt:
            await self.app(scope, receive, send)
            return
        auth = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
        if key_matches(auth, self.api_key):
            await self.app(scope, receive, send)
            return
        err = unauthorized()
        body = json.dumps(err.body()).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
