"""The standalone cluster command and process hygiene: nothing the harness starts outlives it."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from pathlib import Path

import pytest

from e2e.cluster import LocalCluster
from e2e.target import kubectl_binary

from .helpers import wait_until

REPO = Path(__file__).resolve().parents[2]
SLEEPER = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "sleeper"},
           "spec": {"terminationGracePeriodSeconds": 1,
                    "containers": [{"name": "c", "image": "python:3.11-slim",
                                    "command": ["python", "-c", "import time; print('up', flush=True); "
                                                "time.sleep(3600)"]}]}}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers signal 0; it no longer runs.
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _kubectl(kubeconfig: Path, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, KUBECONFIG=str(kubeconfig), KUBECACHEDIR=str(kubeconfig.parent / "cache"))
    return subprocess.run([kubectl_binary(), *args], env=env, capture_output=True, text=True, timeout=60,
                          input=stdin, check=True)


def _pod_pid(kubeconfig: Path) -> int:
    def running():
        pod = json.loads(_kubectl(kubeconfig, "get", "pod", "sleeper", "-o", "json").stdout)
        statuses = pod.get("status", {}).get("containerStatuses") or []
        return statuses and "running" in statuses[0]["state"] and statuses[0]["containerID"]

    return int(wait_until(running, what="sleeper running").split("://")[1])


def test_stop_ends_every_pod_process(local_node, tmp_path):
    cluster = LocalCluster(tmp_path / "c").start()
    try:
        _kubectl(cluster.kubeconfig, "apply", "-f", "-", stdin=json.dumps(SLEEPER))
        pid = _pod_pid(cluster.kubeconfig)
        assert _alive(pid)
    finally:
        cluster.stop()
    assert not _alive(pid)


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGKILL])
def test_cluster_up_command(local_node, tmp_path, stop_signal):
    workdir = tmp_path / "up"
    proc = subprocess.Popen([sys.executable, "-m", "e2e.cluster", "up", "--node", "process", "--workdir", str(workdir),
                             "--gpus", "2"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        banner = {}
        assert proc.stdout is not None
        while "pod addresses" not in banner:
            line = proc.stdout.readline()
            assert line, f"cluster up exited early (rc={proc.poll()})"
            key, _, value = line.partition(":")
            banner[key.strip()] = value.strip()
        kubeconfig = Path(banner["kubeconfig"])
        assert kubeconfig == workdir / "kubeconfig" and banner["pod addresses"].startswith("127.")
        node = json.loads(_kubectl(kubeconfig, "get", "node", "-o", "json").stdout)["items"][0]
        assert node["status"]["capacity"]["nvidia.com/gpu"] == "2"
        _kubectl(kubeconfig, "apply", "-f", "-", stdin=json.dumps(SLEEPER))
        pid = _pod_pid(kubeconfig)
        proc.send_signal(stop_signal)
        rc = proc.wait(timeout=30)
        assert rc == (0 if stop_signal == signal.SIGINT else -signal.SIGKILL)
        # Even when the harness is killed outright, the kernel takes its pods with it (PR_SET_PDEATHSIG).
        wait_until(lambda: not _alive(pid), timeout=10, what="pod process gone")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()



@pytest.mark.parametrize("kwargs,message", [({"node_capacity": {"cpu": "lots"}}, "cpu='lots' is not a valid quantity"),
                                            ({"node_capacity": {"nvidia.com/gpu": "-1"}}, "must not be negative"),
                                            ({"restart_backoff_s": 0}, "restart_backoff_s must be > 0")])
def test_bad_cluster_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LocalCluster(**kwargs)


def test_cluster_up_rejects_bad_flags():
    result = subprocess.run([sys.executable, "-m", "e2e.cluster", "up", "--memory", "plenty"], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--memory: quantities must match" in result.stderr
