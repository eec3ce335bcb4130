"""Idempotent apply of child manifests through the API server (the operator's only writes besides status).

Each child carries an annotation with the hash of the manifest the operator last applied; a child whose
hash matches is left alone (no write, no resourceVersion bump), so re-running reconcile -- also after an
operator restart -- changes nothing. Otherwise the manifest is server-side applied (field manager
``pagedmodel-operator``, ``force``: the operator's fields are the operator's): fields other managers own
-- a person's ``kubectl apply --server-side`` label, the Service's allocated IPs, the Deployment
controller's revision annotation -- are kept, and fields the operator stops setting are removed.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException

from . import names
from .desired_state import config_hash

ANNOTATION_APPLIED = "pagedmodel.io/applied-hash"
FIELD_MANAGER = "pagedmodel-operator"
APPLY_PATCH = "application/apply-patch+yaml"
MERGE_PATCH = "application/merge-patch+json"

# kind -> (API prefix, plural) of every child kind the operator manages (and nothing else: see the chart's RBAC).
PATHS: dict[str, tuple[str, str]] = {
    "ServiceAccount": ("/api/v1", "serviceaccounts"),
    "Service": ("/api/v1", "services"),
    "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings"),
    "Deployment": ("/apis/apps/v1", "deployments"),
    "PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets"),
}


@dataclass(frozen=True)
class Applied:
    kind: str
    name: str
    action: str                        # created | updated | unchanged
    previous: dict[str, Any] | None    # the live object before an update


class Kube:
    """The few REST calls the operator makes, over one kubernetes.client.ApiClient."""

    def __init__(self, api: ApiClient) -> None:
        self.api = api

    def _call(self, method: str, path: str, body: Any = None, query: list[tuple[str, str]] | None = None,
              content_type: str = "application/json") -> Any:
        # kubernetes>=35 generates param_serialize/call_api; serialising here keeps auth and host handling its own.
        _method, url, headers, payload, _ = self.api.param_serialize(
            method, path, query_params=query or [], body=body, auth_settings=["BearerToken"],
            header_params={"Accept": "application/json", "Content-Type": content_type})
        response = self.api.call_api(_method, url, header_params=headers, body=payload, _request_timeout=30)
        response.read()
        data = response.data or b""
        if not 200 <= response.status < 300:
            raise ApiException(status=response.status, reason=response.reason,
                               http_resp=None) if not data else _api_error(response.status, response.reason, data)
        return json.loads(data) if data else None

    @staticmethod
    def path(kind: str, namespace: str, name: str | None = None) -> str:
        prefix, plural = PATHS[kind]
        base = f"{prefix}/namespaces/{quote(namespace)}/{plural}"
        return f"{base}/{quote(name)}" if name else base

    def get(self, path: str) -> dict[str, Any] | None:
        try:
            return self._call("GET", path)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def list(self, path: str, label_selector: str) -> list[dict[str, Any]]:
        query = [("labelSelector", label_selector)] if label_selector else []
        return list((self._call("GET", path, query=query) or {}).get("items") or [])

    def exists(self, namespace: str, plural: str, name: str) -> bool:
        return self.get(f"/api/v1/namespaces/{quote(namespace)}/{plural}/{quote(name)}") is not None

    def pods(self, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        return self.list(f"/api/v1/namespaces/{quote(namespace)}/pods", label_selector)

    def external_autoscaler(self, namespace: str, model: str) -> str | None:
        """The name of a HorizontalPodAutoscaler that scales this PagedModel (through its scale
        subresource), if any: then the built-in autoscaler stands aside."""
        try:
            hpas = self.list(f"/apis/autoscaling/v2/namespaces/{quote(namespace)}/horizontalpodautoscalers", "")
        except ApiException as exc:
            if exc.status in (403, 404):      # no RBAC for it or no such API: nothing to defer to
                return None
            raise
        for hpa in hpas:
            ref = (hpa.get("spec") or {}).get("scaleTargetRef") or {}
            if ref.get("kind") == names.KIND and ref.get("name") == model and \
                    str(ref.get("apiVersion", "")).split("/")[0] == names.GROUP:
                return (hpa.get("metadata") or {}).get("name")
        return None

    def patch_status(self, namespace: str, name: str, fields: dict[str, Any]) -> None:
        """Merge `fields` into the PagedModel's status now (a merge patch: None deletes a field). The one way
        the operator writes status: the reconcile pass calls it, kopf's handler patch carries none."""
        path = f"/apis/{names.GROUP}/{names.VERSION}/namespaces/{quote(namespace)}/{names.PLURAL}/{quote(name)}/status"
        self._call("PATCH", path, {"status": fields}, content_type=MERGE_PATCH)

    def apply(self, manifest: dict[str, Any]) -> Applied:
        meta = manifest["metadata"]
        kind, name, namespace = manifest["kind"], meta["name"], meta["namespace"]
        digest = config_hash(manifest)
        body = copy.deepcopy(manifest)
        body["metadata"].setdefault("annotations", {})[ANNOTATION_APPLIED] = digest
        live = self.get(self.path(kind, namespace, name))
        if live is not None:
            same = ((live.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_APPLIED) == digest
            # The one drift worth undoing without a spec change: someone scaled our Deployment by hand.
            if kind == "Deployment" and (live.get("spec") or {}).get("replicas") != manifest["spec"]["replicas"]:
                same = False
            if same:
                return Applied(kind, name, "unchanged", live)
        # JSON is YAML: the apply body is the manifest itself.
        self._call("PATCH", self.path(kind, namespace, name), body, content_type=APPLY_PATCH,
                   query=[("fieldManager", FIELD_MANAGER), ("force", "true")])
        return Applied(kind, name, "created" if live is None else "updated", live)


def _api_error(status: int, reason: str | None, data: bytes) -> ApiException:
    exc = ApiException(status=status, reason=reason)
    exc.body = data.decode("utf-8", "replace")
    return exc
