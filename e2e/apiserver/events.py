"""Conversion between core/v1 Events (the stored form) and events.k8s.io/v1 Events."""
from __future__ import annotations

from typing import Any

# events.k8s.io/v1 field -> core/v1 field
_RENAMES = {
    "regarding": "involvedObject",
    "note": "message",
    "deprecatedSource": "source",
    "deprecatedFirstTimestamp": "firstTimestamp",
    "deprecatedLastTimestamp": "lastTimestamp",
    "deprecatedCount": "count",
    "reportingController": "reportingComponent",
}
_SHARED = ("reason", "type", "action", "related", "eventTime", "reportingInstance", "series")


def to_core(event: dict[str, Any]) -> dict[str, Any]:
    core: dict[str, Any] = {"apiVersion": "v1", "kind": "Event", "metadata": event.get("metadata", {})}
    for new, old in _RENAMES.items():
        if new in event:
            core[old] = event[new]
    for name in _SHARED:
        if name in event:
            core[name] = event[name]
    return core


def from_core(core: dict[str, Any]) -> dict[str, Any]:
    event: dict[str, Any] = {"apiVersion": "events.k8s.io/v1", "kind": "Event", "metadata": core.get("metadata", {})}
    for new, old in _RENAMES.items():
        if old in core:
            event[new] = core[old]
    for name in _SHARED:
        if core.get(name) is not None:
            event[name] = core[name]
    if not event.get("eventTime"):
        # eventTime is required in events.k8s.io/v1; legacy events only carry second-precision stamps.
        stamp = core.get("firstTimestamp") or core.get("metadata", {}).get("creationTimestamp")
        if stamp:
            event["eventTime"] = stamp.replace("Z", ".000000Z") if "." not in stamp else stamp
    return event
