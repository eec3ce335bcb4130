"""Endpoints and EndpointSlice controllers: a Service's selected pods, ready or not, by loopback IP."""
from __future__ import annotations

import hashlib
from typing import Any

from ..apiserver.api import Api
from ..apiserver.errors import ApiError
from ..apiserver.selectors import Requirement, labels_match
from .common import owner_ref, pod_ready, terminating

MANAGED_BY = "endpointslice-controller.k8s.io"
TRIGGER = "endpoints.kubernetes.io/last-change-trigger-time"


def _selector(svc: dict[str, Any]) -> list[Requirement] | None:
    sel = (svc.get("spec") or {}).get("selector")
    if not sel:
        return None
    return [Requirement(k, "=", (str(v),)) for k, v in sel.items()]


def _target_port(port: dict[str, Any], pod: dict[str, Any]) -> int | None:
    target = port.get("targetPort", port.get("port"))
    if isinstance(target, int):
        return target
    if isinstance(target, str) and target.isdigit():
        return int(target)
    for c in pod.get("spec", {}).get("containers") or []:
        for p in c.get("ports") or []:
            if p.get("name") == target:
                return p.get("containerPort")
    return None


def _pod_ref(pod: dict[str, Any]) -> dict[str, Any]:
    return {"kind": "Pod", "name": pod["metadata"]["name"], "namespace": pod["metadata"]["namespace"],
            "uid": pod["metadata"]["uid"]}


def desired_subsets(svc: dict[str, Any], pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    groups: dict[tuple[Any, ...], dict[str, Any]] = {}
    for pod in pods:
        if terminating(pod):
            continue
        ports = []
        for port in svc["spec"].get("ports") or []:
            number = _target_port(port, pod)
            if number is None:
                continue
            entry = {"port": number, "protocol": port.get("protocol", "TCP")}
            if port.get("name"):
                entry["name"] = port["name"]
            ports.append(entry)
        key = tuple(sorted((p.get("name", ""), p["port"]) for p in ports))
        group = groups.setdefault(key, {"ports": ports, "addresses": [], "notReadyAddresses": []})
        address = {"ip": pod["status"]["podIP"], "nodeName": pod["spec"].get("nodeName", ""),
                   "targetRef": _pod_ref(pod)}
        group["addresses" if pod_ready(pod) else "notReadyAddresses"].append(address)
    subsets = []
    for group in groups.values():
        subset = {k: sorted(v, key=lambda a: a["ip"]) if k != "ports" else v for k, v in group.items() if v}
        if subset.get("addresses") or subset.get("notReadyAddresses"):
            subsets.append(subset)
    return sorted(subsets, key=lambda s: str(s.get("ports")))


def _slice_name(svc: dict[str, Any]) -> str:
    return f"{svc['metadata']['name']}-{hashlib.sha256(svc['metadata']['uid'].encode()).hexdigest()[:5]}"


def desired_slice(svc: dict[str, Any], pods: list[dict[str, Any]]) -> dict[str, Any]:
    endpoints = []
    ports: list[dict[str, Any]] = []
    for pod in sorted(pods, key=lambda p: p["status"]["podIP"]):
        ready = pod_ready(pod) and not terminating(pod)
        endpoints.append({"addresses": [pod["status"]["podIP"]],
                          "conditions": {"ready": ready, "serving": pod_ready(pod), "terminating": terminating(pod)},
                          "targetRef": _pod_ref(pod), "nodeName": pod["spec"].get("nodeName", "")})
        if not ports:
            for port in svc["spec"].get("ports") or []:
                number = _target_port(port, pod)
                if number is not None:
                    ports.append({"name": port.get("name", ""), "port": number, "protocol": port.get("protocol", "TCP")})
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": _slice_name(svc), "namespace": svc["metadata"]["namespace"],
                         "labels": {"kubernetes.io/service-name": svc["metadata"]["name"],
                                    "endpointslice.kubernetes.io/managed-by": MANAGED_BY},
                         "ownerReferences": [owner_ref(svc)]},
            "addressType": "IPv4", "endpoints": endpoints, "ports": ports}


def reconcile_namespace(api: Api, ns: str) -> None:
    ep_rt, slice_rt = api.builtin("endpoints"), api.builtin("endpointslices.discovery.k8s.io")
    services = {s["metadata"]["name"]: s for s in api.store.list("services", ns)}
    pods = [p for p in api.store.list("pods", ns) if (p.get("status") or {}).get("podIP")]
    for name, stored in services.items():
        svc = api.served(api.builtin("services"), stored)
        selector = _selector(svc)
        if selector is None or terminating(svc):
            continue
        selected = [p for p in pods if labels_match(selector, p)]
        subsets = desired_subsets(svc, selected)
        current = api.store.peek("endpoints", ns, name)
        body = {"apiVersion": "v1", "kind": "Endpoints",
                "metadata": {"name": name, "namespace": ns, "labels": dict(svc["metadata"].get("labels") or {}),
                             "annotations": {TRIGGER: svc["metadata"]["creationTimestamp"]}}}
        if subsets:
            body["subsets"] = subsets
        try:
            if current is None:
                api.create(ep_rt, ns, body)
            elif current.get("subsets") != body.get("subsets") or \
                    current["metadata"].get("labels") != body["metadata"]["labels"]:
                body["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
                api.update(ep_rt, ns, name, body)
            wanted = desired_slice(svc, selected)
            existing = api.store.peek("endpointslices.discovery.k8s.io", ns, wanted["metadata"]["name"])
            if existing is None:
                api.create(slice_rt, ns, wanted)
            elif (existing.get("endpoints"), existing.get("ports")) != (wanted["endpoints"], wanted["ports"]):
                wanted["metadata"]["resourceVersion"] = existing["metadata"]["resourceVersion"]
                api.update(slice_rt, ns, wanted["metadata"]["name"], wanted)
        except ApiError:
            continue   # raced with another writer; next pass
    for ep in api.store.list("endpoints", ns):
        name = ep["metadata"]["name"]
        if name not in services and TRIGGER in (ep["metadata"].get("annotations") or {}):
            try:
                api.delete(ep_rt, ns, name)
            except ApiError:
                pass
