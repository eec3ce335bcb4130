"""A kopf operator under KopfRunner: create, update, delete with finalizers, status patches, events."""
from __future__ import annotations

from pathlib import Path

import kopf
import yaml
from kopf.testing import KopfRunner

from .helpers import wait_until

OPERATOR = Path(__file__).with_name("sample_operator.py")
FINALIZER = "e2e.pagedmodel.io/widget-finalizer"


def _widget(size: int) -> str:
    return yaml.safe_dump({"apiVersion": "e2e.pagedmodel.io/v1", "kind": "Widget", "metadata": {"name": "op"},
                           "spec": {"size": size}})


def test_kopf_operator_lifecycle(cluster, namespace, widget_crd, monkeypatch):
    monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))
    args = ["run", "--standalone", "--namespace", namespace, "--verbose", str(OPERATOR)]
    # A fresh registry: handlers other tests imported into kopf's default one must not run here.
    with KopfRunner(args, timeout=60, registry=kopf.OperatorRegistry()) as runner:
        cluster.kubectl("apply", "-f", "-", stdin=_widget(3), namespace=namespace)

        def ready():
            w = cluster.kubectl_json("get", "widget", "op", namespace=namespace)
            return w if (w.get("status") or {}).get("phase") == "Ready" else None

        widget = wait_until(ready, timeout=30, what="operator marks the Widget Ready")
        assert FINALIZER in widget["metadata"]["finalizers"]
        assert widget["status"]["create"] == {"child": "widget-op"}
        child = cluster.kubectl_json("get", "configmap", "widget-op", namespace=namespace)
        assert child["data"]["size"] == "3"
        assert child["metadata"]["ownerReferences"][0]["uid"] == widget["metadata"]["uid"]
        cluster.kubectl("wait", "--for=condition=Ready", "widget/op", "--timeout=30s", namespace=namespace)

        cluster.kubectl("apply", "-f", "-", stdin=_widget(7), namespace=namespace)
        wait_until(lambda: cluster.kubectl_json("get", "configmap", "widget-op", namespace=namespace)
                   ["data"]["size"] == "7", timeout=30, what="operator resizes the child")
        described = wait_until(lambda: (lambda out: out if "Resized" in out else None)(
            cluster.kubectl("describe", "widget", "op", namespace=namespace).stdout), what="Resized event")
        assert "made configmap widget-op of size 3" in described and "size 3 -> 7" in described

        deleted = cluster.kubectl("delete", "widget", "op", "--timeout=60s", namespace=namespace, timeout=70)
        assert 'widget.e2e.pagedmodel.io "op" deleted' in deleted.stdout
        assert cluster.kubectl("get", "widget", "op", namespace=namespace, check=False).returncode != 0
        cluster.kubectl_json("get", "configmap", "tombstone-op", namespace=namespace)
        # The controller-manager's garbage collector picks up a new CRD's kind on its discovery resync
        # (every 30 s), so a Widget made right after its CRD may be deleted before the GC watches Widgets.
        wait_until(lambda: cluster.kubectl("get", "configmap", "widget-op", namespace=namespace,
                                           check=False).returncode != 0, timeout=90, what="child garbage-collected")
    assert runner.exit_code == 0, runner.output
    assert runner.exception is None
    assert "Handler 'create' succeeded" in runner.output and "Handler 'delete' succeeded" in runner.output
