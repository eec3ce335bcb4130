"""Every query the chart ships, evaluated by a real Prometheus that scraped a running engine, a router
and the operator's metrics endpoint (tests/observability/stack.py), returns data.

How thresholds are handled: an alert expression such as `A > 0.3` is empty whenever the system is
healthy, which says nothing about whether A is right. So each alert is evaluated whole (it must parse
and run) and each of its operands -- the sides of its comparisons and set operations, numbers left
out -- must return at least one finite sample. Dashboard queries are evaluated with Grafana's variables
set (namespace and PagedModel of the stack, every pod, $__rate_interval 1m) and must each return a
finite sample; the annotations' expressions are treated like alerts.
"""
from __future__ import annotations

import math
import time
from pathlib import Path

import pytest

import monitoring
from stack import MODEL, NAMESPACE, Stack

VARIABLES = {"namespace": NAMESPACE, "pagedmodel": MODEL, "pod": ".*"}


@pytest.fixture(scope="module")
def stack(tiny_llama_dir: Path, prometheus_binaries, tmp_path_factory) -> Stack:
    s = Stack(Path(tiny_llama_dir), prometheus_binaries[0], tmp_path_factory.mktemp("stack"))
    try:
        codes = s.traffic()
        assert codes.get("router 429", 0) > 0 and codes.get("engine 200", 0) > 0, codes
        time.sleep(4)      # a few more scrapes after the last request, so every rate() has its increase
        yield s
    finally:
        s.stop()


def finite(result: list[dict]) -> list[dict]:
    return [r for r in result if math.isfinite(float(r["value"][1]))]


def test_every_alert_runs_and_each_operand_returns_data(stack, chart):
    empty = []
    for alert in chart.alerts():
        stack.query(alert["expr"])                         # parses and runs (firing or not)
        for operand in monitoring.operands(alert["expr"]):
            if not finite(stack.query(operand)):
                empty.append(f"{alert['alert']}: {operand}")
    assert not empty, "operands without data:\n" + "\n".join(empty)


def test_every_dashboard_query_returns_data(stack, chart):
    empty = []
    for where, expr in chart.dashboard_queries():
        expr = monitoring.substitute(expr, VARIABLES, "1m")
        parts = monitoring.operands(expr) if where.startswith("annotation") else [expr]
        stack.query(expr)
        empty += [f"{where}: {p}" for p in parts if not finite(stack.query(p))]
    assert not empty, "queries without data:\n" + "\n".join(empty)


def test_series_carry_the_labels_the_chart_groups_by(stack):
    for metric in ("vllm:num_requests_running", "pagedmodel_router_queue_length", "pagedmodel_operator_desired_replicas"):
        (series,) = stack.query(metric)
        labels = series["metric"]
        assert labels["namespace"] == NAMESPACE and labels["pagedmodel"] == MODEL, labels


def test_an_empty_query_is_caught(stack):
    # the check above can fail: a name no program exports returns nothing
    assert not finite(stack.query('vllm:no_such_metric{pagedmodel="smollm2"}'))
