"""API errors rendered as ``Status`` bodies, the way kube-apiserver reports them."""
from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """An error that becomes an HTTP response with a ``meta/v1 Status`` body."""

    def __init__(self, code: int, reason: str, message: str, *, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details

    def status(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details is not None:
            body["details"] = self.details
        return body


def _qualified(group: str, plural: str) -> str:
    return f"{plural}.{group}" if group else plural


def not_found(group: str, plural: str, name: str) -> ApiError:
    return ApiError(404, "NotFound", f'{_qualified(group, plural)} "{name}" not found',
                    details={"name": name, "group": group, "kind": plural})


def already_exists(group: str, plural: str, name: str) -> ApiError:
    return ApiError(409, "AlreadyExists", f'{_qualified(group, plural)} "{name}" already exists',
                    details={"name": name, "group": group, "kind": plural})


def conflict(group: str, plural: str, name: str, why: str | None = None) -> ApiError:
    why = why or "the object has been modified; please apply your changes to the latest version and try again"
    return ApiError(409, "Conflict", f'Operation cannot be fulfilled on {_qualified(group, plural)} "{name}": {why}',
                    details={"name": name, "group": group, "kind": plural})


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def method_not_allowed(message: str = "the server does not allow this method on the requested resource") -> ApiError:
    return ApiError(405, "MethodNotAllowed", message)


def unsupported_media_type(content_type: str, accepted: list[str]) -> ApiError:
    return ApiError(415, "UnsupportedMediaType",
                    f"the body of the request was in an unknown format - accepted media types include: {', '.join(accepted)}")


def forbidden(message: str) -> ApiError:
    return ApiError(403, "Forbidden", message)


def gone(message: str) -> ApiError:
    return ApiError(410, "Expired", message)


class FieldError:
    """One field-level problem, formatted like apimachinery's ``field.Error``."""

    def __init__(self, reason: str, field: str, message: str) -> None:
        self.reason = reason   # e.g. FieldValueInvalid, FieldValueRequired
        self.field = field
        self.message = message

    def __str__(self) -> str:
        return f"{self.field}: {self.message}" if self.field else self.message


def invalid(kind: str, group: str, name: str, errors: list[FieldError]) -> ApiError:
    """422 Invalid with every cause, joined the way the API server joins them."""
    qualified = f"{kind}.{group}" if group else kind
    texts = [str(e) for e in errors]
    joined = texts[0] if len(texts) == 1 else "[" + ", ".join(texts) + "]"
    return ApiError(422, "Invalid", f'{qualified} "{name}" is invalid: {joined}', details={
        "name": name, "group": group, "kind": kind,
        "causes": [{"reason": e.reason, "message": e.message, "field": e.field} for e in errors],
    })
