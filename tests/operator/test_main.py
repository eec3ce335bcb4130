"""`pagedmodel operator`: flags reach kopf.run, handlers are registered on a fresh registry, bad flags fail."""
from __future__ import annotations

import kopf
import pytest

from pagedmodel.operator import main
from pagedmodel.cli import build_parser


def run_with(monkeypatch, argv: list[str]) -> dict:
    seen: dict = {}
    monkeypatch.setattr(kopf, "run", lambda **kw: seen.update(kw))
    args = build_parser().parse_args(["operator", *argv])
    assert main.run(args) == 0
    return seen


def test_namespaces_and_standalone(monkeypatch):
    kw = run_with(monkeypatch, ["-n", "team-a", "-n", "team-b", "--status-interval", "2", "--router", "disabled"])
    assert kw["namespaces"] == ["team-a", "team-b"] and kw["clusterwide"] is False and kw["standalone"] is True
    registry = kw["registry"]
    assert registry is not kopf.get_default_registry()
    ids = sorted({h.id for h in registry._changing.get_all_handlers()} |
                 {h.id for h in registry._spawning.get_all_handlers()})
    assert ids == ["create", "resume", "status", "update/spec"]
    timer = next(iter(registry._spawning.get_all_handlers()))
    assert timer.interval == 2


def test_cluster_wide_by_default(monkeypatch):
    kw = run_with(monkeypatch, [])
    assert kw["clusterwide"] is True and kw["namespaces"] == [] and kw["liveness_endpoint"] is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["operator", "--pod-bind", "localhost"])


def test_bad_flags_fail_clearly(monkeypatch, capsys):
    monkeypatch.setattr(kopf, "run", lambda **kw: pytest.fail("must not start"))
    with pytest.raises(SystemExit, match="--status-interval must be > 0"):
        main.run(build_parser().parse_args(["operator", "--status-interval", "0"]))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["operator", "-n", "a", "-A"])       # mutually exclusive
    assert "not allowed with argument" in capsys.readouterr().err
