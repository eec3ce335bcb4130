"""CRD ``openAPIV3Schema`` handling: defaulting, pruning and validation.

Messages follow kube-apiserver's wording (``spec.x in body should be greater than or
equal to 0``, ``Unsupported value``, ``Required value``) so users see what a real
cluster would tell them. CEL rules (``x-kubernetes-validations``) are not evaluated.
"""
from __future__ import annotations

import copy
import json
import re
from datetime import datetime
from typing import Any

from .errors import FieldError

_TOP_LEVEL = {"apiVersion", "kind", "metadata"}


def _fmt(value: Any) -> str:
    """Values in messages the way Go's %#v prints them for JSON data."""
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(",", ":"))
    if value is None:
        return "null"
    return str(value)


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return "null"


def apply_defaults(schema: dict[str, Any] | None, value: Any) -> Any:
    """Fill ``default`` for absent properties, recursively (objects and array items)."""
    if not schema:
        return value
    if isinstance(value, dict):
        for name, sub in (schema.get("properties") or {}).items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                value[name] = apply_defaults(sub, value[name])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            props = schema.get("properties") or {}
            for name in list(value):
                if name not in props:
                    value[name] = apply_defaults(extra, value[name])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [apply_defaults(schema["items"], v) for v in value]
    return value


def prune(schema: dict[str, Any] | None, value: Any, path: str, unknown: list[str], top: bool = False) -> Any:
    """Drop fields the schema does not specify; record their paths in ``unknown``."""
    if not schema or schema.get("x-kubernetes-preserve-unknown-fields"):
        if isinstance(value, dict) and schema and schema.get("properties"):
            for name, sub in schema["properties"].items():
                if name in value:
                    value[name] = prune(sub, value[name], _join(path, name), unknown)
        return value
    if schema.get("x-kubernetes-embedded-resource") and isinstance(value, dict):
        top = True
    if isinstance(value, dict) and (schema.get("type") == "object" or "properties" in schema
                                    or "additionalProperties" in schema):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for name in list(value):
            if top and name == "metadata":
                continue  # ObjectMeta belongs to the server whatever the schema says of it, as in the real one
            if name in props:
                value[name] = prune(props[name], value[name], _join(path, name), unknown)
            elif isinstance(extra, dict):
                value[name] = prune(extra, value[name], _join(path, name), unknown)
            elif extra is True or (top and name in _TOP_LEVEL):
                continue
            else:
                unknown.append(_join(path, name))
                del value[name]
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [prune(schema["items"], v, f"{path}[{i}]", unknown) for i, v in enumerate(value)]
    return value


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def validate(schema: dict[str, Any] | None, value: Any, path: str = "") -> list[FieldError]:
    if not schema:
        return []
    errors: list[FieldError] = []
    _validate(schema, value, path, errors)
    return errors


def _validate(schema: dict[str, Any], value: Any, path: str, errors: list[FieldError]) -> None:
    shown = path or "<root>"
    if value is None:
        if not schema.get("nullable") and schema.get("type"):
            errors.append(FieldError("FieldValueTypeInvalid", shown,
                                     f'Invalid value: "null": {shown} in body must be of type {schema["type"]}: "null"'))
        return
    declared = schema.get("type")
    if schema.get("x-kubernetes-int-or-string"):
        if not isinstance(value, (int, str)) or isinstance(value, bool):
            errors.append(FieldError("FieldValueTypeInvalid", shown,
                                     f'Invalid value: "{_json_type(value)}": {shown} in body must be of type '
                                     f'integer,string: "{_json_type(value)}"'))
            return
    elif declared:
        actual = _json_type(value)
        ok = actual == declared or (declared == "number" and actual == "integer")
        if declared == "integer" and isinstance(value, float) and value.is_integer():
            ok = True
        if not ok:
            errors.append(FieldError("FieldValueTypeInvalid", shown,
                                     f'Invalid value: "{actual}": {shown} in body must be of type {declared}: '
                                     f'"{actual}"'))
            return
    if "enum" in schema and value not in schema["enum"]:
        supported = ", ".join(_fmt(v) for v in schema["enum"])
        errors.append(FieldError("FieldValueNotSupported", shown,
                                 f"Unsupported value: {_fmt(value)}: supported values: {supported}"))
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        _numeric(schema, value, shown, errors)
    if isinstance(value, str):
        _string(schema, value, shown, errors)
    if isinstance(value, list):
        _array(schema, value, path, shown, errors)
    if isinstance(value, dict):
        _object(schema, value, path, shown, errors)
    for sub in schema.get("allOf") or []:
        _validate(sub, value, path, errors)
    for keyword in ("anyOf", "oneOf"):
        options = schema.get(keyword)
        if options:
            passing = sum(1 for sub in options if not validate(sub, value, path))
            if (keyword == "anyOf" and passing == 0) or (keyword == "oneOf" and passing != 1):
                errors.append(FieldError("FieldValueInvalid", shown,
                                         f"Invalid value: {_fmt(value)}: {shown} in body must validate "
                                         f"{'at least one' if keyword == 'anyOf' else 'one and only one'} schema "
                                         f"({keyword})"))
    if isinstance(schema.get("not"), dict) and not validate(schema["not"], value, path):
        errors.append(FieldError("FieldValueInvalid", shown,
                                 f"Invalid value: {_fmt(value)}: {shown} in body should not validate the schema"))


