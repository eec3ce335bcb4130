"""Small helpers shared by the e2e tests: raw API calls, polling, manifests."""
from __future__ import annotations

import json
import time
from typing import Any, Callable, TypeVar

T = TypeVar("T")


def raw(client: Any, method: str, path: str, *, query: dict[str, Any] | None = None, body: Any = None,
        headers: dict[str, str] | None = None, timeout: float = 30) -> tuple[int, Any, dict[str, str]]:
    """One HTTP call through the client's auth and TLS settings; returns (status, decoded body, headers)."""
    from kubernetes.client.exceptions import ApiException

    hdrs = {"Accept": "application/json", **(headers or {})}
    if body is not None:
        hdrs.setdefault("Content-Type", "application/json")
    try:
        m, url, hdrs, body, _ = client.param_serialize(method=method, resource_path=path,
                                                       query_params=list((query or {}).items()), header_params=hdrs,
                                                       body=body, auth_settings=["BearerToken"])
        resp = client.call_api(m, url, header_params=hdrs, body=body, _request_timeout=timeout)
        status, data, resp_headers = resp.status, resp.read(), dict(resp.headers)
    except ApiException as exc:
        status, data, resp_headers = exc.status, exc.body, dict(exc.headers or {})
    text = data.decode() if isinstance(data, bytes) else data
    try:
        return status, json.loads(text), resp_headers
    except (TypeError, ValueError):
        return status, text, resp_headers


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
