"""CustomResourceDefinitions: validation, status, and the resource types they register."""
from __future__ import annotations

from typing import Any

from .errors import FieldError
from .resources import ResourceType

CLEANUP_FINALIZER = "customresourcecleanup.apiextensions.k8s.io"


def validate_crd(crd: dict[str, Any]) -> list[FieldError]:
    spec = crd.get("spec") or {}
    names = spec.get("names") or {}
    errors = []
    for field, value in (("spec.group", spec.get("group")), ("spec.names.plural", names.get("plural")),
                         ("spec.names.kind", names.get("kind"))):
        if not value:
            errors.append(FieldError("FieldValueRequired", field, "Required value"))
    if spec.get("scope") not in ("Namespaced", "Cluster"):
        errors.append(FieldError("FieldValueNotSupported", "spec.scope",
                                 f'Unsupported value: "{spec.get("scope", "")}": supported values: '
                                 '"Cluster", "Namespaced"'))
    versions = spec.get("versions") or []
    if not versions:
        errors.append(FieldError("FieldValueRequired", "spec.versions", "Required value"))
    elif sum(1 for v in versions if v.get("storage")) != 1:
        errors.append(FieldError("FieldValueInvalid", "spec.versions",
                                 "Invalid value: must have exactly one version marked as storage version"))
    if names.get("plural") and spec.get("group"):
        expected = f"{names['plural']}.{spec['group']}"
        if crd["metadata"]["name"] != expected:
            errors.append(FieldError("FieldValueInvalid", "metadata.name",
                                     f'Invalid value: "{crd["metadata"]["name"]}": must be spec.names.plural+"."+'
                                     "spec.group"))
    for i, v in enumerate(versions):
        schema = (v.get("schema") or {}).get("openAPIV3Schema")
        if schema is None:
            errors.append(FieldError("FieldValueRequired", f"spec.versions[{i}].schema.openAPIV3Schema",
                                     "Required value: schemas are required"))
    return errors


def accepted_status(crd: dict[str, Any], now: str) -> dict[str, Any]:
    spec = crd["spec"]
    names = dict(spec["names"])
    names.setdefault("singular", names["kind"].lower())
    names.setdefault("listKind", names["kind"] + "List")
    storage = next(v["name"] for v in spec["versions"] if v.get("storage"))
    old = {c["type"]: c for c in (crd.get("status") or {}).get("conditions") or []}

    def cond(ctype: str, reason: str, message: str) -> dict[str, Any]:
        prev = old.get(ctype)
        return {"type": ctype, "status": "True", "reason": reason, "message": message,
                "lastTransitionTime": prev["lastTransitionTime"] if prev and prev.get("status") == "True" else now}

    stored = list((crd.get("status") or {}).get("storedVersions") or [])
    if storage not in stored:
        stored.append(storage)
    return {
        "acceptedNames": names,
        "conditions": [cond("NamesAccepted", "NoConflicts", "no conflicts found"),
                       cond("Established", "InitialNamesAccepted", "the initial names have been accepted")],
        "storedVersions": stored,
    }


def resource_types(crd: dict[str, Any]) -> list[ResourceType]:
    spec = crd["spec"]
    names = spec["names"]
    types = []
    for version in spec["versions"]:
        if not version.get("served", True):
            continue
        sub = version.get("subresources") or {}
        scale = sub.get("scale")
        types.append(ResourceType(
            group=spec["group"], version=version["name"], plural=names["plural"], kind=names["kind"],
            namespaced=spec["scope"] == "Namespaced", short_names=list(names.get("shortNames") or []),
            categories=list(names.get("categories") or []), status_subresource="status" in sub,
            scale=dict(scale) if scale is not None else None, has_generation=True, builtin=False,
            schema=(version.get("schema") or {}).get("openAPIV3Schema"),
            printer_columns=list(version.get("additionalPrinterColumns") or []),
            crd_name=crd["metadata"]["name"],
        ))
    return types
