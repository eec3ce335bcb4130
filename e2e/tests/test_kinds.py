"""Every built-in kind we serve survives create / get / list / patch / delete through the dynamic client."""
from __future__ import annotations

import uuid

import pytest
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import NotFoundError

from .helpers import wait_until

SAMPLES = [
    ("v1", "ServiceAccount", {}),
    ("v1", "Secret", {"type": "Opaque", "stringData": {"k": "v"}}),
    ("v1", "Service", {"spec": {"ports": [{"port": 80}], "selector": {"app": "none"}}}),
    ("v1", "Endpoints", {"subsets": [{"addresses": [{"ip": "127.0.0.9"}], "ports": [{"port": 80}]}]}),
    ("v1", "PersistentVolumeClaim", {"spec": {"accessModes": ["ReadWriteOnce"],
                                              "resources": {"requests": {"storage": "1Gi"}}}}),
    ("discovery.k8s.io/v1", "EndpointSlice", {"addressType": "IPv4", "endpoints": [{"addresses": ["127.0.0.9"]}]}),
    ("coordination.k8s.io/v1", "Lease", {"spec": {"holderIdentity": "e2e", "leaseDurationSeconds": 15}}),
    ("policy/v1", "PodDisruptionBudget", {"spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "x"}}}}),
    ("rbac.authorization.k8s.io/v1", "Role", {"rules": [{"apiGroups": [""], "resources": ["pods"],
                                                          "verbs": ["get"]}]}),
    ("rbac.authorization.k8s.io/v1", "RoleBinding", {"roleRef": {"apiGroup": "rbac.authorization.k8s.io",
                                                                 "kind": "Role", "name": "r"},
                                                     "subjects": [{"kind": "ServiceAccount", "name": "default"}]}),
    ("rbac.authorization.k8s.io/v1", "ClusterRole", {"rules": []}),
    ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding", {"roleRef": {"apiGroup": "rbac.authorization.k8s.io",
                                                                        "kind": "ClusterRole", "name": "view"},
                                                            "subjects": []}),
    ("autoscaling/v2", "HorizontalPodAutoscaler", {"spec": {"scaleTargetRef": {"apiVersion": "apps/v1",
                                                                               "kind": "Deployment", "name": "x"},
                                                            "minReplicas": 1, "maxReplicas": 2}}),
]


@pytest.mark.parametrize("api_version,kind,body", SAMPLES, ids=[s[1] for s in SAMPLES])
def test_crud(api_client, namespace, api_version, kind, body):
    resource = DynamicClient(api_client).resources.get(api_version=api_version, kind=kind)
    name = f"e2e-{uuid.uuid4().hex[:6]}"
    ns = namespace if resource.namespaced else None
    manifest = {"apiVersion": api_version, "kind": kind, "metadata": {"name": name}, **body}
    created = resource.create(body=manifest, namespace=ns)
    assert created.metadata.uid and created.kind == kind
    assert resource.get(name=name, namespace=ns).metadata.name == name
    listed = resource.get(namespace=ns, field_selector=f"metadata.name={name}")
    assert [item.metadata.name for item in listed.items] == [name]
    patched = resource.patch(name=name, namespace=ns, body={"metadata": {"labels": {"e2e": "yes"}}},
                             content_type="application/merge-patch+json")
    assert patched.metadata.labels["e2e"] == "yes"
    assert int(patched.metadata.resourceVersion) > int(created.metadata.resourceVersion)
    resource.delete(name=name, namespace=ns)

    def gone():
        try:
            resource.get(name=name, namespace=ns)
            return False
        except NotFoundError:
            return True

    wait_until(gone, what=f"{kind} deleted")
