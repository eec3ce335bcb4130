"""Helpers the controllers share: ownership, pod readiness, events."""
from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from ..apiserver.api import Api, now_iso
from ..apiserver.tables import parse_time


def controller_of(obj: dict[str, Any]) -> dict[str, Any] | None:
    for ref in obj["metadata"].get("ownerReferences") or []:
        if ref.get("controller"):
            return ref
    return None


def owned_by(obj: dict[str, Any], owner: dict[str, Any]) -> bool:
    ref = controller_of(obj)
    return ref is not None and ref.get("uid") == owner["metadata"]["uid"]


def owner_ref(owner: dict[str, Any], *, controller: bool = True) -> dict[str, Any]:
    return {"apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": owner["metadata"]["name"],
            "uid": owner["metadata"]["uid"], "controller": controller, "blockOwnerDeletion": True}


def terminating(obj: dict[str, Any]) -> bool:
    return bool(obj["metadata"].get("deletionTimestamp"))


def condition(obj: dict[str, Any], ctype: str) -> dict[str, Any] | None:
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c.get("type") == ctype:
            return c
    return None


def pod_ready(pod: dict[str, Any]) -> bool:
    c = condition(pod, "Ready")
    return c is not None and c.get("status") == "True"


def pod_available(pod: dict[str, Any], min_ready_seconds: int) -> bool:
    """Ready for at least ``minReadySeconds``, the Deployment/ReplicaSet definition of available."""
    if not pod_ready(pod) or terminating(pod):
        return False
    if min_ready_seconds <= 0:
        return True
    since = parse_time((condition(pod, "Ready") or {}).get("lastTransitionTime"))
    return since is not None and (datetime.now(timezone.utc) - since).total_seconds() >= min_ready_seconds


def set_condition(conditions: list[dict[str, Any]], ctype: str, status: str, reason: str = "", message: str = "",
                  with_update_time: bool = False) -> list[dict[str, Any]]:
    """Replace one condition, keeping lastTransitionTime unless the status flips."""
    out = []
    found = False
    for c in conditions:
        if c.get("type") == ctype:
            found = True
            new = dict(c, status=status, reason=reason, message=message)
            if c.get("status") != status:
                new["lastTransitionTime"] = now_iso()
                if with_update_time:
                    new["lastUpdateTime"] = now_iso()
            elif with_update_time and (c.get("reason") != reason or c.get("message") != message):
                new["lastUpdateTime"] = now_iso()
            out.append(new)
        else:
            out.append(c)
    if not found:
        new = {"type": ctype, "status": status, "reason": reason, "message": message,
               "lastTransitionTime": now_iso()}
        if with_update_time:
            new["lastUpdateTime"] = now_iso()
        out.append(new)
    return out


def event(api: Api, obj: dict[str, Any], etype: str, reason: str, message: str, component: str) -> None:
    api.record_event(obj, etype, reason, message, component)
