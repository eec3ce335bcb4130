"""Decoding of the Kubernetes protobuf envelope for the few kinds typed Go clients write.

client-go's typed clientsets (``kubectl create configmap``, Helm's release storage)
send ``application/vnd.kubernetes.protobuf`` bodies and do not fall back to JSON. We
decode the kinds those clients write, from their ``generated.proto`` field numbers;
anything else gets a 415 that names the supported kinds.
"""
from __future__ import annotations

import base64
from datetime import datetime, timezone
from typing import Any

MAGIC = b"k8s\x00"
MEDIA_TYPE = "application/vnd.kubernetes.protobuf"

# Field tables: number -> (json name, type). Types: str, int, bool, bytes, time, map, map_bytes,
# list_str, a nested table name, or "list:" + nested table name.
_TABLES: dict[str, dict[int, tuple[str, str]]] = {
    "TypeMeta": {1: ("apiVersion", "str"), 2: ("kind", "str")},
    "Unknown": {1: ("typeMeta", "TypeMeta"), 2: ("raw", "bytes"), 3: ("contentEncoding", "str"),
                4: ("contentType", "str")},
    "ObjectMeta": {1: ("name", "str"), 2: ("generateName", "str"), 3: ("namespace", "str"), 4: ("selfLink", "str"),
                   5: ("uid", "str"), 6: ("resourceVersion", "str"), 7: ("generation", "int"),
                   8: ("creationTimestamp", "time"), 9: ("deletionTimestamp", "time"),
                   10: ("deletionGracePeriodSeconds", "int"), 11: ("labels", "map"), 12: ("annotations", "map"),
                   13: ("ownerReferences", "list:OwnerReference"), 14: ("finalizers", "list_str")},
    "OwnerReference": {1: ("kind", "str"), 3: ("name", "str"), 4: ("uid", "str"), 5: ("apiVersion", "str"),
                       6: ("controller", "bool"), 7: ("blockOwnerDeletion", "bool")},
    "ConfigMap": {1: ("metadata", "ObjectMeta"), 2: ("data", "map"), 3: ("binaryData", "map_bytes"),
                  4: ("immutable", "bool")},
    "Secret": {1: ("metadata", "ObjectMeta"), 2: ("data", "map_bytes"), 3: ("type", "str"), 4: ("stringData", "map"),
               5: ("immutable", "bool")},
    "Namespace": {1: ("metadata", "ObjectMeta"), 2: ("spec", "NamespaceSpec")},
    "NamespaceSpec": {1: ("finalizers", "list_str")},
    "ServiceAccount": {1: ("metadata", "ObjectMeta"), 3: ("automountServiceAccountToken", "bool")},
    "DeleteOptions": {1: ("gracePeriodSeconds", "int"), 2: ("preconditions", "Preconditions"),
                      3: ("orphanDependents", "bool"), 4: ("propagationPolicy", "str"), 5: ("dryRun", "list_str")},
    "Preconditions": {1: ("uid", "str"), 2: ("resourceVersion", "str")},
    "SelfSubjectAccessReview": {1: ("metadata", "ObjectMeta"), 2: ("spec", "SelfSubjectAccessReviewSpec")},
    "SelfSubjectAccessReviewSpec": {1: ("resourceAttributes", "ResourceAttributes"),
                                    2: ("nonResourceAttributes", "NonResourceAttributes")},
    "ResourceAttributes": {1: ("namespace", "str"), 2: ("verb", "str"), 3: ("group", "str"), 4: ("version", "str"),
                           5: ("resource", "str"), 6: ("subresource", "str"), 7: ("name", "str")},
    "NonResourceAttributes": {1: ("path", "str"), 2: ("verb", "str")},
    "Time": {1: ("seconds", "int"), 2: ("nanos", "int")},
    "MapEntry": {1: ("key", "str"), 2: ("value", "bytes")},
}
SUPPORTED = ("ConfigMap", "Secret", "Namespace", "ServiceAccount", "DeleteOptions", "SelfSubjectAccessReview")


class ProtobufError(ValueError):
    pass


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise ProtobufError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def _fields(buf: bytes) -> list[tuple[int, int | bytes]]:
    out: list[tuple[int, int | bytes]] = []
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
            out.append((number, value))
        elif wire == 2:
            length, pos = _varint(buf, pos)
            out.append((number, buf[pos:pos + length]))
            pos += length
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        else:
            raise ProtobufError(f"unsupported wire type {wire}")
    return out


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _decode(table: str, buf: bytes) -> dict[str, Any]:
    spec = _TABLES[table]
    obj: dict[str, Any] = {}
    for number, value in _fields(buf):
        if number not in spec:
            continue
        name, kind = spec[number]
        if kind == "str":
            obj[name] = bytes(value).decode()  # type: ignore[arg-type]
        elif kind == "bytes":
            obj[name] = bytes(value)  # type: ignore[arg-type]
        elif kind == "int":
            obj[name] = _signed(int(value))  # type: ignore[arg-type]
        elif kind == "bool":
            obj[name] = bool(value)
        elif kind == "time":
            t = _decode("Time", value)  # type: ignore[arg-type]
            if t.get("seconds"):
                obj[name] = datetime.fromtimestamp(t["seconds"], timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        elif kind in ("map", "map_bytes"):
            entry = _decode("MapEntry", value)  # type: ignore[arg-type]
            raw = entry.get("value", b"")
            obj.setdefault(name, {})[entry.get("key", "")] = (
                base64.b64encode(raw).decode() if kind == "map_bytes" else raw.decode())
        elif kind == "list_str":
            obj.setdefault(name, []).append(bytes(value).decode())  # type: ignore[arg-type]
        elif kind.startswith("list:"):
            obj.setdefault(name, []).append(_decode(kind[5:], value))  # type: ignore[arg-type]
        else:
            obj[name] = _decode(kind, value)  # type: ignore[arg-type]
    return obj


def _clean(obj: Any) -> Any:
    """Proto2 sends empty optional strings; JSON omits them."""
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items() if v not in ("", None)}
    if isinstance(obj, list):
        return [_clean(v) for v in obj]
    return obj


def decode(body: bytes, expected_kind: str | None = None) -> dict[str, Any]:
    """The JSON form of a protobuf-encoded object (``k8s\\0`` + runtime.Unknown envelope)."""
    if not body.startswith(MAGIC):
        raise ProtobufError("missing the k8s protobuf magic prefix")
    envelope = _decode("Unknown", body[len(MAGIC):])
    type_meta = envelope.get("typeMeta") or {}
    kind = type_meta.get("kind") or expected_kind or ""
    if kind not in SUPPORTED:
        raise ProtobufError(f"protobuf bodies are decoded only for {', '.join(SUPPORTED)} (got {kind or 'unknown'}); "
                            "send JSON instead (kubectl create -f / apply -f do)")
    obj = _clean(_decode(kind, envelope.get("raw", b"")))
    if kind != "DeleteOptions":
        obj["apiVersion"], obj["kind"] = type_meta.get("apiVersion", "v1"), kind
    return obj
