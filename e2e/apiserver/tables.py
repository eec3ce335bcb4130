"""``meta.k8s.io/v1 Table`` rendering, so ``kubectl get`` prints what a real cluster prints."""
from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Callable

from . import jsonpath
from .resources import ResourceType

TABLE_MEDIA = "as=Table"


def parse_time(text: str | None) -> datetime | None:
    if not text:
        return None
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def human_duration(seconds: float) -> str:
    """apimachinery's ``duration.HumanDuration``: 5s, 3m20s, 10m, 5h3m, 2d, 3y."""
    s = int(seconds)
    if s < 0:
        return "<invalid>"
    if s < 120:
        return f"{s}s"
    m = s // 60
    if m < 10:
        return f"{m}m{s % 60}s" if s % 60 else f"{m}m"
    if m < 180:
        return f"{m}m"
    h = s // 3600
    if h < 8:
        return f"{h}h{m % 60}m" if m % 60 else f"{h}h"
    if h < 48:
        return f"{h}h"
    d = h // 24
    if h < 24 * 8:
        return f"{d}d{h % 24}h" if h % 24 else f"{d}d"
    if d < 365 * 2:
        return f"{d}d"
    y = d // 365
    return f"{y}y{d % 365}d" if y < 8 and d % 365 else f"{y}y"


def age(obj: dict[str, Any], path: str = "creationTimestamp") -> str:
    ts = parse_time((obj.get("metadata") or {}).get(path))
    if ts is None:
        return "<unknown>"
    return human_duration((datetime.now(timezone.utc) - ts).total_seconds())


def _since(ts_text: str | None) -> str:
    ts = parse_time(ts_text)
    return "<unknown>" if ts is None else human_duration((datetime.now(timezone.utc) - ts).total_seconds())


Column = tuple[str, str, int, Callable[[dict[str, Any]], Any]]   # name, type, priority, getter


def _name(o: dict[str, Any]) -> str:
    return o["metadata"]["name"]


def _pod_status(pod: dict[str, Any]) -> str:
    if pod["metadata"].get("deletionTimestamp"):
        return "Terminating"
    status = pod.get("status") or {}
    reason = status.get("reason") or status.get("phase") or "Pending"
    for cs in status.get("containerStatuses") or []:
        state = cs.get("state") or {}
        if "waiting" in state and state["waiting"].get("reason"):
            reason = state["waiting"]["reason"]
        elif "terminated" in state and reason in ("Running", "Pending", "Succeeded", "Failed"):
            reason = state["terminated"].get("reason") or "Error"
    return reason


def _pod_ready(pod: dict[str, Any]) -> str:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    total = len(pod.get("spec", {}).get("containers") or [])
    return f"{sum(1 for c in statuses if c.get('ready'))}/{total}"


def _pod_restarts(pod: dict[str, Any]) -> int:
    return sum(c.get("restartCount", 0) for c in (pod.get("status") or {}).get("containerStatuses") or [])


def _svc_ports(svc: dict[str, Any]) -> str:
    ports = []
    for p in svc.get("spec", {}).get("ports") or []:
        text = f"{p.get('port')}"
        if p.get("nodePort"):
            text += f":{p['nodePort']}"
        ports.append(f"{text}/{p.get('protocol', 'TCP')}")
    return ",".join(ports) or "<none>"


def _endpoints(ep: dict[str, Any]) -> str:
    out = []
    for subset in ep.get("subsets") or []:
        for addr in subset.get("addresses") or []:
            for port in subset.get("ports") or [{}]:
                out.append(f"{addr['ip']}:{port.get('port')}" if port else addr["ip"])
    if not out:
        return "<none>"
    return ",".join(out[:3]) + (f" + {len(out) - 3} more..." if len(out) > 3 else "")


def _containers(field: str) -> Callable[[dict[str, Any]], str]:
    return lambda o: ",".join(c.get(field, "") for c in o.get("spec", {}).get("template", {}).get("spec", {})
                              .get("containers") or [])


