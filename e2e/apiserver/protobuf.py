"""Decoding of the Kubernetes protobuf envelope for the few kinds typed Go clients write.

client-go's typed clientsets (``kubectl create configmap``, Helm's release storage)
send ``application/vnd.kubernetes.protobuf`` bodies and do not fall back to JSON. We
decode the kinds those clients write (for the generated objects, the fields those
generators set), from their ``generated.proto`` field numbers; anything else gets a 415
that names the supported kinds.
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
    "Deployment": {1: ("metadata", "ObjectMeta"), 2: ("spec", "DeploymentSpec")},
    "DeploymentSpec": {1: ("replicas", "int"), 2: ("selector", "LabelSelector"), 3: ("template", "PodTemplateSpec"),
                       4: ("strategy", "DeploymentStrategy"), 5: ("minReadySeconds", "int"),
                       6: ("revisionHistoryLimit", "int"), 7: ("paused", "bool"), 9: ("progressDeadlineSeconds", "int")},
    "DeploymentStrategy": {1: ("type", "str"), 2: ("rollingUpdate", "RollingUpdateDeployment")},
    "RollingUpdateDeployment": {1: ("maxUnavailable", "intstr"), 2: ("maxSurge", "intstr")},
    "LabelSelector": {1: ("matchLabels", "map"), 2: ("matchExpressions", "list:LabelSelectorRequirement")},
    "LabelSelectorRequirement": {1: ("key", "str"), 2: ("operator", "str"), 3: ("values", "list_str")},
    "PodTemplateSpec": {1: ("metadata", "ObjectMeta"), 2: ("spec", "PodSpec")},
    "PodSpec": {2: ("containers", "list:Container"), 3: ("restartPolicy", "str"),
                4: ("terminationGracePeriodSeconds", "int"), 7: ("nodeSelector", "map"),
                8: ("serviceAccountName", "str"), 20: ("initContainers", "list:Container")},
    "Container": {1: ("name", "str"), 2: ("image", "str"), 3: ("command", "list_str"), 4: ("args", "list_str"),
                  5: ("workingDir", "str"), 6: ("ports", "list:ContainerPort"), 7: ("env", "list:EnvVar"),
                  8: ("resources", "ResourceRequirements"), 14: ("imagePullPolicy", "str")},
    "ContainerPort": {1: ("name", "str"), 2: ("hostPort", "int"), 3: ("containerPort", "int"),
                      4: ("protocol", "str"), 5: ("hostIP", "str")},
    "EnvVar": {1: ("name", "str"), 2: ("value", "str")},
    "ResourceRequirements": {1: ("limits", "map_quantity"), 2: ("requests", "map_quantity")},
    "Service": {1: ("metadata", "ObjectMeta"), 2: ("spec", "ServiceSpec")},
    "ServiceSpec": {1: ("ports", "list:ServicePort"), 2: ("selector", "map"), 3: ("clusterIP", "str"),
                    4: ("type", "str"), 7: ("sessionAffinity", "str"), 11: ("externalName", "str")},
    "ServicePort": {1: ("name", "str"), 2: ("protocol", "str"), 3: ("port", "int"), 4: ("targetPort", "intstr"),
                    5: ("nodePort", "int")},
    "IntOrString": {1: ("type", "int"), 2: ("intVal", "int"), 3: ("strVal", "str")},
    "Quantity": {1: ("string", "str")},
    "Role": {1: ("metadata", "ObjectMeta"), 2: ("rules", "list:PolicyRule")},
    "ClusterRole": {1: ("metadata", "ObjectMeta"), 2: ("rules", "list:PolicyRule")},
    "PolicyRule": {1: ("verbs", "list_str"), 2: ("apiGroups", "list_str"), 3: ("resources", "list_str"),
                   4: ("resourceNames", "list_str"), 5: ("nonResourceURLs", "list_str")},
    "RoleBinding": {1: ("metadata", "ObjectMeta"), 2: ("subjects", "list:Subject"), 3: ("roleRef", "RoleRef")},
    "ClusterRoleBinding": {1: ("metadata", "ObjectMeta"), 2: ("subjects", "list:Subject"), 3: ("roleRef", "RoleRef")},
    "Subject": {1: ("kind", "str"), 2: ("apiGroup", "str"), 3: ("name", "str"), 4: ("namespace", "str")},
    "RoleRef": {1: ("apiGroup", "str"), 2: ("kind", "str"), 3: ("name", "str")},
    "Time": {1: ("seconds", "int"), 2: ("nanos", "int")},
    "MapEntry": {1: ("key", "str"), 2: ("value", "bytes")},
    "QuantityEntry": {1: ("key", "str"), 2: ("value", "Quantity")},
}
SUPPORTED = ("ConfigMap", "Secret", "Namespace", "ServiceAccount", "DeleteOptions", "SelfSubjectAccessReview",
             "Deployment", "Service", "Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding")


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
        elif kind == "intstr":
            v = _decode("IntOrString", value)  # type: ignore[arg-type]
            obj[name] = v.get("strVal", "") if v.get("type") == 1 else v.get("intVal", 0)
        elif kind == "map_quantity":
            entry = _decode("QuantityEntry", value)  # type: ignore[arg-type]
            obj.setdefault(name, {})[entry.get("key", "")] = (entry.get("value") or {}).get("string", "")
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


# Pointer fields in the Go types: an explicit zero/false here means something and must be kept.
_KEEP_ZERO = {"replicas", "revisionHistoryLimit", "progressDeadlineSeconds", "terminationGracePeriodSeconds",
              "deletionGracePeriodSeconds", "gracePeriodSeconds", "maxUnavailable", "maxSurge",
              "automountServiceAccountToken", "immutable", "orphanDependents"}


def _clean(obj: Any) -> Any:
    """Go's JSON omits empty values of non-pointer fields that protobuf still sends (0, false, "")."""
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()
                if v not in ("", None) and (k in _KEEP_ZERO or (v is not False and v != 0) or isinstance(v, str))}
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
