"""ReplicaSet controller: keeps ``spec.replicas`` pods and reports their readiness."""
from __future__ import annotations

import copy
from typing import Any

from ..apiserver.api import Api
from ..apiserver.errors import ApiError
from .common import owned_by, owner_ref, pod_available, pod_ready, terminating

COMPONENT = "replicaset-controller"


def _deletion_rank(pod: dict[str, Any]) -> tuple[int, int, int, str]:
    """Which pods go first when scaling down: unscheduled, pending, not ready, newest."""
    status = pod.get("status") or {}
    restarts = sum(c.get("restartCount", 0) for c in status.get("containerStatuses") or [])
    return (0 if not pod.get("spec", {}).get("nodeName") else 1,
            0 if status.get("phase") != "Running" else 1,
            1 if pod_ready(pod) else 0,
            # newest first: negate by sorting on the reversed timestamp string below
            -restarts, ) + ("".join(chr(255 - ord(ch)) for ch in pod["metadata"].get("creationTimestamp", "")),)


def owned_pods(api: Api, rs: dict[str, Any], include_terminating: bool = False) -> list[dict[str, Any]]:
    ns = rs["metadata"]["namespace"]
    return [p for p in api.store.list("pods", ns) if owned_by(p, rs)
            and (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
            and (include_terminating or not terminating(p))]


def reconcile(api: Api, rs: dict[str, Any]) -> None:
    if terminating(rs):
        return
    rs = api.served(api.builtin("replicasets.apps"), rs)
    pods_rt = api.builtin("pods")
    ns = rs["metadata"]["namespace"]
    pods = owned_pods(api, rs)
    want = rs["spec"].get("replicas", 1)
    if len(pods) < want:
        template = copy.deepcopy(rs["spec"].get("template") or {})
        tmeta = template.get("metadata") or {}
        for _ in range(want - len(pods)):
            body = {"apiVersion": "v1", "kind": "Pod",
                    "metadata": {"generateName": rs["metadata"]["name"] + "-", "namespace": ns,
                                 "labels": dict(tmeta.get("labels") or {}),
                                 "annotations": dict(tmeta.get("annotations") or {}),
                                 "ownerReferences": [owner_ref(rs)]},
                    "spec": copy.deepcopy(template.get("spec") or {})}
            try:
                pod = api.create(pods_rt, ns, body)
            except ApiError as err:
                api.record_event(rs, "Warning", "FailedCreate", f"Error creating: {err.message}", COMPONENT)
                break
            api.record_event(rs, "Normal", "SuccessfulCreate", f"Created pod: {pod['metadata']['name']}", COMPONENT)
    elif len(pods) > want:
        for pod in sorted(pods, key=_deletion_rank)[: len(pods) - want]:
            try:
                api.delete(pods_rt, ns, pod["metadata"]["name"])
            except ApiError:
                continue
            api.record_event(rs, "Normal", "SuccessfulDelete", f"Deleted pod: {pod['metadata']['name']}", COMPONENT)
    pods = owned_pods(api, rs)
    min_ready = rs["spec"].get("minReadySeconds", 0)
    labels = ((rs["spec"].get("template") or {}).get("metadata") or {}).get("labels") or {}
    status = {
        "replicas": len(pods),
        "fullyLabeledReplicas": sum(1 for p in pods if labels.items() <= (p["metadata"].get("labels") or {}).items()),
        "readyReplicas": sum(1 for p in pods if pod_ready(p)),
        "availableReplicas": sum(1 for p in pods if pod_available(p, min_ready)),
        "terminatingReplicas": len(owned_pods(api, rs, include_terminating=True)) - len(pods),
        "observedGeneration": rs["metadata"].get("generation", 1),
    }
    # The API omits zero counts; keep the written form minimal and stable.
    status = {k: v for k, v in status.items() if v or k in ("replicas", "observedGeneration")}
    if rs.get("status") != status:
        try:
            api.update(api.builtin("replicasets.apps"), ns, rs["metadata"]["name"],
                       dict(rs, status=status), subresource="status")
        except ApiError:
            pass   # a concurrent write; the next pass recomputes
