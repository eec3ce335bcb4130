"""The operator installed by ``helm install`` runs as a pod under the chart's ServiceAccount, with
exactly the chart's RBAC enforced by kube-apiserver: it reconciles a PagedModel (creating and
updating every kind of child, and granting the router Role, which RBAC only allows to a holder of
those permissions), and ``kubectl auth can-i`` shows what it must not do."""
from __future__ import annotations

from pathlib import Path

import helm_python as helm
import pytest
import yaml

from .helpers import wait_until

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "pagedmodel"
RELEASE = "pm"
ACCOUNT = "pm-pagedmodel"          # the chart's default: the release's full name



@pytest.fixture
def other_namespace(cluster):
    name = cluster.new_namespace("other")
    yield name
    cluster.delete_namespace(name)


@pytest.fixture
def release(cluster, namespace):
    config = helm.Config(kubeconfig_path=str(cluster.kubeconfig), namespace=namespace)
    values = {"watchNamespaces": [namespace], "statusInterval": 1, "router": "enabled",
              "extraEnv": [{"name": "OMP_NUM_THREADS", "value": "1"}]}
    config.install(str(CHART), RELEASE, values, namespace=namespace, timeout=120, wait="watcher")
    yield config
    config.uninstall(RELEASE, ignore_not_found=True)


def can_i(cluster, home: str, namespace: str | None, *args: str) -> bool:
    """``kubectl auth can-i`` as the operator's ServiceAccount (which lives in ``home``)."""
    user = f"system:serviceaccount:{home}:{ACCOUNT}"
    result = cluster.kubectl("auth", "can-i", *args, f"--as={user}", *(["-n", namespace] if namespace else []),
                             check=False)
    assert result.stdout.strip() in ("yes", "no"), result.stdout + result.stderr
    return result.stdout.strip() == "yes"


def test_chart_rbac_is_enough_and_no_more(cluster, namespace, other_namespace, release):
    pod = cluster.kubectl_json("get", "pods", "-l", "app.kubernetes.io/component=operator",
                               namespace=namespace)["items"][0]
    assert pod["spec"]["serviceAccountName"] == ACCOUNT

    # The operator pod reconciles with exactly the chart's RBAC: every child kind created ...
    pm = {"apiVersion": "pagedmodel.io/v1alpha1", "kind": "PagedModel", "metadata": {"name": "zero"},
          "spec": {"model": {"source": "builtin://smollm2"}, "replicas": 0, "resources": {"gpus": 0}}}
    cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(pm), namespace=namespace)
    kinds = ("deployments", "services", "serviceaccounts", "roles", "rolebindings", "poddisruptionbudgets")

    def children():
        return {k: sorted(i["metadata"]["name"] for i in cluster.kubectl_json(
            "get", k, "-l", "pagedmodel.io/name=zero", namespace=namespace)["items"]) for k in kinds}
    expected = {"deployments": ["zero-engine", "zero-router"], "services": ["zero", "zero-engine"],
                "serviceaccounts": ["zero-router"], "roles": ["zero-router"], "rolebindings": ["zero-router"],
                "poddisruptionbudgets": ["zero-engine"]}
    wait_until(lambda: children() == expected, timeout=90, what="children created by the operator pod")
    wait_until(lambda: (cluster.kubectl_json("get", "pm", "zero", namespace=namespace).get("status") or {})
               .get("phase") == "Pending", timeout=60, what="status written by the operator pod")

    # ... and updated (a spec change re-applies the Services).
    cluster.kubectl("patch", "pm", "zero", "--type=merge", "-p", '{"spec":{"service":{"port":8080}}}',
                    namespace=namespace)
    wait_until(lambda: cluster.kubectl_json("get", "service", "zero", namespace=namespace)
               ["spec"]["ports"][0]["port"] == 8080, timeout=60, what="Service updated by the operator pod")
    logs = cluster.kubectl("logs", "deployment/pm-pagedmodel", namespace=namespace).stdout
    assert "403" not in logs and "Forbidden" not in logs and "Traceback" not in logs, logs[-3000:]

    # What it may do, as RBAC sees it ...
    for verb, resource in (("create", "deployments.apps"), ("patch", "roles.rbac.authorization.k8s.io"),
                           ("patch", "pagedmodels.pagedmodel.io/status"), ("get", "secrets")):
        assert can_i(cluster, namespace, namespace, verb, resource), (verb, resource)
    # ... and what it must not.
    forbidden = [(other_namespace, "get", "secrets"), (namespace, "list", "secrets"), (None, "delete", "nodes"),
                 (namespace, "delete", "deployments.apps"), (namespace, "create", "pods"),
                 (other_namespace, "list", "pagedmodels.pagedmodel.io"), (None, "create", "clusterroles"),
                 (namespace, "create", "pods/exec"), (other_namespace, "create", "deployments.apps"),
                 (namespace, "update", "deployments.apps")]                 # children are server-side applied
    for ns, verb, resource in forbidden:
        assert not can_i(cluster, namespace, ns, verb, resource), (ns, verb, resource)
    cluster.kubectl("delete", "pm", "zero", namespace=namespace)