def _event_object(ev: dict[str, Any]) -> str:
    io = ev.get("involvedObject") or ev.get("regarding") or {}
    return f"{(io.get('kind') or '').lower()}/{io.get('name', '')}"


def _event_last_seen(ev: dict[str, Any]) -> str:
    return _since(ev.get("lastTimestamp") or ev.get("eventTime") or ev["metadata"].get("creationTimestamp"))


def _ns_status(ns: dict[str, Any]) -> str:
    return (ns.get("status") or {}).get("phase", "Active")


def _node_status(node: dict[str, Any]) -> str:
    for c in (node.get("status") or {}).get("conditions") or []:
        if c.get("type") == "Ready":
            return "Ready" if c.get("status") == "True" else "NotReady"
    return "Unknown"


def _job_status(job: dict[str, Any]) -> str:
    for c in (job.get("status") or {}).get("conditions") or []:
        if c.get("type") in ("Complete", "Failed") and c.get("status") == "True":
            return c["type"]
    return "Suspended" if job.get("spec", {}).get("suspend") else "Running"


def _job_duration(job: dict[str, Any]) -> str:
    status = job.get("status") or {}
    start, end = parse_time(status.get("startTime")), parse_time(status.get("completionTime"))
    if start is None:
        return ""
    return human_duration(((end or datetime.now(timezone.utc)) - start).total_seconds())


_AGE: Column = ("Age", "string", 0, age)
_NAME: Column = ("Name", "string", 0, _name)

BUILTIN_COLUMNS: dict[str, list[Column]] = {
    "pods": [_NAME, ("Ready", "string", 0, _pod_ready), ("Status", "string", 0, _pod_status),
             ("Restarts", "string", 0, lambda o: str(_pod_restarts(o))), _AGE,
             ("IP", "string", 1, lambda o: (o.get("status") or {}).get("podIP") or "<none>"),
             ("Node", "string", 1, lambda o: o.get("spec", {}).get("nodeName") or "<none>"),
             ("Nominated Node", "string", 1, lambda o: (o.get("status") or {}).get("nominatedNodeName") or "<none>"),
             ("Readiness Gates", "string", 1, lambda o: "<none>")],
    "deployments.apps": [
        _NAME,
        ("Ready", "string", 0, lambda o: f"{(o.get('status') or {}).get('readyReplicas', 0)}/"
                                         f"{o.get('spec', {}).get('replicas', 1)}"),
        ("Up-to-date", "integer", 0, lambda o: (o.get("status") or {}).get("updatedReplicas", 0)),
        ("Available", "integer", 0, lambda o: (o.get("status") or {}).get("availableReplicas", 0)),
        _AGE,
        ("Containers", "string", 1, _containers("name")), ("Images", "string", 1, _containers("image"))],
    "replicasets.apps": [
        _NAME, ("Desired", "integer", 0, lambda o: o.get("spec", {}).get("replicas", 1)),
        ("Current", "integer", 0, lambda o: (o.get("status") or {}).get("replicas", 0)),
        ("Ready", "integer", 0, lambda o: (o.get("status") or {}).get("readyReplicas", 0)), _AGE],
    "services": [
        _NAME, ("Type", "string", 0, lambda o: o.get("spec", {}).get("type", "ClusterIP")),
        ("Cluster-IP", "string", 0, lambda o: o.get("spec", {}).get("clusterIP") or "<none>"),
        ("External-IP", "string", 0, lambda o: "<none>"), ("Port(s)", "string", 0, _svc_ports), _AGE],
    "endpoints": [_NAME, ("Endpoints", "string", 0, _endpoints), _AGE],
    "configmaps": [_NAME, ("Data", "integer", 0, lambda o: len(o.get("data") or {}) + len(o.get("binaryData") or {})),
                   _AGE],
    "secrets": [_NAME, ("Type", "string", 0, lambda o: o.get("type", "Opaque")),
                ("Data", "integer", 0, lambda o: len(o.get("data") or {})), _AGE],
    "namespaces": [_NAME, ("Status", "string", 0, _ns_status), _AGE],
    "nodes": [_NAME, ("Status", "string", 0, _node_status), ("Roles", "string", 0, lambda o: "<none>"), _AGE,
              ("Version", "string", 0, lambda o: (o.get("status") or {}).get("nodeInfo", {}).get("kubeletVersion", ""))],
    "events": [("Last Seen", "string", 0, _event_last_seen), ("Type", "string", 0, lambda o: o.get("type", "")),
               ("Reason", "string", 0, lambda o: o.get("reason", "")), ("Object", "string", 0, _event_object),
               ("Message", "string", 0, lambda o: o.get("message") or o.get("note") or "")],
    "jobs.batch": [
        _NAME, ("Status", "string", 0, lambda o: _job_status(o)),
        ("Completions", "string", 0, lambda o: f"{(o.get('status') or {}).get('succeeded', 0)}/"
                                               f"{o.get('spec', {}).get('completions', 1)}"),
        ("Duration", "string", 0, lambda o: _job_duration(o)), _AGE],
    "endpointslices.discovery.k8s.io": [
        _NAME, ("AddressType", "string", 0, lambda o: o.get("addressType", "")),
        ("Ports", "string", 0, lambda o: ",".join(str(p.get("port")) for p in o.get("ports") or []) or "<unset>"),
        ("Endpoints", "string", 0, lambda o: ",".join(a for e in o.get("endpoints") or []
                                                      for a in e.get("addresses") or []) or "<unset>"), _AGE],
    "customresourcedefinitions.apiextensions.k8s.io": [
        _NAME, ("Created At", "date", 0, lambda o: o["metadata"].get("creationTimestamp"))],
}


