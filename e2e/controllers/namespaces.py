"""Namespace controller: empties terminating namespaces, then releases them; default service accounts."""
from __future__ import annotations

from typing import Any

from ..apiserver.api import Api
from ..apiserver.errors import ApiError


def reconcile(api: Api, ns: dict[str, Any]) -> None:
    name = ns["metadata"]["name"]
    ns_rt = api.builtin("namespaces")
    if not ns["metadata"].get("deletionTimestamp"):
        if api.store.peek("serviceaccounts", name, "default") is None:
            try:
                api.create(api.builtin("serviceaccounts"), name, {"metadata": {"name": "default"}})
            except ApiError:
                pass
        return
    remaining = 0
    for rt in api.registry.all():
        if not rt.namespaced or rt.group == "events.k8s.io":
            continue
        for obj in api.store.list(rt.storage_key, name):
            remaining += 1
            if obj["metadata"].get("deletionTimestamp"):
                continue
            try:
                api.delete(rt, name, obj["metadata"]["name"], {"propagationPolicy": "Background"})
            except ApiError:
                pass
    if remaining == 0 and (ns.get("spec") or {}).get("finalizers"):
        body = api.get(ns_rt, None, name)
        body["spec"]["finalizers"] = []
        try:
            api.update(ns_rt, None, name, body)
        except ApiError:
            pass
