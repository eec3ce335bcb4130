"""Discovery documents: /version, /api, /apis, per-group-version resource lists and /openapi/v3."""
from __future__ import annotations

import hashlib
import json
import platform
from typing import Any

from .resources import Registry, ResourceType

KUBE_VERSION = (1, 37, 0)


def version_info() -> dict[str, str]:
    """Every VersionInfo field; the Python client's model rejects a partial document."""
    major, minor, patch = KUBE_VERSION
    return {
        "major": str(major), "minor": str(minor),
        "emulationMajor": str(major), "emulationMinor": str(minor),
        "minCompatibilityMajor": str(major), "minCompatibilityMinor": str(minor - 1),
        "gitVersion": f"v{major}.{minor}.{patch}+pagedmodel-e2e",
        "gitCommit": "0" * 40, "gitTreeState": "clean", "buildDate": "2026-01-01T00:00:00Z",
        "goVersion": "go1.25.0", "compiler": "gc",
        "platform": f"linux/{'arm64' if platform.machine() in ('aarch64', 'arm64') else 'amd64'}",
    }


def api_versions(server_address: str) -> dict[str, Any]:
    return {"kind": "APIVersions", "versions": ["v1"],
            "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": server_address}]}


def _group(name: str, versions: list[str]) -> dict[str, Any]:
    vs = [{"groupVersion": f"{name}/{v}", "version": v} for v in versions]
    return {"name": name, "versions": vs, "preferredVersion": vs[0]}


def api_group_list(registry: Registry) -> dict[str, Any]:
    groups = [_group(g, vs) for g, vs in registry.groups().items() if g]
    return {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}


def api_group(registry: Registry, group: str) -> dict[str, Any] | None:
    versions = registry.groups().get(group)
    if not group or not versions:
        return None
    return {"kind": "APIGroup", "apiVersion": "v1", **_group(group, versions)}


def resource_list(registry: Registry, group: str, version: str) -> dict[str, Any] | None:
    types = registry.in_group_version(group, version)
    if not types:
        return None
    resources: list[dict[str, Any]] = []
    for rt in sorted(types, key=lambda t: t.plural):
        entry: dict[str, Any] = {"name": rt.plural, "singularName": rt.singular, "namespaced": rt.namespaced,
                                 "kind": rt.kind, "verbs": list(rt.verbs),
                                 "storageVersionHash": hashlib.sha256(rt.storage_key.encode()).hexdigest()[:12]}
        if rt.short_names:
            entry["shortNames"] = list(rt.short_names)
        if rt.categories:
            entry["categories"] = list(rt.categories)
        resources.append(entry)
        if rt.status_subresource:
            resources.append({"name": f"{rt.plural}/status", "singularName": "", "namespaced": rt.namespaced,
                              "kind": rt.kind, "verbs": ["get", "patch", "update"]})
        if rt.scale is not None:
            resources.append({"name": f"{rt.plural}/scale", "singularName": "", "namespaced": rt.namespaced,
                              "group": "autoscaling", "version": "v1", "kind": "Scale",
                              "verbs": ["get", "patch", "update"]})
        for extra in rt.extra_subresources:
            resources.append({"name": f"{rt.plural}/{extra}", "singularName": "", "namespaced": rt.namespaced,
                              "kind": "PodExecOptions" if extra == "exec" else rt.kind,
                              "verbs": {"log": ["get"], "exec": ["create", "get"]}.get(extra, ["update"])})
    return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": f"{group}/{version}" if group else version,
            "resources": resources}


# --- OpenAPI v3 ------------------------------------------------------------------------

_OBJECT_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"


def _gv_path(group: str, version: str) -> str:
    return f"apis/{group}/{version}" if group else f"api/{version}"


def _schema_name(rt: ResourceType) -> str:
    reversed_group = ".".join(reversed(rt.group.split("."))) if rt.group else "io.k8s.api.core"
    return f"{reversed_group}.{rt.version}.{rt.kind}"


