"""The operator's own metrics: real reconcile passes become samples with the contract's names and fixed
label values; a failed pass counts by error kind; `--metrics-port` serves them."""
from __future__ import annotations

import socket

import httpx
import kopf
import pytest
from kubernetes.client.exceptions import ApiException
from prometheus_client import generate_latest

from pagedmodel import metrics_contract as mc
from pagedmodel.cli import build_parser
from pagedmodel.operator import autoscaler, main
from pagedmodel.operator.pass_report import PassReport
from pagedmodel.operator.reconcile import reconcile
from pagedmodel.operator.scaling import iso
from pagedmodel.operator.telemetry import OperatorMetrics

from test_scaling import AUTO, T0, ClusterSim, metrics_text


def samples(m: OperatorMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for s in mc.parse(generate_latest(m.registry).decode()) if not s.name.endswith("_created")}


def value(m: OperatorMetrics, name: str, **labels: str) -> float:
    want = {"namespace": "ml", "pagedmodel": "smollm2", **labels}
    return sum(v for (n, ls), v in samples(m).items() if n == name and all(dict(ls).get(k) == x for k, x in want.items()))


def run(sim: ClusterSim, m: OperatorMetrics, t: float) -> None:
    out = reconcile(sim.kube, sim.pm, router_enabled=sim.router, now=iso(t), clock=t, fetch=sim.load, memory=sim.memory)
    sim.pm["status"] = out.status
    m.record("ml", "smollm2", 0.01, out.report)


def test_causes_are_the_contracts_fixed_set():
    assert autoscaler.CAUSES == mc.SCALE_REASONS


def test_scale_up_to_max_is_counted_with_its_cause_and_limited_gauge():
    sim, m = ClusterSim(AUTO), OperatorMetrics()
    sim.load = lambda url: metrics_text(1.0, 40, 4)
    for i in range(8):
        run(sim, m, T0 + 10 * i)
    assert value(m, "pagedmodel_operator_reconcile_passes_total", outcome="ok") == 8
    assert value(m, "pagedmodel_operator_reconcile_duration_seconds_count") == 8
    assert value(m, "pagedmodel_operator_scale_decisions_total", direction="up") >= 1
    ups = {dict(ls)["reason"] for (n, ls), v in samples(m).items()
           if n == "pagedmodel_operator_scale_decisions_total" and dict(ls)["direction"] == "up"}
    assert ups <= {"kv_cache", "waiting"} and ups
    assert value(m, "pagedmodel_operator_scale_decisions_total", direction="hold", reason="bounds") >= 1
    assert value(m, "pagedmodel_operator_max_replicas") == 3 and value(m, "pagedmodel_operator_desired_replicas") == 3
    assert value(m, "pagedmodel_operator_scaling_limited") == 1
    assert value(m, "pagedmodel_operator_errors_total") == 0
    for (n, ls), _ in samples(m).items():
        labels = dict(ls)
        assert labels.get("reason", "kv_cache") in mc.SCALE_REASONS and labels.get("direction", "up") in mc.SCALE_DIRECTIONS


def test_steady_load_holds_and_is_not_limited():
    sim, m = ClusterSim(AUTO), OperatorMetrics()
    sim.load = lambda url: metrics_text(0.5, 2, 2)
    for i in range(3):
        run(sim, m, T0 + 10 * i)
    assert value(m, "pagedmodel_operator_scale_decisions_total", direction="hold", reason="steady") == 3
    assert value(m, "pagedmodel_operator_scaling_limited") == 0


def test_scrape_failures_are_counted_per_pod():
    sim, m = ClusterSim(AUTO), OperatorMetrics()

    def refuse(url: str) -> str:
        raise ConnectionError("refused")
    sim.load = refuse
    run(sim, m, T0)
    run(sim, m, T0 + 10)
    assert value(m, "pagedmodel_operator_scrape_failures_total", pod="engine-0") == 2
    assert value(m, "pagedmodel_operator_scale_decisions_total", reason="no_metrics") == 2


