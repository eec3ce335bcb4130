"""A flag whose value is a JSON object (--reasoning-config, --watermark-config): its text, or an offline
caller's dict, decoded once here so every such flag refuses bad JSON with the same words."""
from __future__ import annotations

import json
from typing import Any


def json_object_flag(flag: str, value: str | dict[str, Any], error: type[Exception], hint: str) -> dict[str, Any]:
    """``value`` as a dict; otherwise ``error`` naming ``flag`` (``hint`` says what the object holds)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise error(f"{flag} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise error(f"{flag} must be a JSON object {hint}; got {type(value).__name__}")
    return value
