"""A one-node scheduler: binds pods that fit the node's allocatable resources, else leaves them Pending."""
from __future__ import annotations

from decimal import Decimal
from typing import Any

from ..apiserver.api import Api
from ..apiserver.errors import ApiError
from .common import condition, set_condition, terminating
from .quantity import parse_quantity

COMPONENT = "default-scheduler"


def pod_requests(pod: dict[str, Any]) -> dict[str, Decimal]:
    """Sum of container requests (limits stand in for absent requests, as the API defaults them)."""
    total: dict[str, Decimal] = {}
    for c in pod.get("spec", {}).get("containers") or []:
        resources = c.get("resources") or {}
        merged = dict(resources.get("limits") or {})
        merged.update(resources.get("requests") or {})
        for name, value in merged.items():
            total[name] = total.get(name, Decimal(0)) + parse_quantity(value)
    return total


def _active(pod: dict[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")


def schedule(api: Api, node: dict[str, Any]) -> None:
    pods_rt = api.builtin("pods")
    node_name = node["metadata"]["name"]
    allocatable = {k: parse_quantity(v) for k, v in (node.get("status") or {}).get("allocatable", {}).items()}
    all_pods = api.store.list("pods")
    bound = [p for p in all_pods if p.get("spec", {}).get("nodeName") == node_name and _active(p)]
    used: dict[str, Decimal] = {}
    for p in bound:
        for k, v in pod_requests(p).items():
            used[k] = used.get(k, Decimal(0)) + v
    pending = sorted((p for p in all_pods if not p.get("spec", {}).get("nodeName") and not terminating(p)),
                     key=lambda p: p["metadata"]["creationTimestamp"])
    for stored in pending:
        pod = api.served(pods_rt, stored)
        ns, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
        reasons = []
        selector = pod["spec"].get("nodeSelector") or {}
        labels = node["metadata"].get("labels") or {}
        if any(labels.get(k) != v for k, v in selector.items()):
            reasons.append("1 node(s) didn't match Pod's node affinity/selector")
        if len(bound) + 1 > allocatable.get("pods", Decimal(110)):
            reasons.append("1 Too many pods")
        for resource, amount in sorted(pod_requests(pod).items()):
            if amount > 0 and used.get(resource, Decimal(0)) + amount > allocatable.get(resource, Decimal(0)):
                reasons.append(f"1 Insufficient {resource}")
        try:
            if reasons:
                message = f"0/1 nodes are available: {', '.join(reasons)}. preemption: 0/1 nodes are available: " \
                          f"1 No preemption victims found for incoming pod."
                old = condition(pod, "PodScheduled")
                if old and old.get("message") == message:
                    continue
                status = dict(pod.get("status") or {})
                status["conditions"] = set_condition(list(status.get("conditions") or []), "PodScheduled", "False",
                                                     "Unschedulable", message)
                api.update(pods_rt, ns, name, dict(pod, status=status), subresource="status")
                api.record_event(pod, "Warning", "FailedScheduling", message, COMPONENT)
                continue
            pod["spec"]["nodeName"] = node_name
            pod = api.update(pods_rt, ns, name, pod)
            status = dict(pod.get("status") or {})
            status["conditions"] = set_condition(list(status.get("conditions") or []), "PodScheduled", "True")
            api.update(pods_rt, ns, name, dict(pod, status=status), subresource="status")
            api.record_event(pod, "Normal", "Scheduled", f"Successfully assigned {ns}/{name} to {node_name}",
                             COMPONENT)
        except ApiError:
            continue
        bound.append(pod)
        for k, v in pod_requests(pod).items():
            used[k] = used.get(k, Decimal(0)) + v

