"""`helm install` of charts/pagedmodel on the cluster brings up a working operator: a pod of the chart's image on
the real node, reaching kube-apiserver in-cluster (its ServiceAccount's token, the kubernetes Service)."""
from __future__ import annotations

from pathlib import Path

import helm_python as helm
import pytest
import yaml

from .helpers import wait_until

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "pagedmodel"



@pytest.fixture
def release(cluster, namespace):
    config = helm.Config(kubeconfig_path=str(cluster.kubeconfig), namespace=namespace)
    yield config
    config.uninstall("pm", ignore_not_found=True)


def test_helm_install_runs_a_working_operator(cluster, namespace, release):
    values = {"watchNamespaces": [namespace], "statusInterval": 1, "router": "disabled", "logLevel": "debug",
              "extraEnv": [{"name": "OMP_NUM_THREADS", "value": "1"}]}
    rel = release.install(str(CHART), "pm", values, namespace=namespace, timeout=120, wait="watcher")
    assert rel["status"] == "deployed"
    crd = cluster.kubectl_json("get", "crd", "pagedmodels.pagedmodel.io")
    assert crd["spec"]["names"]["shortNames"] == ["pm"]
    dep = cluster.kubectl_json("get", "deployment", "pm-pagedmodel", namespace=namespace)
    assert dep["spec"]["strategy"]["type"] == "Recreate" and dep["status"].get("readyReplicas") == 1

    # A PagedModel scaled to zero proves the operator works without loading another model.
    pm = {"apiVersion": "pagedmodel.io/v1alpha1", "kind": "PagedModel", "metadata": {"name": "zero"},
          "spec": {"model": {"source": "builtin://smollm2"}, "replicas": 0, "resources": {"gpus": 0}}}
    cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(pm), namespace=namespace)

    def scaled_to_zero():
        st = cluster.kubectl_json("get", "pm", "zero", namespace=namespace).get("status") or {}
        return st if st.get("phase") == "Pending" and st.get("ready") == "0/0" else None

    status = wait_until(scaled_to_zero, timeout=90, interval=0.5, what="operator pod reconciles the PagedModel")
    assert next(c for c in status["conditions"] if c["type"] == "Ready")["reason"] == "ScaledToZero"
    assert cluster.kubectl_json("get", "deployment", "zero-engine", namespace=namespace)["spec"]["replicas"] == 0
    logs = cluster.kubectl("logs", "deployment/pm-pagedmodel", namespace=namespace).stdout
    assert "Traceback" not in logs, logs[-3000:]
    cluster.kubectl("delete", "pm", "zero", namespace=namespace)
