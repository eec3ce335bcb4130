"""The Helm chart through Helm's own Go SDK (helm-python-sdk): lint, render with default and full values,
least-privilege RBAC, and the chart's CRD is the repository's CRD."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

helm = pytest.importorskip("helm_python")

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "pagedmodel"
FULL = CHART / "ci" / "full-values.yaml"


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    rendered = helm.Chart.load(str(CHART)).render(values, name="pm", namespace="pm-system")
    return [d for name, text in rendered.items() if name.endswith(".yaml") for d in yaml.safe_load_all(text) if d]


def notes(values: dict[str, Any]) -> str:
    rendered = helm.Chart.load(str(CHART)).render(values, name="pm", namespace="pm-system")
    return next(text for name, text in rendered.items() if name.endswith("NOTES.txt"))


def operator_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    dep = next(d for d in docs if d["kind"] == "Deployment")
    return dep["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("values_file", [None, FULL], ids=["defaults", "full"])
def test_lint_is_clean(values_file):
    values = yaml.safe_load(values_file.read_text()) if values_file else None
    report = helm.lint(str(CHART), values, strict=True)
    assert report["errors"] == [] and report["total_charts_linted"] == 1, report
    assert [m for m in report["messages"] if m["severity"] > 1] == [], report


def test_default_render_is_cluster_wide_with_one_recreate_replica():
    docs = render({})
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in docs)
    assert kinds == [("ClusterRole", "pm-pagedmodel"), ("ClusterRole", "pm-pagedmodel-framework"),
                     ("ClusterRoleBinding", "pm-pagedmodel"), ("ClusterRoleBinding", "pm-pagedmodel-framework"),
                     ("Deployment", "pm-pagedmodel"), ("ServiceAccount", "pm-pagedmodel")]
    dep = next(d for d in docs if d["kind"] == "Deployment")
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"] == {"type": "Recreate"}
    c = operator_container(docs)
    assert c["command"] == ["pagedmodel", "operator"] and c["image"] == "ghcr.io/pagedmodel/pagedmodel:0.1.0"
    assert c["args"] == ["--all-namespaces", "--log-level=info", "--status-interval=5", "--router=auto", "--pod-bind=all",
                         "--liveness=http://$(POD_IP):8080/healthz", "--metrics-port=8081", "--metrics-host=$(POD_IP)"]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert dep["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True


def test_full_values_render_namespaced_rbac_and_every_option():
    docs = render(yaml.safe_load(FULL.read_text()))
    roles = sorted((d["kind"], d["metadata"].get("namespace")) for d in docs if d["kind"] in ("Role", "RoleBinding"))
    assert roles == [("Role", "team-a"), ("Role", "team-b"), ("RoleBinding", "team-a"), ("RoleBinding", "team-b")]
    assert not any(d["kind"] == "ClusterRole" and d["metadata"]["name"] == "pm-pagedmodel" for d in docs)
    c = operator_container(docs)
    assert c["image"] == "registry.example.com/ml/pagedmodel:0.1.0-cuda12" and c["imagePullPolicy"] == "Always"
    assert c["args"][:2] == ["--namespace=team-a", "--namespace=team-b"] and "--router=enabled" in c["args"]
    assert "--pod-bind=pod-ip" in c["args"]
    assert {"name": "PYTHONWARNINGS", "value": "ignore"} in c["env"]
    pod = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "pagedmodel-operator" and pod["imagePullSecrets"] == [
        {"name": "registry-credentials"}]
    assert pod["priorityClassName"] == "system-cluster-critical" and pod["nodeSelector"] == {"kubernetes.io/os": "linux"}
    assert "namespaces team-a, team-b" in notes(yaml.safe_load(FULL.read_text()))


def test_rbac_is_least_privilege():
    docs = render({})
    rules = [r for d in docs if d["kind"] == "ClusterRole" for r in d["rules"]]
    verbs = {(g, res): set(r["verbs"]) for r in rules for g in r["apiGroups"] for res in r["resources"]}
    for rule in rules:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "delete" not in rule["verbs"]
    assert verbs[("", "secrets")] == {"get"} and verbs[("", "persistentvolumeclaims")] == {"get"}
    assert verbs[("apps", "deployments")] == {"get", "create", "patch"}     # server-side apply
    assert verbs[("pagedmodel.io", "pagedmodels/status")] == {"get", "patch"}
    assert verbs[("", "events")] == {"create"}
    assert verbs[("autoscaling", "horizontalpodautoscalers")] == {"list"}
    # Every kind the operator applies is covered (kube_client.PATHS is the operator's write list).
    from pagedmodel.operator.kube_client import PATHS
    for kind, (prefix, plural) in PATHS.items():
        group = "" if prefix == "/api/v1" else prefix.split("/")[2]
        assert verbs[(group, plural)] == {"get", "create", "patch"}, kind


@pytest.mark.parametrize("bad", [
    {"logLevel": "verbose"}, {"router": "sometimes"}, {"statusInterval": 0}, {"podBind": "localhost"}, {"watchNamespaces": ["Bad_NS"]},
    {"image": {"repository": ""}}, {"livenessPort": 70000}, {"unknownKey": 1},
])
def test_values_schema_rejects_bad_values(bad):
    with pytest.raises(helm.HelmError):
        helm.Chart.load(str(CHART)).render(bad, name="pm", namespace="pm-system")


def test_notes_say_how_to_create_a_first_model():
    text = notes({})
    assert "kind: PagedModel" in text and "kubectl get pm" in text and "every namespace" in text


def test_chart_crd_is_the_repository_crd():
    assert (CHART / "crds" / "pagedmodel.yaml").read_text() == (REPO / "crds" / "pagedmodel.yaml").read_text()
