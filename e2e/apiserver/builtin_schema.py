"""Known fields of built-in kinds, taken from the `kubernetes` client's generated models.

kube-apiserver decodes built-in kinds into typed structs, so unknown fields are dropped
(with a warning) or, under ``fieldValidation=Strict`` as kubectl sends, rejected. The
client's models are generated from the same OpenAPI, which makes them a faithful list.
"""
from __future__ import annotations

import functools
import typing
from typing import Any

from kubernetes.client import models

try:   # kubernetes>=35 generates pydantic models; older clients have no usable field list here
    from pydantic import BaseModel
except ImportError:   # pragma: no cover - depends on the installed client generation
    BaseModel = None  # type: ignore[assignment,misc]

_PREFIX = {"": "Core", "events.k8s.io": "Events", "discovery.k8s.io": "Discovery"}
TypeSpec = tuple[str, Any] | None   # ("model", cls) | ("list", spec) | ("dict", spec) | None for leaves


def model_for(group: str, version: str, kind: str) -> Any:
    if BaseModel is None:
        return None
    ver = version[:1].upper() + version[1:]
    for name in (f"{ver}{kind}", f"{_PREFIX.get(group, '')}{ver}{kind}"):
        cls = getattr(models, name, None)
        if isinstance(cls, type) and issubclass(cls, BaseModel) and hasattr(cls, "model_fields"):
            return cls
    return None


def _spec(annotation: Any) -> TypeSpec:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _spec(args[0])
    if origin is typing.Union:
        concrete = [a for a in args if a is not type(None)]
        return _spec(concrete[0]) if len(concrete) == 1 else None   # int-or-string and friends are leaves
    if origin in (list, typing.List):
        inner = _spec(args[0]) if args else None
        return ("list", inner) if inner else None
    if origin in (dict, typing.Dict):
        inner = _spec(args[1]) if len(args) == 2 else None
        return ("dict", inner) if inner else None
    if BaseModel is not None and isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return ("model", annotation)
    return None


@functools.lru_cache(maxsize=None)
def _fields(cls: Any) -> dict[str, TypeSpec]:
    """JSON field name -> type spec of its value."""
    attribute_map: dict[str, str] = getattr(cls, "attribute_map", {})
    out: dict[str, TypeSpec] = {}
    for py_name, field in cls.model_fields.items():
        # Names clashing with pydantic (schema, not) are renamed in Python; the alias keeps the JSON name.
        json_name = field.serialization_alias or attribute_map.get(py_name) or field.alias or py_name
        out[json_name] = _spec(field.annotation)
    return out


def _walk(value: Any, spec: TypeSpec, path: str, unknown: list[str]) -> None:
    if spec is None:
        return
    kind, inner = spec
    if kind == "list" and isinstance(value, list):
        for i, item in enumerate(value):
            _walk(item, inner, f"{path}[{i}]", unknown)
    elif kind == "dict" and isinstance(value, dict):
        for key, item in value.items():
            _walk(item, inner, f"{path}.{key}", unknown)
    elif kind == "model" and isinstance(value, dict):
        fields = _fields(inner)
        for key in list(value):
            if key not in fields:
                unknown.append(f"{path}.{key}" if path else key)
                del value[key]
            else:
                _walk(value[key], fields[key], f"{path}.{key}" if path else key, unknown)


def prune_unknown(group: str, version: str, kind: str, obj: dict[str, Any]) -> list[str]:
    """Drop fields the kind does not define (status excepted); returns their paths."""
    cls = model_for(group, version, kind)
    if cls is None:
        return []
    fields = _fields(cls)
    unknown: list[str] = []
    for key in list(obj):
        if key == "status":
            continue
        if key not in fields:
            unknown.append(key)
            del obj[key]
        else:
            _walk(obj[key], fields[key], key, unknown)
    return unknown
