"""What one reconcile pass did, in the terms the operator's own metrics count (pure).

The reconcile pass returns a PassReport with its Outcome; operator/telemetry.py turns it into Prometheus
samples. Label values come from small fixed sets (pagedmodel.metrics_contract), never free text.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .scaling import ScalingOutcome, ScrapeResult


@dataclass(frozen=True)
class PassReport:
    error_kind: str | None = None          # set when the pass failed (metrics_contract.ERROR_KINDS)
    scale_direction: str | None = None     # up | down | hold; None: the autoscaler did not run this pass
    scale_cause: str | None = None         # autoscaler.CAUSES
    tuner_actions: tuple[str, ...] = ()    # proposed | applied | reverted
    scrape_failures: tuple[str, ...] = ()  # engine and router pods whose /metrics could not be read
    desired_replicas: int | None = None
    ready_replicas: int | None = None
    max_replicas: int | None = None
    scaling_limited: bool = False          # the autoscaler wants more engines than maxReplicas allows


def pass_report(spec: dict[str, Any], status: dict[str, Any], scaling: ScalingOutcome,
                result: ScrapeResult | None, current: int) -> PassReport:
    """The report of a pass that got as far as computing the status."""
    decision = scaling.decision
    direction = cause = None
    if decision is not None:
        direction = "up" if decision.desired > current else "down" if decision.desired < current else "hold"
        cause = decision.cause
    failures: tuple[str, ...] = ()
    if result is not None:
        failures = tuple(s.pod for s in result.scrapes if s.sample is None) + tuple(result.failed_routers)
    auto = spec["autoscaling"]
    limited = any(c.get("type") == "ScalingLimited" and c.get("status") == "True"
                  and "maxReplicas" in (c.get("message") or "") for c in status.get("conditions") or [])
    return PassReport(scale_direction=direction, scale_cause=cause, tuner_actions=tuple(scaling.tuner_actions),
                      scrape_failures=failures, desired_replicas=status.get("desiredReplicas"),
                      ready_replicas=status.get("readyReplicas"),
                      max_replicas=auto["maxReplicas"] if auto["enabled"] else spec["replicas"],
                      scaling_limited=limited)
