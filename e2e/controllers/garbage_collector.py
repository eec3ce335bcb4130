"""Garbage collector: ownerReference cascades (background, foreground, orphan) and CRD cleanup."""
from __future__ import annotations

import copy
from typing import Any

from ..apiserver.api import Api
from ..apiserver.crds import CLEANUP_FINALIZER
from ..apiserver.errors import ApiError
from ..apiserver.resources import ResourceType


def _served_types(api: Api) -> dict[str, ResourceType]:
    """One served type per storage (the first registered), to read and write through."""
    out: dict[str, ResourceType] = {}
    for rt in api.registry.all():
        out.setdefault(rt.storage_key, rt)
    return out


def _drop_finalizer(api: Api, rt: ResourceType, obj: dict[str, Any], finalizer: str) -> None:
    body = api.served(rt, obj)
    body["metadata"]["finalizers"] = [f for f in body["metadata"].get("finalizers") or [] if f != finalizer]
    try:
        api.update(rt, obj["metadata"].get("namespace"), obj["metadata"]["name"], body)
    except ApiError:
        pass


def collect(api: Api) -> None:
    types = _served_types(api)
    objects: list[tuple[ResourceType, dict[str, Any]]] = []
    for storage, rt in types.items():
        objects.extend((rt, obj) for obj in api.store.list(storage))
    by_uid = {obj["metadata"]["uid"]: (rt, obj) for rt, obj in objects}
    dependents: dict[str, list[tuple[ResourceType, dict[str, Any]]]] = {}
    for rt, obj in objects:
        for ref in obj["metadata"].get("ownerReferences") or []:
            dependents.setdefault(ref.get("uid", ""), []).append((rt, obj))

    for rt, obj in objects:
        meta = obj["metadata"]
        refs = meta.get("ownerReferences") or []
        if refs and not meta.get("deletionTimestamp"):
            owners = []
            for ref in refs:
                owner = by_uid.get(ref.get("uid", ""))
                known = api.registry.by_kind(ref.get("apiVersion", ""), ref.get("kind", "")) is not None
                owners.append(owner if owner is not None else (None if known else "unknown"))
            if all(o is None for o in owners):
                _delete(api, rt, obj, "Background")
            elif any(o not in (None, "unknown") and "foregroundDeletion" in (o[1]["metadata"].get("finalizers") or [])
                     and o[1]["metadata"].get("deletionTimestamp") for o in owners):
                _delete(api, rt, obj, "Foreground")
        if not meta.get("deletionTimestamp"):
            continue
        finalizers = meta.get("finalizers") or []
        if "foregroundDeletion" in finalizers and not dependents.get(meta["uid"]):
            _drop_finalizer(api, rt, obj, "foregroundDeletion")
        if "orphan" in finalizers:
            for drt, dep in dependents.get(meta["uid"], []):
                body = api.served(drt, dep)
                body["metadata"]["ownerReferences"] = [r for r in body["metadata"]["ownerReferences"]
                                                       if r.get("uid") != meta["uid"]]
                try:
                    api.update(drt, dep["metadata"].get("namespace"), dep["metadata"]["name"], body)
                except ApiError:
                    pass
            _drop_finalizer(api, rt, api.store.get(rt.storage_key, meta.get("namespace", ""), meta["name"]) or obj,
                            "orphan")
        if CLEANUP_FINALIZER in finalizers and rt.storage_key == "customresourcedefinitions.apiextensions.k8s.io":
            _cleanup_crd(api, rt, obj)


def _delete(api: Api, rt: ResourceType, obj: dict[str, Any], policy: str) -> None:
    try:
        api.delete(rt, obj["metadata"].get("namespace"), obj["metadata"]["name"], {"propagationPolicy": policy})
    except ApiError:
        pass


def _cleanup_crd(api: Api, rt: ResourceType, crd: dict[str, Any]) -> None:
    spec = crd["spec"]
    storage = f"{spec['names']['plural']}.{spec['group']}"
    crs = [cr_rt for cr_rt in api.registry.all() if cr_rt.storage_key == storage]
    remaining = api.store.list(storage)
    if crs:
        for obj in remaining:
            if not obj["metadata"].get("deletionTimestamp"):
                _delete(api, crs[0], copy.deepcopy(obj), "Background")
    if not api.store.list(storage):
        _drop_finalizer(api, rt, crd, CLEANUP_FINALIZER)
