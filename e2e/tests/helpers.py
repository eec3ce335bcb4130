"""Small helpers shared by the e2e tests: polling, manifests."""
from __future__ import annotations

import time
from typing import Any, Callable, TypeVar

T = TypeVar("T")


def wait_until(check: Callable[[], T], timeout: float = 30, interval: float = 0.2, what: str = "condition") -> T:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except AssertionError as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")


WIDGET_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.e2e.pagedmodel.io"},
    "spec": {
        "group": "e2e.pagedmodel.io", "scope": "Namespaced",
        "names": {"plural": "widgets", "singular": "widget", "kind": "Widget", "shortNames": ["wdg"],
                  "categories": ["e2e"]},
        "versions": [{
            "name": "v1", "served": True, "storage": True,
            "subresources": {"status": {}, "scale": {"specReplicasPath": ".spec.replicas",
                                                    "statusReplicasPath": ".status.replicas",
                                                    "labelSelectorPath": ".status.selector"}},
            "additionalPrinterColumns": [
                {"name": "Size", "type": "integer", "jsonPath": ".spec.size"},
                {"name": "Color", "type": "string", "jsonPath": ".spec.color"},
                {"name": "Ready", "type": "string", "jsonPath": ".status.conditions[?(@.type==\"Ready\")].status"},
                {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
            ],
            "schema": {"openAPIV3Schema": {
                "type": "object",
                "properties": {
                    "spec": {"type": "object", "required": ["size"], "properties": {
                        "size": {"type": "integer", "minimum": 1, "maximum": 10},
                        "color": {"type": "string", "enum": ["red", "blue"], "default": "red"},
                        "name": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 8},
                        "replicas": {"type": "integer", "minimum": 0, "default": 1},
                        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
                        "extra": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                    }},
                    # kopf records handler results in status; keep what the schema does not list.
                    "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True, "properties": {
                        "replicas": {"type": "integer"}, "selector": {"type": "string"},
                        "phase": {"type": "string"},
                        "conditions": {"type": "array", "items": {
                            "type": "object", "properties": {"type": {"type": "string"},
                                                             "status": {"type": "string"}}}},
                    }},
                },
            }},
        }],
    },
}
