"""PATCH bodies: JSON merge patch (RFC 7386), JSON patch (RFC 6902) and strategic merge patch.

Strategic merge patch knows list merge keys by field name, which covers the built-in
kinds we serve (containers, ports, env, volumes, conditions, ...), and honours the
directives kubectl's client-side apply sends ($patch, $setElementOrder,
$deleteFromPrimitiveList, $retainKeys).
"""
from __future__ import annotations

import copy
from typing import Any

from .errors import ApiError, bad_request

JSON_PATCH = "application/json-patch+json"
MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge recursively, null deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


class JsonPatchTestFailed(ApiError):
    def __init__(self, message: str) -> None:
        super().__init__(422, "Invalid", message)


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise bad_request(f"invalid JSON pointer {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _container_and_key(doc: Any, parts: list[str], path: str) -> tuple[Any, str]:
    cur = doc
    for part in parts[:-1]:
        if isinstance(cur, dict):
            if part not in cur:
                raise JsonPatchTestFailed(f"doc is missing path: {path!r}")
            cur = cur[part]
        elif isinstance(cur, list):
            try:
                cur = cur[int(part)]
            except (ValueError, IndexError):
                raise JsonPatchTestFailed(f"doc is missing path: {path!r}") from None
        else:
            raise JsonPatchTestFailed(f"doc is missing path: {path!r}")
    return cur, parts[-1]


def _get(doc: Any, path: str) -> Any:
    parts = _pointer(path)
    if not parts:
        return doc
    parent, key = _container_and_key(doc, parts, path)
    try:
        return parent[int(key)] if isinstance(parent, list) else parent[key]
    except (KeyError, ValueError, IndexError, TypeError):
        raise JsonPatchTestFailed(f"doc is missing path: {path!r}") from None


def _add(doc: Any, path: str, value: Any) -> Any:
    parts = _pointer(path)
    if not parts:
        return value
    parent, key = _container_and_key(doc, parts, path)
    if isinstance(parent, list):
        if key == "-":
            parent.append(value)
        else:
            idx = int(key)
            if idx < 0 or idx > len(parent):
                raise JsonPatchTestFailed(f"index out of range in {path!r}")
            parent.insert(idx, value)
    elif isinstance(parent, dict):
        parent[key] = value
    else:
        raise JsonPatchTestFailed(f"doc is missing path: {path!r}")
    return doc


def _remove(doc: Any, path: str) -> Any:
    parts = _pointer(path)
    parent, key = _container_and_key(doc, parts, path)
    try:
        if isinstance(parent, list):
            del parent[int(key)]
        else:
            del parent[key]
    except (KeyError, ValueError, IndexError, TypeError):
        raise JsonPatchTestFailed(f"unable to remove nonexistent key: {key}: missing value") from None
    return doc


def json_patch(target: Any, ops: Any) -> Any:
    """RFC 6902. A failing ``test`` (kopf's optimistic finalizer removal relies on it) is a 422."""
    if not isinstance(ops, list):
        raise bad_request("json patch must be a list of operations")
    doc = copy.deepcopy(target)
    for op in ops:
        if not isinstance(op, dict) or "op" not in op or "path" not in op:
            raise bad_request(f"invalid json patch operation: {op!r}")
        kind, path = op["op"], op["path"]
        if kind == "add":
            doc = _add(doc, path, copy.deepcopy(op.get("value")))
        elif kind == "remove":
            doc = _remove(doc, path)
        elif kind == "replace":
            _get(doc, path)  # must exist
            doc = _add(_remove(doc, path), path, copy.deepcopy(op.get("value"))) if _pointer(path) else op.get("value")
        elif kind == "move":
            value = _get(doc, op["from"])
            doc = _add(_remove(doc, op["from"]), path, value)
        elif kind == "copy":
            doc = _add(doc, path, copy.deepcopy(_get(doc, op["from"])))
        elif kind == "test":
            actual = _get(doc, path)
            if actual != op.get("value"):
                raise JsonPatchTestFailed(f"testing value {path} failed: test failed")
        else:
            raise bad_request(f"unexpected json patch operation {kind!r}")
    return doc


# Field name -> merge key for lists merged element-wise by strategic merge patch.
_MERGE_KEYS = {
    "containers": "name", "initContainers": "name", "ephemeralContainers": "name",
    "env": "name", "volumes": "name", "volumeMounts": "mountPath", "volumeDevices": "devicePath",
    "conditions": "type", "imagePullSecrets": "name", "ownerReferences": "uid",
    "hostAliases": "ip", "readinessGates": "conditionType", "resourceClaims": "name",
}
# Lists of scalars that merge as sets.
_PRIMITIVE_MERGE = {"finalizers"}


def _merge_key(path: tuple[str, ...]) -> str | None:
    field = path[-1] if path else ""
    if field == "ports":
        # Container ports merge on containerPort, service ports on port.
        return "containerPort" if any(p in ("containers", "initContainers") for p in path[:-1]) else "port"
    return _MERGE_KEYS.get(field)


def strategic_merge_patch(target: Any, patch: Any, path: tuple[str, ...] = ()) -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    directive = patch.get("$patch")
    if directive == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    if directive == "delete":
        return None
    result = dict(target) if isinstance(target, dict) else {}
    retain = patch.get("$retainKeys")
    orders = {}
    for key, value in patch.items():
        if key in ("$patch", "$retainKeys"):
            continue
        if key.startswith("$setElementOrder/"):
            orders[key.split("/", 1)[1]] = value
            continue
        if key.startswith("$deleteFromPrimitiveList/"):
            field = key.split("/", 1)[1]
            result[field] = [v for v in result.get(field) or [] if v not in value]
            continue
        if value is None:
            result.pop(key, None)
            continue
        sub = path + (key,)
        if isinstance(value, list):
            result[key] = _merge_list(result.get(key), value, sub)
        elif isinstance(value, dict):
            merged = strategic_merge_patch(result.get(key), value, sub)
            if merged is None:
                result.pop(key, None)
            else:
                result[key] = merged
        else:
            result[key] = copy.deepcopy(value)
    for field, order in orders.items():
        if isinstance(result.get(field), list):
            result[field] = _apply_order(result[field], order, _merge_key(path + (field,)))
    if retain is not None:
        result = {k: v for k, v in result.items() if k in retain}
    return result


def _merge_list(current: Any, patch: list[Any], path: tuple[str, ...]) -> list[Any]:
    current = list(current) if isinstance(current, list) else []
    field = path[-1]
    if field in _PRIMITIVE_MERGE:
        return current + [v for v in patch if v not in current]
    key = _merge_key(path)
    if key is None or not all(isinstance(item, dict) for item in patch):
        return [copy.deepcopy(v) for v in patch if not (isinstance(v, dict) and v.get("$patch"))]
    if any(item.get("$patch") == "replace" for item in patch):
        return [copy.deepcopy(v) for v in patch if v.get("$patch") != "replace"]
    result = [copy.deepcopy(v) for v in current]
    for item in patch:
        idx = next((i for i, v in enumerate(result) if isinstance(v, dict) and v.get(key) == item.get(key)), None)
        if item.get("$patch") == "delete":
            if idx is not None:
                result.pop(idx)
            continue
        if idx is None:
            result.append(strategic_merge_patch({}, item, path))
        else:
            result[idx] = strategic_merge_patch(result[idx], item, path)
    return result


def _apply_order(items: list[Any], order: list[Any], key: str | None) -> list[Any]:
    def ident(item: Any) -> Any:
        return item.get(key) if key and isinstance(item, dict) else item

    wanted = [ident(o) if isinstance(o, dict) else o for o in order]
    ranked = sorted(enumerate(items), key=lambda p: (wanted.index(ident(p[1])) if ident(p[1]) in wanted
                                                      else len(wanted) + p[0]))
    return [item for _, item in ranked]