def _params(*names: str) -> list[dict[str, Any]]:
    docs = {
        "fieldValidation": "fieldValidation instructs the server on how to handle objects in the request "
                           "containing unknown or duplicate fields: Ignore, Warn or Strict.",
        "dryRun": "When present, indicates that modifications should not be persisted.",
        "fieldManager": "fieldManager is a name associated with the actor or entity that is making these changes.",
        "pretty": "If 'true', then the output is pretty printed.",
        "force": "Force is going to \"force\" Apply requests.",
    }
    return [{"name": n, "in": "query", "description": docs[n], "schema": {"type": "boolean" if n == "force" else
                                                                            "string"}, "uniqueItems": True}
            for n in names]


def _op(rt: ResourceType, action: str, verb: str, kind: str | None = None, body: list[str] | None = None,
        params: tuple[str, ...] = ()) -> dict[str, Any]:
    ref = {"$ref": f"#/components/schemas/{_schema_name(rt)}"}
    op: dict[str, Any] = {
        "operationId": f"{verb}{rt.kind}",
        "parameters": _params(*params),
        "responses": {"200": {"description": "OK", "content": {"application/json": {"schema": ref}}}},
        "x-kubernetes-action": action,
        "x-kubernetes-group-version-kind": {"group": rt.group, "version": rt.version, "kind": kind or rt.kind},
    }
    if body:
        op["requestBody"] = {"content": {ct: {"schema": {"type": "object"} if "patch" in ct else ref} for ct in body},
                             "required": True}
    return op


def _patch_types(rt: ResourceType) -> list[str]:
    types = ["application/json-patch+json", "application/merge-patch+json", "application/apply-patch+yaml"]
    return types + (["application/strategic-merge-patch+json"] if rt.builtin else [])


def openapi_document(registry: Registry, group: str, version: str) -> dict[str, Any] | None:
    types = registry.in_group_version(group, version)
    if not types:
        return None
    paths: dict[str, Any] = {}
    schemas: dict[str, Any] = {_OBJECT_META: {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}
    prefix = "/" + _gv_path(group, version)
    for rt in types:
        base = f"{prefix}/namespaces/{{namespace}}/{rt.plural}" if rt.namespaced else f"{prefix}/{rt.plural}"
        write = ("dryRun", "fieldManager", "fieldValidation")
        paths[base] = {"get": _op(rt, "list", "list"), "post": _op(rt, "post", "create", body=["application/json"],
                                                                   params=write)}
        item = {"get": _op(rt, "get", "read"), "put": _op(rt, "put", "replace", body=["application/json"], params=write),
                "patch": _op(rt, "patch", "patch", body=_patch_types(rt), params=write + ("force",)),
                "delete": _op(rt, "delete", "delete", params=("dryRun",))}
        paths[base + "/{name}"] = item
        if rt.status_subresource:
            paths[base + "/{name}/status"] = {k: v for k, v in item.items() if k != "delete"}
        if rt.crd_name and rt.schema is not None:
            body = json.loads(json.dumps(rt.schema))
            body.setdefault("properties", {})["metadata"] = {"$ref": f"#/components/schemas/{_OBJECT_META}"}
            body["properties"].setdefault("apiVersion", {"type": "string"})
            body["properties"].setdefault("kind", {"type": "string"})
            body["x-kubernetes-group-version-kind"] = [{"group": rt.group, "version": rt.version, "kind": rt.kind}]
            schemas[_schema_name(rt)] = body
    return {"openapi": "3.0.0", "info": {"title": "Kubernetes", "version": "v1.37.0"}, "paths": paths,
            "components": {"schemas": schemas}}


def openapi_root(registry: Registry) -> dict[str, Any]:
    paths = {}
    for group, versions in registry.groups().items():
        for version in versions:
            doc = openapi_document(registry, group, version)
            digest = hashlib.sha512(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:64].upper()
            gv = _gv_path(group, version)
            paths[gv] = {"serverRelativeURL": f"/openapi/v3/{gv}?hash={digest}"}
    return {"paths": paths}
