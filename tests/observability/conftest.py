"""Fixtures of the observability tests: the real Prometheus binaries (fetched once, a failure fails the
tests), and the chart rendered with every monitoring option on."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))                       # prometheus_tools, monitoring
sys.path.insert(0, str(HERE.parent / "operator"))   # the operator tests' fake cluster (test_scaling)

import monitoring  # noqa: E402
import prometheus_tools  # noqa: E402


@pytest.fixture(scope="session")
def prometheus_binaries() -> tuple[Path, Path]:
    try:
        return prometheus_tools.binaries()
    except prometheus_tools.PrometheusUnavailable as exc:
        pytest.fail(f"Prometheus is required for the observability tests: {exc}")


@pytest.fixture(scope="session")
def promtool(prometheus_binaries: tuple[Path, Path]) -> Path:
    return prometheus_binaries[1]


@pytest.fixture(scope="session")
def chart() -> monitoring.Rendered:
    return monitoring.render()
