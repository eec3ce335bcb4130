"""Security basics of what we deploy: every pod (the chart's operator, the operator's engines and routers)
runs as non-root on a read-only root filesystem with no privilege escalation and no capabilities; only
pods that call the API server get a service-account token; and the chart's NetworkPolicy option lets
only routers, the operator and (with PodMonitors) Prometheus reach the engines — with selectors that
match the labels desired_state really puts on those pods."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pagedmodel.operator.desired_state import Observed, desired_state
from pm_factory import make_pm

helm = pytest.importorskip("helm_python")
import yaml  # noqa: E402

CHART = Path(__file__).resolve().parents[2] / "charts" / "pagedmodel"


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    rendered = helm.Chart.load(str(CHART)).render(values, name="pm", namespace="pm-system")
    return [d for name, text in rendered.items() if name.endswith(".yaml") for d in yaml.safe_load_all(text) if d]


def children(**observed: Any) -> dict[str, dict[str, Any]]:
    return {f"{m['kind']}/{m['metadata']['name']}": m
            for m in desired_state(make_pm(), Observed(router_enabled=True, **observed))}


def assert_hardened(pod: dict[str, Any]) -> None:
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for c in pod["containers"]:
        sc = c["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"] == {"drop": ["ALL"]}
        # a read-only root still needs somewhere to write: every writable mount is an emptyDir or PVC
        writable = {m["name"] for m in c.get("volumeMounts", []) if not m.get("readOnly")}
        assert writable <= {v["name"] for v in pod.get("volumes", []) if "emptyDir" in v}


def test_engine_pods_are_hardened_and_get_no_token() -> None:
    pod = children()["Deployment/smollm2-engine"]["spec"]["template"]["spec"]
    assert_hardened(pod)
    assert pod["automountServiceAccountToken"] is False   # engines never call the API server
    assert "serviceAccountName" not in pod


def test_router_pods_are_hardened_and_only_their_token_reads_pods() -> None:
    kids = children()
    pod = kids["Deployment/smollm2-router"]["spec"]["template"]["spec"]
    assert_hardened(pod)
    # the router discovers engine pods (--discover): its own account, read-only on pods/endpoints
    sa = kids[f"ServiceAccount/{pod['serviceAccountName']}"]
    assert sa["automountServiceAccountToken"] is True
    role = kids[f"Role/{pod['serviceAccountName']}"]
    assert {v for r in role["rules"] for v in r["verbs"]} == {"get", "list", "watch"}


def test_chart_operator_pod_is_hardened() -> None:
    dep = next(d for d in render({}) if d["kind"] == "Deployment")
    assert_hardened(dep["spec"]["template"]["spec"])


def test_network_policy_is_off_by_default() -> None:
    assert not [d for d in render({}) if d["kind"] == "NetworkPolicy"]


def _policies(values: dict[str, Any]) -> list[dict[str, Any]]:
    return [d for d in render({"networkPolicy": {"enabled": True}, **values}) if d["kind"] == "NetworkPolicy"]


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_network_policy_admits_only_routers_and_the_operator_to_the_engines() -> None:
    (policy,) = _policies({})
    assert policy["metadata"]["namespace"] == "pm-system" and policy["spec"]["policyTypes"] == ["Ingress"]
    kids = children()
    engine_labels = kids["Deployment/smollm2-engine"]["spec"]["template"]["metadata"]["labels"]
    router_labels = kids["Deployment/smollm2-router"]["spec"]["template"]["metadata"]["labels"]
    assert _matches(policy["spec"]["podSelector"]["matchLabels"], engine_labels)
    assert not _matches(policy["spec"]["podSelector"]["matchLabels"], router_labels)   # routers stay reachable
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"port": "http", "protocol": "TCP"}]
    peers = rule["from"]
    same_ns = [p for p in peers if "namespaceSelector" not in p]
    assert len(same_ns) == 1 and _matches(same_ns[0]["podSelector"]["matchLabels"], router_labels)
    assert not _matches(same_ns[0]["podSelector"]["matchLabels"], engine_labels)
    operator = next(d for d in render({}) if d["kind"] == "Deployment")
    op_peer = next(p for p in peers if "podSelector" in p and "namespaceSelector" in p)
    assert op_peer["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "pm-system"}
    assert _matches(op_peer["podSelector"]["matchLabels"], operator["spec"]["template"]["metadata"]["labels"])
    assert len(peers) == 2   # nothing else: no monitoring peer while the PodMonitors are off


def test_network_policy_per_namespace_with_monitoring_and_extra_peers() -> None:
    policies = _policies({"watchNamespaces": ["team-a", "team-b"], "monitoring": {"podMonitor": {"enabled": True}},
                          "networkPolicy": {"enabled": True, "extraIngressFrom": [{"ipBlock": {"cidr": "10.0.0.0/8"}}],
                                            "monitoringNamespace": "prom"}})
    assert sorted(p["metadata"]["namespace"] for p in policies) == ["team-a", "team-b"]
    peers = policies[0]["spec"]["ingress"][0]["from"]
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "prom"}}} in peers
    assert {"ipBlock": {"cidr": "10.0.0.0/8"}} in peers
    explicit = _policies({"watchNamespaces": ["team-a"], "networkPolicy": {"enabled": True, "namespaces": ["ml"]}})
    assert [p["metadata"]["namespace"] for p in explicit] == ["ml"]


def test_values_schema_rejects_a_bad_network_policy() -> None:
    with pytest.raises(Exception):
        render({"networkPolicy": {"enabled": "yes"}})
    with pytest.raises(Exception):
        render({"networkPolicy": {"enabled": True, "allowAll": True}})
