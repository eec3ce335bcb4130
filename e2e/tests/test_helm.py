"""Helm's own Go SDK (helm-python-sdk): render, lint, install, upgrade, uninstall against the cluster."""
from __future__ import annotations

from pathlib import Path

import helm_python as helm
import pytest
import yaml

from e2e.node import images

from .helpers import wait_until

CHART = Path(__file__).parent / "charts" / "demo"
# Any image with python3 serves the demo; the node pulls from the local registry, which holds the chart's.
IMAGE = images.chart_image()


def test_render_and_lint():
    report = helm.lint(str(CHART), strict=True)
    assert report["errors"] == [] and report["total_charts_linted"] == 1, report
    chart = helm.Chart.load(str(CHART))
    assert chart.name == "demo"
    rendered = chart.render({"message": "rendered"}, name="r1", namespace="default")
    docs = [d for text in rendered.values() for d in yaml.safe_load_all(text) if d]
    assert sorted(d["kind"] for d in docs) == ["ConfigMap", "Deployment", "Service"]
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    assert cm["metadata"]["name"] == "r1-config" and cm["data"]["message"] == "rendered"


@pytest.fixture
def helm_config(cluster, namespace):
    config = helm.Config(kubeconfig_path=str(cluster.kubeconfig), namespace=namespace)
    yield config
    config.uninstall("demo", ignore_not_found=True)


def test_install_upgrade_uninstall(cluster, namespace, helm_config):
    release = helm_config.install(str(CHART), "demo", {"message": "first", "image": IMAGE}, namespace=namespace, timeout=120,
                                  wait="watcher")
    assert release["status"] == "deployed" and release["revision"] == 1
    cm = cluster.kubectl_json("get", "configmap", "demo-config", namespace=namespace)
    assert cm["data"]["message"] == "first"
    deploy = cluster.kubectl_json("get", "deployment", "demo-server", namespace=namespace)
    assert deploy["status"].get("readyReplicas") == 1   # wait="watcher" waited for the rollout
    secrets = cluster.kubectl_json("get", "secrets", "-l", "owner=helm,name=demo", namespace=namespace)["items"]
    assert [s["metadata"]["labels"]["status"] for s in secrets] == ["deployed"]

    upgraded = helm_config.upgrade(str(CHART), "demo", {"message": "second", "replicaCount": 2, "image": IMAGE},
                                   namespace=namespace, timeout=120, wait="watcher")
    assert upgraded["revision"] == 2 and upgraded["status"] == "deployed"
    assert cluster.kubectl_json("get", "configmap", "demo-config", namespace=namespace)["data"]["message"] == "second"
    deploy = cluster.kubectl_json("get", "deployment", "demo-server", namespace=namespace)
    assert deploy["spec"]["replicas"] == 2 and deploy["status"].get("readyReplicas") == 2
    history = helm_config.history("demo")
    assert len(history if isinstance(history, list) else history.get("releases", history)) == 2

    helm_config.uninstall("demo", timeout=60)
    wait_until(lambda: cluster.kubectl("get", "deployment", "demo-server", namespace=namespace,
                                       check=False).returncode != 0, what="release resources removed")
    assert cluster.kubectl("get", "configmap", "demo-config", namespace=namespace, check=False).returncode != 0
    leftover = cluster.kubectl_json("get", "secrets", "-l", "owner=helm,name=demo", namespace=namespace)["items"]
    assert leftover == []
