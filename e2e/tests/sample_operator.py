"""A small kopf operator for the Widget CRD, used only by the e2e tests.

create: makes an owned ConfigMap, marks the Widget Ready, posts an event;
update: resizes the ConfigMap and posts an event; delete: kopf's finalizer holds the
Widget until the handler has recorded a tombstone ConfigMap.
"""
from __future__ import annotations

import os
from typing import Any

import kopf
from kubernetes import client as k8s
from kubernetes import config

GROUP, VERSION, PLURAL = "e2e.pagedmodel.io", "v1", "widgets"


def _core() -> k8s.CoreV1Api:
    # KUBECONFIG names the cluster under test; read it now, not at import time.
    return k8s.CoreV1Api(config.new_client_from_config(config_file=os.environ.get("KUBECONFIG")))


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    return kopf.login_with_kubeconfig(**kwargs) or kopf.login_via_client(**kwargs)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.posting.level = 0        # post every event, so describe shows them
    settings.watching.server_timeout = 30
    settings.persistence.finalizer = "e2e.pagedmodel.io/widget-finalizer"


@kopf.on.create(GROUP, VERSION, PLURAL)
def create(spec: dict[str, Any], name: str, namespace: str, body: Any, patch: Any, **_: Any) -> dict[str, Any]:
    child = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"widget-{name}"},
             "data": {"size": str(spec["size"]), "color": spec.get("color", "")}}
    kopf.adopt(child, owner=body)
    _core().create_namespaced_config_map(namespace, child)
    patch.status["phase"] = "Ready"
    patch.status["conditions"] = [{"type": "Ready", "status": "True"}]
    kopf.info(body, reason="Created", message=f"made configmap widget-{name} of size {spec['size']}")
    return {"child": f"widget-{name}"}


@kopf.on.update(GROUP, VERSION, PLURAL, field="spec.size")
def resize(old: Any, new: Any, name: str, namespace: str, body: Any, **_: Any) -> None:
    _core().patch_namespaced_config_map(f"widget-{name}", namespace, {"data": {"size": str(new)}})
    kopf.info(body, reason="Resized", message=f"size {old} -> {new}")


@kopf.on.delete(GROUP, VERSION, PLURAL)
def delete(name: str, namespace: str, **_: Any) -> None:
    _core().create_namespaced_config_map(namespace, {"metadata": {"name": f"tombstone-{name}"}, "data": {}})
