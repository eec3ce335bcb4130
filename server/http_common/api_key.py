"""--api-key for the engine and the router alike: which paths it guards and the constant-time check.

Every path needs the key except the ones named by --auth-exempt (default: the probes and the scrape
endpoint, which kubelets and Prometheus call without credentials, and /version). Guarding by default means a new
route (an admin or debug endpoint) is never left open by omission. Each server applies it its own way
(the engine's ASGI middleware in server/api/api_key.py, the router's aiohttp middleware).
"""
from __future__ import annotations

import hmac
from typing import Any

from .errors import APIError

DEFAULT_AUTH_EXEMPT = ("/health", "/ping", "/metrics", "/version")
MISSING_KEY = "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'."


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
