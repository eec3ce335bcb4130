"""The operator's own Prometheus metrics (names in pagedmodel.metrics_contract), served on their own port.

`OperatorMetrics.record` turns one pass -- its PassReport, how long it took and, when it raised, the
exception -- into samples. Labels name the PagedModel (namespace, pagedmodel); the chart's PodMonitor
keeps them (honorLabels) rather than the operator pod's namespace.
"""
from __future__ import annotations

from typing import Any

from kubernetes.client.exceptions import ApiException
from prometheus_client import CollectorRegistry, start_http_server

from pagedmodel import metrics_contract as mc

from .autoscaler import CAUSES
from .pass_report import PassReport


def error_kind(exc: BaseException) -> str:
    """A failed pass's exception as one of metrics_contract.ERROR_KINDS."""
    return "kubernetes_api" if isinstance(exc, ApiException) else "internal"


class OperatorMetrics:
    """The operator's collectors, in a registry of their own (tests run several in one process)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.passes = mc.register(mc.RECONCILE_PASSES, r)
        self.duration = mc.register(mc.RECONCILE_DURATION, r)
        self.errors = mc.register(mc.RECONCILE_ERRORS, r)
        self.decisions = mc.register(mc.SCALE_DECISIONS, r)
        self.tuner = mc.register(mc.TUNER_EVENTS, r)
        self.scrape_failures = mc.register(mc.SCRAPE_FAILURES, r)
        self.desired = mc.register(mc.DESIRED_REPLICAS, r)
        self.ready = mc.register(mc.READY_REPLICAS, r)
        self.max = mc.register(mc.MAX_REPLICAS, r)
        self.limited = mc.register(mc.SCALING_LIMITED, r)

    def record(self, namespace: str, name: str, seconds: float, report: PassReport | None,
               exc: BaseException | None = None) -> None:
        """One pass: `report` from its Outcome, or `exc` when it raised before returning one."""
        kind = error_kind(exc) if exc is not None else (report.error_kind if report else None)
        self._initialise(namespace, name)
        self.passes.labels(namespace, name, "error" if kind else "ok").inc()
        self.duration.labels(namespace, name).observe(max(0.0, seconds))
        if kind:
            self.errors.labels(namespace, name, kind).inc()
        if report is None:
            return
        if report.scale_direction is not None:
            cause = report.scale_cause if report.scale_cause in CAUSES else "steady"
            self.decisions.labels(namespace, name, report.scale_direction, cause).inc()
        for action in report.tuner_actions:
            self.tuner.labels(namespace, name, action).inc()
        for pod in report.scrape_failures:
            self.scrape_failures.labels(namespace, name, pod).inc()
        for gauge, value in ((self.desired, report.desired_replicas), (self.ready, report.ready_replicas),
                             (self.max, report.max_replicas)):
            if value is not None:
                gauge.labels(namespace, name).set(value)
        if report.error_kind is None:
            self.limited.labels(namespace, name).set(1 if report.scaling_limited else 0)

    def _initialise(self, namespace: str, name: str) -> None:
        # Every fixed label value exists from the first pass at 0, so rate() and increase() have a
        # series to start from and a first error or revert shows as an increase, not as a new series.
        for outcome in ("ok", "error"):
            self.passes.labels(namespace, name, outcome)
        for kind in mc.ERROR_KINDS:
            self.errors.labels(namespace, name, kind)
        for action in mc.TUNER_ACTIONS:
            self.tuner.labels(namespace, name, action)

    def serve(self, port: int, addr: str = "0.0.0.0") -> Any:
        """Serve /metrics on `port` in a daemon thread; returns the server (shutdown() stops it)."""
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        return server
