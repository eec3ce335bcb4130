"""Timestamps as the API writes them (RFC 3339, seconds, UTC)."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone


def now_iso(offset_seconds: float = 0) -> str:
    t = datetime.now(timezone.utc) + timedelta(seconds=offset_seconds)
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def now_micro() -> str:
    """MicroTime (Lease renewTime): RFC 3339 with microseconds."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
