"""benchmarks/autoscale_sim.py --quick: the real autoscaler on a queueing model behaves as designed."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "autoscale_sim.py"


def load_sim():
    spec = importlib.util.spec_from_file_location("autoscale_sim", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["autoscale_sim"] = module      # dataclasses resolve the module by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def quick(tmp_path_factory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("sim") / "quick.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(out.read_text()), proc.stdout


def test_scales_up_on_the_spike_within_two_intervals(quick):
    result, _ = quick
    s, cfg = result["summary"], result["config"]
    interval = cfg["autoscaling"]["intervalSeconds"]
    assert s["spike_decision_s"] is not None and s["spike_decision_s"] <= 2 * interval
    # Enough engines serve once the new pods have started (plus a couple of scrapes).
    assert s["spike_capacity_s"] is not None and s["spike_capacity_s"] <= cfg["startup_s"] + 3 * interval
    spike_rows = [r for r in result["timeline"] if s["spike_start"] <= r["t"] < s["spike_start"] + cfg["spike_s"]]
    assert max(r["replicas"] for r in spike_rows) >= s["spike_replicas_needed"]
    assert any(e["panic"] for e in result["events"] if e["t"] >= s["spike_start"])


def test_scales_back_down_after_the_trace(quick):
    result, _ = quick
    s, cfg = result["summary"], result["config"]
    assert s["final_replicas"] == cfg["autoscaling"]["minReplicas"]
    tail_start = [start for name, start, _ in result["phases"] if name == "tail"][0]
    downs = [e for e in result["events"] if e["t"] >= s["spike_start"] and e["to"] < e["from"]]
    assert downs and all(e["to"] >= (e["from"] + 1) // 2 for e in downs)        # at most halving
    # No scale-down before the down window has passed since the spike's last scale-up.
    last_up = max(e["t"] for e in result["events"] if e["to"] > e["from"])
    assert min(e["t"] for e in downs) >= last_up + cfg["autoscaling"]["scaleDownStabilizationSeconds"]
    assert all(r["replicas"] <= 2 for r in result["timeline"] if r["t"] >= tail_start + 240)


def test_no_flapping_on_the_plateau_and_no_stale_decisions(quick):
    result, _ = quick
    s = result["summary"]
    assert s["plateau_scale_events"] == 0
    moves = [1 if e["to"] > e["from"] else -1 for e in result["events"]]
    reversals = sum(1 for a, b in zip(moves, moves[1:]) if a != b)
    assert reversals <= 4, result["events"]       # ramp up, settle, spike, down: no up-down-up cycles
    assert not any(r["frozen"] for r in result["timeline"])


def test_reports_over_provisioning_and_reasons(quick):
    result, stdout = quick
    s = result["summary"]
    assert 0 < s["over_provisioning"] < 1.5
    assert s["replica_seconds"] > s["oracle_replica_seconds"] > 0
    assert "over-provisioning" in stdout and "first scale-up decision after" in stdout
    assert all("load ratio" in e["reason"] and "->" in e["reason"] for e in result["events"])


def test_the_real_policy_drives_the_model():
    sim = load_sim()
    cfg = sim.SimConfig(**sim.QUICK)
    capped = dataclasses.replace(cfg, autoscaling={**cfg.autoscaling, "maxReplicas": 3})
    result = sim.simulate(capped)
    assert result["summary"]["max_replicas"] == 3
    assert any(r["limited"] and r["limited"].startswith("maxReplicas 3 reached") for r in result["timeline"])
    # A capped cluster cannot absorb the spike: the queue shows it.
    s = result["summary"]
    spike = [r for r in result["timeline"] if s["spike_start"] <= r["t"] < s["spike_start"] + cfg.spike_s]
    assert max(r["waiting"] for r in spike) > 100


def test_plot_writes_a_png(tmp_path):
    sim = load_sim()
    cfg = sim.SimConfig(**{**sim.QUICK, "tail_s": 60.0})
    path = tmp_path / "sim.png"
    sim.plot(sim.simulate(cfg), str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_arrival_rate_scaling_cuts_the_spike_overshoot_without_slowing_the_reaction(quick):
    # The same trace scaled on the router's queue alone overshoots the spike 2x (the backlog that builds
    # while pods start reads as demand); on the arrival rate, the backlog only adds what drains it.
    result, _ = quick
    sim = load_sim()
    queue_only = sim.simulate(dataclasses.replace(sim.SimConfig(**sim.QUICK), arrival_signal=False))["summary"]
    s = result["summary"]
    assert s["spike_peak_vs_needed"] <= 1.4 < queue_only["spike_peak_vs_needed"]
    assert s["spike_decision_s"] <= queue_only["spike_decision_s"]
    assert s["over_provisioning"] < queue_only["over_provisioning"]
