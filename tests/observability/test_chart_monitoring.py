"""The chart with monitoring on: the PodMonitors select the pods the operator really creates, on ports
they really have; every alert says what and where and links to its runbook section; the dashboard
ConfigMap carries the Grafana sidecar's label and the panels the issue lists; every metric a query
names is one the engine, the router or the operator exports (the metrics contract)."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from pagedmodel import metrics_contract as mc
from pagedmodel.operator import names
from pagedmodel.operator.desired_state import Observed, desired_state

import monitoring
from pm_factory import make_pm

DOCS = Path(__file__).resolve().parents[2] / "docs" / "observability.md"


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A Kubernetes LabelSelector (matchLabels and In/NotIn/Exists) applied to a pod's labels."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        op, key, values = e["operator"], e["key"], e.get("values") or []
        if (op == "In" and labels.get(key) not in values) or (op == "NotIn" and labels.get(key) in values) \
                or (op == "Exists" and key not in labels) or (op == "DoesNotExist" and key in labels):
            return False
    return True


def pod_templates() -> dict[str, dict[str, Any]]:
    """component -> pod template of the Deployments the operator applies for a PagedModel."""
    manifests = desired_state(make_pm({"model": {"source": "builtin://smollm2"}}),
                              Observed(router_enabled=True))
    return {d["spec"]["template"]["metadata"]["labels"][names.LABEL_COMPONENT]: d["spec"]["template"]
            for d in manifests if d["kind"] == "Deployment"}


def test_default_values_render_no_monitoring_objects():
    kinds = {d["kind"] for d in monitoring.render({}).docs}
    assert not kinds & {"PodMonitor", "PrometheusRule", "ConfigMap"}


def test_each_part_has_its_own_switch():
    for part, kind in (("podMonitor", "PodMonitor"), ("prometheusRule", "PrometheusRule"), ("dashboard", "ConfigMap")):
        kinds = {d["kind"] for d in monitoring.render({"monitoring": {part: {"enabled": True}}}).docs}
        assert kind in kinds and not kinds & ({"PodMonitor", "PrometheusRule", "ConfigMap"} - {kind}), part


def test_objects_are_well_formed(chart):
    for d in chart.of("PodMonitor") + chart.of("PrometheusRule"):
        assert d["apiVersion"] == "monitoring.coreos.com/v1" and d["metadata"]["namespace"] == "pm-system"
    for pm in chart.of("PodMonitor"):
        for ep in pm["spec"]["podMetricsEndpoints"]:
            assert ep["path"] == "/metrics" and re.fullmatch(r"\d+(s|m)", ep["interval"])
    (cm,) = chart.of("ConfigMap")
    assert cm["apiVersion"] == "v1" and cm["metadata"]["labels"]["grafana_dashboard"] == "1"


def test_model_podmonitor_selects_engine_and_router_pods_on_their_metrics_port(chart):
    (models,) = [p for p in chart.of("PodMonitor") if p["metadata"]["name"].endswith("-models")]
    templates = pod_templates()
    assert set(templates) == {"engine", "router"}
    for component, template in templates.items():
        assert selects(models["spec"]["selector"], template["metadata"]["labels"]), component
        ports = {p["name"] for c in template["spec"]["containers"] for p in c.get("ports", [])}
        assert {ep["port"] for ep in models["spec"]["podMetricsEndpoints"]} <= ports, component
    relabel = {r["targetLabel"]: r["sourceLabels"] for r in models["spec"]["podMetricsEndpoints"][0]["relabelings"]}
    # pagedmodel and component come from the very labels the operator sets
    assert relabel["pagedmodel"] == ["__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9]", "_", names.LABEL_NAME)]
    assert relabel["component"] == ["__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9]", "_", names.LABEL_COMPONENT)]
    assert models["spec"]["namespaceSelector"] == {"any": True}
    scoped = monitoring.render({"watchNamespaces": ["team-a"], **monitoring.MONITORING_ON})
    (models,) = [p for p in scoped.of("PodMonitor") if p["metadata"]["name"].endswith("-models")]
    assert models["spec"]["namespaceSelector"] == {"matchNames": ["team-a"]}


def test_operator_podmonitor_selects_the_operator_pod_and_its_metrics_port(chart):
    (op,) = [p for p in chart.of("PodMonitor") if p["metadata"]["name"].endswith("-operator")]
    (dep,) = chart.of("Deployment")
    pod = dep["spec"]["template"]
    assert selects(op["spec"]["selector"], pod["metadata"]["labels"])
    (container,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    (ep,) = op["spec"]["podMetricsEndpoints"]
    assert ep["port"] == "metrics" and f"--metrics-port={ports['metrics']}" in container["args"]
    assert ep["honorLabels"] is True        # keep the PagedModel's namespace label, not the operator's
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}


def runbook_anchors() -> set[str]:
    """GitHub's anchors of docs/observability.md's headings."""
    out = set()
    for line in DOCS.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^a-z0-9 _-]", "", title).replace(" ", "-"))
    return out


EXPECTED_ALERTS = {"PagedModelKVCacheFragmented", "PagedModelKVCacheFreeBlocksLow", "PagedModelKVBlockAllocationSlow",
                   "PagedModelQueueGrowing", "PagedModelTTFTHigh", "PagedModelRateLimited",
                   "PagedModelMetricsStale", "PagedModelEngineRestarted", "PagedModelAtMaxReplicas"}


def test_alerts_are_the_issues_list_each_with_summary_description_and_runbook(chart):
    alerts = chart.alerts()
    assert {a["alert"] for a in alerts} == EXPECTED_ALERTS
    anchors = runbook_anchors()
    for a in alerts:
        ann = a["annotations"]
        assert ann["summary"] and "PagedModel" in ann["description"] and "$labels.pagedmodel" in ann["description"]
        url, _, anchor = ann["runbook_url"].partition("#")
        assert url.endswith("docs/observability.md") and anchor == a["alert"].lower() and anchor in anchors, a["alert"]
        assert a["labels"]["severity"] in ("info", "warning", "critical")


def test_thresholds_are_the_designs_and_configurable(chart):
    exprs = {a["alert"]: a for a in chart.alerts()}
    assert exprs["PagedModelKVCacheFragmented"]["expr"].endswith("> 0.3") and exprs["PagedModelKVCacheFragmented"]["for"] == "5m"
    assert exprs["PagedModelKVCacheFreeBlocksLow"]["expr"].endswith("< 0.1") and exprs["PagedModelKVCacheFreeBlocksLow"]["for"] == "5m"
    assert exprs["PagedModelKVBlockAllocationSlow"]["expr"].endswith("> 0.05")
    assert exprs["PagedModelQueueGrowing"]["for"] == "5m"
    assert exprs["PagedModelTTFTHigh"]["expr"].endswith("> 2")
    custom = monitoring.render({"monitoring": {"prometheusRule": {"enabled": True, "ttftP99SloSeconds": 0.75,
                                                                 "rateLimitedRatio": 0.2}}})
    exprs = {a["alert"]: a["expr"] for a in custom.alerts()}
    assert exprs["PagedModelTTFTHigh"].endswith("> 0.75") and exprs["PagedModelRateLimited"].endswith("> 0.2")


PANEL_TOPICS = ["KV cache usage", "Free KV blocks", "fragmentation", "Running and waiting", "Time to first token",
                "Inter-token latency", "End-to-end", "Tokens per second", "Prefix cache hit rate",
                "Preemptions and swap-outs", "Router queue", "429s", "Desired vs ready"]


def test_dashboard_has_the_panels_per_pagedmodel_and_pod(chart):
    dash = chart.dashboard()
    titles = " | ".join(p["title"] for p in dash["panels"])
    for topic in PANEL_TOPICS:
        assert topic in titles, topic
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "namespace", "pagedmodel", "pod"} <= variables
    for p in dash["panels"]:
        for t in p["targets"]:
            assert 'pagedmodel=~"$pagedmodel"' in t["expr"], (p["title"], t["expr"])
    assert any("tuner_events" in a.get("expr", "") for a in dash["annotations"]["list"])
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


def test_every_metric_the_chart_names_is_exported(chart):
    exported = mc.exported_series() | monitoring.PROMETHEUS_BUILTINS
    used = {n for _, expr in chart.queries() for n in monitoring.metric_names(expr)}
    assert used and used <= exported, sorted(used - exported)
    # and every program's export is used somewhere (a chart that forgot the router would pass the above)
    for program in ("engine", "router", "operator"):
        assert used & mc.exported_series([program]), program


@pytest.mark.parametrize("expr,names_", [
    ('sum by (pod, le) (rate(vllm:x_bucket{a="b", pod=~"$pod"}[5m])) > 0.3', {"vllm:x_bucket"}),
    ('deriv({__name__=~"a_b|c:d"}[5m]) and on (namespace) up == 0', {"a_b", "c:d", "up"}),
    ("histogram_quantile(0.99, sum by (le) (rate(m_bucket[1m]))) / ignoring (x) n_total", {"m_bucket", "n_total"}),
])
def test_metric_names_finds_selectors_only(expr, names_):
    assert monitoring.metric_names(expr) == names_


def test_operands_split_at_top_level_comparisons_and_set_operators():
    assert monitoring.operands('a{x=">"} > 1') == ['a{x=">"}']
    assert monitoring.operands("x >= y and on (n, p) z == 1") == ["x", "y", "z"]
    assert monitoring.operands("up == 0 or sum by (p) (increase(f[5m])) > 0") == ["up", "sum by (p) (increase(f[5m]))"]
    assert monitoring.operands("rate(a[5m]) / b <= bool 3") == ["rate(a[5m]) / b"]