def _crd_columns(rt: ResourceType) -> list[Column]:
    if not rt.printer_columns:
        return [_NAME, _AGE]
    columns: list[Column] = [_NAME]
    for col in rt.printer_columns:
        path = col["jsonPath"]
        ctype = col.get("type", "string")

        def getter(o: dict[str, Any], path: str = path, ctype: str = ctype) -> Any:
            values = jsonpath.evaluate(o, path)
            if not values:
                return None
            value = values[0] if len(values) == 1 else ",".join(str(v) for v in values)
            if ctype == "date":
                return _since(value) if isinstance(value, str) else None
            if isinstance(value, (dict, list)):
                import json
                return json.dumps(value)
            return value

        columns.append((col["name"], "string" if ctype == "date" else ctype, col.get("priority", 0), getter))
    return columns


def columns_for(rt: ResourceType) -> list[Column]:
    if rt.crd_name:
        return _crd_columns(rt)
    return BUILTIN_COLUMNS.get(rt.storage_key, [_NAME, _AGE])


def column_definitions(rt: ResourceType) -> list[dict[str, Any]]:
    return [{"name": name, "type": ctype, "format": "name" if name == "Name" else "", "description": name,
             "priority": priority} for name, ctype, priority, _ in columns_for(rt)]


def row(rt: ResourceType, obj: dict[str, Any]) -> dict[str, Any]:
    cells = []
    for _, _, _, getter in columns_for(rt):
        try:
            cells.append(getter(obj))
        except (KeyError, TypeError, ValueError, AttributeError):
            cells.append(None)
    return {"cells": cells, "object": obj}


def table(rt: ResourceType, objects: list[dict[str, Any]], list_meta: dict[str, Any],
          include_columns: bool = True) -> dict[str, Any]:
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": list_meta,
        "columnDefinitions": column_definitions(rt) if include_columns else [],
        "rows": [row(rt, o) for o in objects],
    }


def wants_table(accept: str | None) -> bool:
    """True when the first acceptable media type asks for a Table (kubectl get does)."""
    if not accept:
        return False
    first = accept.split(",")[0]
    return "as=Table" in first
