"""--api-key for the engine and the router alike: which paths it guards and the constant-time check.

Every path needs the key except the ones named by --auth-exempt (default: the probes and the scrape
endpoint, which kubelets and Prometheus call without credentials, and /version). Guarding by default means a new
route (an admin or debug endpoint) is never left open by omission.
"""
from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from .errors import APIError

DEFAULT_AUTH_EXEMPT = ("/health", "/ping", "/metrics", "/version")
MISSING_KEY = "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'."


def route_path(scope: dict[str, Any]) -> str:
    """The path the app routes on: uvicorn puts --root-path in front of every request's path (the ASGI
    spec's way), and a prefix a proxy adds must not change which paths are exempt."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] or "/" if root and path.startswith(root) else path


def key_matches(authorization: str | None, api_key: str) -> bool:
    """True when the Authorization header carries `Bearer <api_key>` (compared in constant time)."""
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


def unauthorized() -> APIError:
    return APIError(401, MISSING_KEY, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def parse_exempt(text: str) -> tuple[str, ...]:
    """`--auth-exempt /health,/metrics` as paths; an empty string exempts nothing."""
    paths = tuple(p.strip() for p in text.split(",") if p.strip())
    bad = [p for p in paths if not p.startswith("/")]
    if bad:
        raise ValueError(f"--auth-exempt takes absolute paths such as /health, got {', '.join(bad)}")
    return paths


def add_auth_arguments(parser: Any) -> None:
    parser.add_argument("--auth-exempt", type=parse_exempt, default=DEFAULT_AUTH_EXEMPT, metavar="PATHS",
                        help="comma-separated paths served without --api-key (default: %s; '' guards all)"
                             % ",".join(DEFAULT_AUTH_EXEMPT))


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
