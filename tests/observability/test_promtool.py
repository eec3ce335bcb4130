"""The chart's alert rules through the real promtool: they parse (`check rules`) and each alert fires on
synthetic series that cross its threshold and stays silent on series that do not (`test rules`,
tests/observability/alerts_test.yaml)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent


def write_rules(groups: dict, directory: Path) -> Path:
    path = directory / "rules.yaml"
    path.write_text(yaml.safe_dump(groups, sort_keys=False))
    return path


def promtool_run(promtool: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(promtool), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_check_rules_passes(promtool, chart, tmp_path):
    rules = write_rules(chart.rule_groups(), tmp_path)
    got = promtool_run(promtool, "check", "rules", str(rules), cwd=tmp_path)
    assert got.returncode == 0, got.stdout + got.stderr
    assert f"SUCCESS: {len(chart.alerts())} rules found" in got.stdout


def test_check_rules_refuses_a_broken_expression(promtool, chart, tmp_path):
    groups = chart.rule_groups()
    groups["groups"][0]["rules"][0]["expr"] = "sum by (pod) (rate(vllm:prompt_tokens_total[5m]) >"
    got = promtool_run(promtool, "check", "rules", str(write_rules(groups, tmp_path)), cwd=tmp_path)
    assert got.returncode != 0 and "FAILED" in got.stdout + got.stderr


def test_unit_tests_cover_every_alert_firing_and_silent(chart):
    tests = yaml.safe_load((HERE / "alerts_test.yaml").read_text())["tests"]
    fired = {c["alertname"] for t in tests for c in t["alert_rule_test"] if c["exp_alerts"]}
    silent = {c["alertname"] for t in tests for c in t["alert_rule_test"] if not c["exp_alerts"]}
    names = {a["alert"] for a in chart.alerts()}
    assert fired == names and silent == names
    # and each firing case has a PagedModel that stays silent in the same series set
    for t in tests:
        firing = [a for c in t["alert_rule_test"] for a in c["exp_alerts"]]
        series_models = {s["series"].split('pagedmodel="')[1].split('"')[0] for s in t["input_series"]
                         if 'pagedmodel="' in s["series"]}
        assert series_models - {a["exp_labels"]["pagedmodel"] for a in firing}, t["name"]


def test_alerts_fire_and_stay_silent_as_the_unit_tests_say(promtool, chart, tmp_path):
    write_rules(chart.rule_groups(), tmp_path)
    shutil.copy(HERE / "alerts_test.yaml", tmp_path / "alerts_test.yaml")
    got = promtool_run(promtool, "test", "rules", "alerts_test.yaml", cwd=tmp_path)
    assert got.returncode == 0 and "SUCCESS" in got.stdout, got.stdout + got.stderr


def test_unit_tests_fail_when_an_alert_changes(promtool, chart, tmp_path):
    groups = chart.rule_groups()
    for g in groups["groups"]:
        for r in g["rules"]:
            if r.get("alert") == "PagedModelKVCacheFragmented":
                r["expr"] = r["expr"].replace("> 0.3", "> 0.6")      # 0.5 no longer fires
    write_rules(groups, tmp_path)
    shutil.copy(HERE / "alerts_test.yaml", tmp_path / "alerts_test.yaml")
    got = promtool_run(promtool, "test", "rules", "alerts_test.yaml", cwd=tmp_path)
    assert "FAILED" in got.stdout + got.stderr and "PagedModelKVCacheFragmented" in got.stdout + got.stderr