def test_failed_and_invalid_passes_count_by_kind():
    m = OperatorMetrics()
    m.record("ml", "smollm2", 0.2, None, ApiException(status=409))
    m.record("ml", "smollm2", 0.1, None, RuntimeError("bug"))
    m.record("ml", "smollm2", 0.1, PassReport(error_kind="invalid_spec"))
    for kind in ("kubernetes_api", "internal", "invalid_spec"):
        assert value(m, "pagedmodel_operator_errors_total", kind=kind) == 1
    assert value(m, "pagedmodel_operator_reconcile_passes_total", outcome="error") == 3
    assert {k for k in mc.ERROR_KINDS} == {"kubernetes_api", "internal", "invalid_spec"}


def test_tuner_actions_are_counted():
    m = OperatorMetrics()
    m.record("ml", "smollm2", 0.1, PassReport(tuner_actions=("proposed", "applied")))
    m.record("ml", "smollm2", 0.1, PassReport(tuner_actions=("reverted",)))
    for action in mc.TUNER_ACTIONS:
        assert value(m, "pagedmodel_operator_tuner_events_total", action=action) == 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_metrics_port_serves_the_operators_registry(monkeypatch):
    port = _free_port()
    monkeypatch.setattr(kopf, "run", lambda **kw: None)
    assert main.run(build_parser().parse_args(["operator", f"--metrics-port={port}", "--metrics-host=127.0.0.1"])) == 0
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    assert "# HELP pagedmodel_operator_reconcile_passes_total" in text


def test_metrics_port_in_use_fails_clearly(monkeypatch):
    monkeypatch.setattr(kopf, "run", lambda **kw: pytest.fail("must not start"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(SystemExit, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            main.run(build_parser().parse_args(["operator", f"--metrics-port={port}", "--metrics-host=127.0.0.1"]))


def test_bad_metrics_port_fails_clearly(monkeypatch):
    monkeypatch.setattr(kopf, "run", lambda **kw: None)
    try:
        main.run(build_parser().parse_args(["operator", "--metrics-port=70000"]))
    except SystemExit as exc:
        assert "--metrics-port must be in [0, 65535]" in str(exc)
    else:
        raise AssertionError("accepted port 70000")


def _timer(metrics: OperatorMetrics, monkeypatch, outcome) -> None:
    """Run the registered status timer once, with reconcile replaced by `outcome` (raise or return)."""
    import logging

    from pagedmodel.operator import handlers

    monkeypatch.setattr(handlers, "reconcile", outcome)
    monkeypatch.setattr(handlers, "Kube", lambda api: object())
    monkeypatch.setattr(handlers, "_api_client", lambda: None)
    registry = kopf.OperatorRegistry()
    handlers.register(registry, handlers.OperatorConfig(), metrics)
    (timer,) = registry._spawning.get_all_handlers()
    body = {"metadata": {"name": "smollm2", "namespace": "ml"}, "spec": {}, "status": {}}
    timer.fn(body=body, patch=kopf.Patch(), logger=logging.getLogger("test"))


def test_the_timer_handler_counts_a_failed_pass_and_reraises(monkeypatch):
    m = OperatorMetrics()

    def conflict(*args, **kwargs):
        raise ApiException(status=409, reason="Conflict")
    with pytest.raises(ApiException):
        _timer(m, monkeypatch, conflict)
    assert value(m, "pagedmodel_operator_errors_total", kind="kubernetes_api") == 1
    assert value(m, "pagedmodel_operator_reconcile_passes_total", outcome="error") == 1


def test_the_timer_handler_counts_a_pass_with_its_report(monkeypatch):
    from pagedmodel.operator.reconcile import Outcome

    m = OperatorMetrics()
    _timer(m, monkeypatch, lambda *a, **kw: Outcome({}, report=PassReport(scale_direction="hold",
                                                                          scale_cause="steady", max_replicas=4)))
    assert value(m, "pagedmodel_operator_reconcile_passes_total", outcome="ok") == 1
    assert value(m, "pagedmodel_operator_scale_decisions_total", direction="hold", reason="steady") == 1
    assert value(m, "pagedmodel_operator_max_replicas") == 4
