"""`python -m e2e.cluster up`, the standalone cluster: a real node that Ctrl-C takes down with its pods.

It starts a node of its own, and a machine holds one: the ``own_node`` marker runs it before the session's
cluster exists (e2e/conftest.py orders it first).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from e2e.kube.local_cluster import KubeCluster
from e2e.node import images
from e2e.target import kubectl_binary

from .helpers import wait_until

REPO = Path(__file__).resolve().parents[2]


def _kubectl(kubeconfig: Path, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, KUBECONFIG=str(kubeconfig), KUBECACHEDIR=str(kubeconfig.parent / "cache"))
    return subprocess.run([kubectl_binary(), *args], env=env, capture_output=True, text=True, timeout=60,
                          input=stdin, check=True)


def _pids_running(marker: str) -> list[int]:
    """Host PIDs of the processes whose command line holds ``marker`` (a container's are host processes)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker in (entry / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.mark.own_node
@pytest.mark.slow
def test_cluster_up_runs_a_real_node_and_ctrl_c_ends_its_pods():
    # Not pytest's tmp_path: from its 100th session on, its paths are too long for the node's unix sockets.
    workdir = Path(tempfile.mkdtemp(prefix="pm-up-"))
    marker = f"sleeper-{uuid.uuid4().hex[:8]}"
    sleeper = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "sleeper"},
               "spec": {"terminationGracePeriodSeconds": 1, "containers": [
                   {"name": "c", "image": images.chart_image(),
                    "command": ["python3", "-c", f"import time; print('{marker}', flush=True); time.sleep(3600)"]}]}}
    proc = subprocess.Popen([sys.executable, "-m", "e2e.cluster", "up", "--workdir", str(workdir), "--gpus", "2"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        banner: dict[str, str] = {}
        lines: list[str] = []
        assert proc.stdout is not None
        while "pod addresses" not in banner:
            line = proc.stdout.readline()
            assert line, f"cluster up exited early (rc={proc.wait()}):\n{''.join(lines)}"
            lines.append(line)
            key, _, value = line.partition(":")
            banner[key.strip()] = value.strip()
        kubeconfig = Path(banner["kubeconfig"])
        assert kubeconfig.is_relative_to(workdir) and banner["pod addresses"].startswith("10.244.0.0/24")
        wide = _kubectl(kubeconfig, "get", "nodes", "-o", "wide", "--no-headers").stdout.split()
        assert wide[1] == "Ready" and wide[4].startswith("v1.37.") and wide[-1].startswith("containerd://"), wide
        node = json.loads(_kubectl(kubeconfig, "get", "node", "-o", "json").stdout)["items"][0]
        assert node["status"]["capacity"]["nvidia.com/gpu"] == "2"

        _kubectl(kubeconfig, "apply", "-f", "-", stdin=json.dumps(sleeper))
        wait_until(lambda: _pids_running(marker), timeout=300, interval=0.5, what="the sleeper's process")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=90) == 0
        assert _pids_running(marker) == []   # the drain ended the container before the node went
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=90)
        shutil.rmtree(workdir, ignore_errors=True)


def test_bad_cluster_settings_are_refused(tmp_path):
    with pytest.raises(ValueError, match="gpus must be >= 0"):
        KubeCluster(gpus=-1)
    deep = tmp_path / ("d" * 60)
    with pytest.raises(ValueError, match="too long for the node's unix sockets"):
        KubeCluster(deep)


def test_cluster_up_rejects_bad_flags():
    result = subprocess.run([sys.executable, "-m", "e2e.cluster", "up", "--gpus", "-1"], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--gpus must be >= 0" in result.stderr
