"""The resource types the emulator serves: built-in kinds plus whatever CRDs register."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ALL_VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]


@dataclass
class ResourceType:
    """One served resource (a plural in a group/version) and how it behaves."""

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    short_names: list[str] = field(default_factory=list)
    categories: list[str] = field(default_factory=list)
    verbs: list[str] = field(default_factory=lambda: list(ALL_VERBS))
    status_subresource: bool = False
    # scale subresource: JSON paths (dotted, without leading dot) or None
    scale: dict[str, str] | None = None
    has_generation: bool = False
    builtin: bool = True
    # For CRDs: the version's openAPIV3Schema, printer columns, and the CRD's name.
    schema: dict[str, Any] | None = None
    printer_columns: list[dict[str, Any]] = field(default_factory=list)
    crd_name: str | None = None
    # Several served resources can share one storage (core/v1 and events.k8s.io/v1 Events).
    storage: str | None = None
    extra_subresources: list[str] = field(default_factory=list)

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def storage_key(self) -> str:
        return self.storage or (f"{self.plural}.{self.group}" if self.group else self.plural)

    @property
    def singular(self) -> str:
        return self.kind.lower()

    @property
    def list_kind(self) -> str:
        return self.kind + "List"


def _b(group: str, version: str, plural: str, kind: str, namespaced: bool = True, **kw: Any) -> ResourceType:
    return ResourceType(group=group, version=version, plural=plural, kind=kind, namespaced=namespaced, **kw)


def builtin_types() -> list[ResourceType]:
    """Built-in kinds. Scale paths follow the real subresource (spec.replicas/status.replicas)."""
    rs_scale = {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
                "labelSelectorPath": ".status.selector"}
    return [
        _b("", "v1", "namespaces", "Namespace", False, short_names=["ns"], status_subresource=True,
           verbs=["create", "delete", "get", "list", "patch", "update", "watch"], extra_subresources=["finalize"]),
        _b("", "v1", "nodes", "Node", False, short_names=["no"], status_subresource=True),
        _b("", "v1", "configmaps", "ConfigMap", short_names=["cm"]),
        _b("", "v1", "secrets", "Secret"),
        _b("", "v1", "services", "Service", short_names=["svc"], categories=["all"], status_subresource=True),
        _b("", "v1", "endpoints", "Endpoints", short_names=["ep"]),
        _b("", "v1", "pods", "Pod", short_names=["po"], categories=["all"], status_subresource=True,
           extra_subresources=["log", "exec"]),
        _b("", "v1", "events", "Event", short_names=["ev"], storage="events"),
        _b("", "v1", "serviceaccounts", "ServiceAccount", short_names=["sa"]),
        _b("", "v1", "persistentvolumeclaims", "PersistentVolumeClaim", short_names=["pvc"], status_subresource=True),
        _b("apps", "v1", "deployments", "Deployment", short_names=["deploy"], categories=["all"],
           status_subresource=True, has_generation=True,
           scale={"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
                  "labelSelectorPath": ".status.selector"}),
        _b("apps", "v1", "replicasets", "ReplicaSet", short_names=["rs"], categories=["all"],
           status_subresource=True, has_generation=True, scale=rs_scale),
        _b("apps", "v1", "statefulsets", "StatefulSet", short_names=["sts"], categories=["all"],
           status_subresource=True, has_generation=True, scale=rs_scale),
        _b("batch", "v1", "jobs", "Job", categories=["all"], status_subresource=True, has_generation=True),
        _b("discovery.k8s.io", "v1", "endpointslices", "EndpointSlice"),
        _b("events.k8s.io", "v1", "events", "Event", short_names=["ev"], storage="events"),
        _b("coordination.k8s.io", "v1", "leases", "Lease"),
        _b("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget", short_names=["pdb"],
           status_subresource=True, has_generation=True),
        _b("rbac.authorization.k8s.io", "v1", "roles", "Role"),
        _b("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding"),
        _b("rbac.authorization.k8s.io", "v1", "clusterroles", "ClusterRole", False),
        _b("rbac.authorization.k8s.io", "v1", "clusterrolebindings", "ClusterRoleBinding", False),
        _b("autoscaling", "v2", "horizontalpodautoscalers", "HorizontalPodAutoscaler", short_names=["hpa"],
           categories=["all"], status_subresource=True),
        # Answered, never stored: every access is allowed because RBAC is not enforced.
        _b("authorization.k8s.io", "v1", "selfsubjectaccessreviews", "SelfSubjectAccessReview", False,
           verbs=["create"]),
        _b("apiextensions.k8s.io", "v1", "customresourcedefinitions", "CustomResourceDefinition", False,
           short_names=["crd", "crds"], status_subresource=True, has_generation=True),
    ]


class Registry:
    """Lookup of served resource types by group/version/plural and by kind."""

    def __init__(self) -> None:
        self._types: dict[tuple[str, str, str], ResourceType] = {}
        # Preferred-version ordering per group, in registration order.
        self._group_versions: dict[str, list[str]] = {}
        for rt in builtin_types():
            self.add(rt)

    def add(self, rt: ResourceType) -> None:
        self._types[(rt.group, rt.version, rt.plural)] = rt
        versions = self._group_versions.setdefault(rt.group, [])
        if rt.version not in versions:
            versions.append(rt.version)

    def remove_crd(self, crd_name: str) -> list[ResourceType]:
        gone = [rt for rt in self._types.values() if rt.crd_name == crd_name]
        for rt in gone:
            del self._types[(rt.group, rt.version, rt.plural)]
        for group in {rt.group for rt in gone}:
            live = [v for v in self._group_versions.get(group, [])
                    if any(k[0] == group and k[1] == v for k in self._types)]
            if live:
                self._group_versions[group] = live
            else:
                self._group_versions.pop(group, None)
        return gone

    def get(self, group: str, version: str, plural: str) -> ResourceType | None:
        return self._types.get((group, version, plural))

    def by_kind(self, api_version: str, kind: str) -> ResourceType | None:
        group, _, version = api_version.rpartition("/")
        for rt in self._types.values():
            if rt.group == group and rt.version == version and rt.kind == kind:
                return rt
        return None

    def for_storage(self, storage_key: str) -> list[ResourceType]:
        return [rt for rt in self._types.values() if rt.storage_key == storage_key]

    def all(self) -> list[ResourceType]:
        return list(self._types.values())

    def groups(self) -> dict[str, list[str]]:
        return {g: list(v) for g, v in self._group_versions.items()}

    def in_group_version(self, group: str, version: str) -> list[ResourceType]:
        return [rt for rt in self._types.values() if rt.group == group and rt.version == version]