def _numeric(schema: dict[str, Any], value: float, shown: str, errors: list[FieldError]) -> None:
    lo, hi = schema.get("minimum"), schema.get("maximum")
    if lo is not None:
        excl = schema.get("exclusiveMinimum") is True
        if value < lo or (excl and value == lo):
            rel = "greater than" if excl else "greater than or equal to"
            errors.append(FieldError("FieldValueInvalid", shown,
                                     f"Invalid value: {_fmt(value)}: {shown} in body should be {rel} {_fmt(lo)}"))
    if hi is not None:
        excl = schema.get("exclusiveMaximum") is True
        if value > hi or (excl and value == hi):
            rel = "less than" if excl else "less than or equal to"
            errors.append(FieldError("FieldValueInvalid", shown,
                                     f"Invalid value: {_fmt(value)}: {shown} in body should be {rel} {_fmt(hi)}"))
    step = schema.get("multipleOf")
    if step and (value / step) != int(value / step):
        errors.append(FieldError("FieldValueInvalid", shown,
                                 f"Invalid value: {_fmt(value)}: {shown} in body should be a multiple of {_fmt(step)}"))
    fmt = schema.get("format")
    if fmt == "int32" and isinstance(value, int) and not -2**31 <= value < 2**31:
        errors.append(FieldError("FieldValueInvalid", shown,
                                 f"Invalid value: {_fmt(value)}: {shown} in body must be of type int32"))


def _string(schema: dict[str, Any], value: str, shown: str, errors: list[FieldError]) -> None:
    lo, hi = schema.get("minLength"), schema.get("maxLength")
    if lo is not None and len(value) < lo:
        errors.append(FieldError("FieldValueInvalid", shown,
                                 f"Invalid value: {_fmt(value)}: {shown} in body should be at least {lo} chars long"))
    if hi is not None and len(value) > hi:
        errors.append(FieldError("FieldValueTooLong", shown, f"Too long: may not be more than {hi} bytes"))
    pattern = schema.get("pattern")
    if pattern and not re.search(pattern, value):
        errors.append(FieldError("FieldValueInvalid", shown,
                                 f"Invalid value: {_fmt(value)}: {shown} in body should match '{pattern}'"))
    if schema.get("format") == "date-time":
        try:
            datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            errors.append(FieldError("FieldValueInvalid", shown,
                                     f"Invalid value: {_fmt(value)}: {shown} in body must be of type date-time: "
                                     f"{_fmt(value)}"))


def _array(schema: dict[str, Any], value: list[Any], path: str, shown: str, errors: list[FieldError]) -> None:
    lo, hi = schema.get("minItems"), schema.get("maxItems")
    if lo is not None and len(value) < lo:
        errors.append(FieldError("FieldValueInvalid", shown,
                                 f"Invalid value: {len(value)}: {shown} in body should have at least {lo} items"))
    if hi is not None and len(value) > hi:
        errors.append(FieldError("FieldValueTooMany", shown, f"Too many: {len(value)}: must have at most {hi} items"))
    if schema.get("uniqueItems") or schema.get("x-kubernetes-list-type") == "set":
        seen: list[Any] = []
        for item in value:
            if item in seen:
                errors.append(FieldError("FieldValueDuplicate", shown, f"Duplicate value: {_fmt(item)}"))
            seen.append(item)
    items = schema.get("items")
    if isinstance(items, dict):
        for i, item in enumerate(value):
            _validate(items, item, f"{path}[{i}]", errors)


def _object(schema: dict[str, Any], value: dict[str, Any], path: str, shown: str, errors: list[FieldError]) -> None:
    for name in schema.get("required") or []:
        if name not in value:
            errors.append(FieldError("FieldValueRequired", _join(path, name), "Required value"))
    lo, hi = schema.get("minProperties"), schema.get("maxProperties")
    if lo is not None and len(value) < lo:
        errors.append(FieldError("FieldValueInvalid", shown,
                                 f"Invalid value: {len(value)}: {shown} in body should have at least {lo} properties"))
    if hi is not None and len(value) > hi:
        errors.append(FieldError("FieldValueTooMany", shown, f"Too many: {len(value)}: must have at most {hi} items"))
    props = schema.get("properties") or {}
    extra = schema.get("additionalProperties")
    for name, item in value.items():
        if name in props:
            _validate(props[name], item, _join(path, name), errors)
        elif isinstance(extra, dict):
            _validate(extra, item, _join(path, name), errors)
