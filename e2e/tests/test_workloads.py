"""Deployments whose pods are real processes: probes, scaling, restarts, rolling updates, scheduling."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request

import pytest
import yaml

from .helpers import wait_until
from .workloads import web_deployment, web_service


def _apply(cluster, namespace, *docs):
    cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(docs), namespace=namespace)


def _pods(cluster, namespace, selector="app=web"):
    return cluster.kubectl_json("get", "pods", "-l", selector, namespace=namespace)["items"]


def _ready(pod) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod.get("status", {}).get("conditions", []))


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.read().decode()


def _kill_container(cluster, namespace, pod) -> None:
    """End the container's process abruptly: SIGKILL locally, /exit inside a real pod."""
    if cluster.is_local:
        pid = int(pod["status"]["containerStatuses"][0]["containerID"].split("://")[1])
        os.kill(pid, signal.SIGKILL)
    else:
        cluster.kubectl("exec", pod["metadata"]["name"], "--", "python", "-c",
                        "import urllib.request,os;urllib.request.urlopen('http://%s:8080/exit' % os.environ['POD_IP'])",
                        namespace=namespace, check=False)


def test_deployment_ready_scale_restart_logs(cluster, namespace):
    _apply(cluster, namespace, web_deployment(replicas=1), web_service())
    cluster.kubectl("rollout", "status", "deployment/web", "--timeout=90s", namespace=namespace, timeout=100)
    [pod] = _pods(cluster, namespace)
    assert _ready(pod) and pod["status"]["phase"] == "Running"
    with cluster.service_url(namespace, "web", 80) as url:
        assert _get(url + "/").split() == [pod["metadata"]["name"], "v1"]

    cluster.kubectl("scale", "deployment/web", "--replicas=3", namespace=namespace)
    cluster.kubectl("rollout", "status", "deployment/web", "--timeout=90s", namespace=namespace, timeout=100)
    pods = _pods(cluster, namespace)
    assert len(pods) == 3 and all(_ready(p) for p in pods)
    ips = {p["status"]["podIP"] for p in pods}
    assert len(ips) == 3
    # (No Endpoints/EndpointSlice check: kube-apiserver refuses loopback addresses in them, and our pods
    # live on 127.x; service_url() picks a ready selected pod instead, as kube-proxy would.)
    deploy = cluster.kubectl_json("get", "deployment", "web", namespace=namespace)
    assert {k: deploy["status"].get(k) for k in ("replicas", "readyReplicas", "availableReplicas",
                                                  "updatedReplicas")} == dict.fromkeys(
        ("replicas", "readyReplicas", "availableReplicas", "updatedReplicas"), 3)
    assert deploy["status"]["observedGeneration"] == deploy["metadata"]["generation"]

    victim = pods[0]
    _kill_container(cluster, namespace, victim)

    def restarted():
        pod = cluster.kubectl_json("get", "pod", victim["metadata"]["name"], namespace=namespace)
        status = pod["status"]["containerStatuses"][0]
        return pod if status["restartCount"] >= 1 and _ready(pod) else None

    pod = wait_until(restarted, timeout=60, what="killed container restarted and Ready again")
    assert "terminated" in pod["status"]["containerStatuses"][0]["lastState"]
    logs = cluster.kubectl("logs", victim["metadata"]["name"], namespace=namespace).stdout
    assert "serving on" in logs and "GET /ready" in logs
    previous = cluster.kubectl("logs", victim["metadata"]["name"], "--previous", namespace=namespace).stdout
    assert "serving on" in previous
    described = cluster.kubectl("describe", "pod", victim["metadata"]["name"], namespace=namespace).stdout
    assert "Scheduled" in described and "Started" in described

    cluster.kubectl("scale", "deployment/web", "--replicas=1", namespace=namespace)
    wait_until(lambda: len(_pods(cluster, namespace)) == 1, timeout=60, what="scale down to 1 pod")


def test_rolling_update_keeps_minimum_available(cluster, namespace):
    replicas, max_unavailable = 3, 1
    _apply(cluster, namespace, web_deployment(replicas=replicas, max_surge=1, max_unavailable=max_unavailable,
                                              readiness_delay=1))
    cluster.kubectl("rollout", "status", "deployment/web", "--timeout=90s", namespace=namespace, timeout=100)
    samples: list[int] = []
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            pods = _pods(cluster, namespace)
            samples.append(sum(1 for p in pods if _ready(p) and not p["metadata"].get("deletionTimestamp")))
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        _apply(cluster, namespace, web_deployment(replicas=replicas, version="v2", max_surge=1,
                                                  max_unavailable=max_unavailable, readiness_delay=1))
        cluster.kubectl("rollout", "status", "deployment/web", "--timeout=120s", namespace=namespace, timeout=130)
    finally:
        stop.set()
        sampler.join(timeout=10)
    assert samples and min(samples) >= replicas - max_unavailable, samples
    pods = wait_until(lambda: (lambda ps: ps if len(ps) == replicas else None)(_pods(cluster, namespace)),
                      what="old pods gone")
    versions = {e["value"] for p in pods for e in p["spec"]["containers"][0]["env"] if e["name"] == "VERSION"}
    assert versions == {"v2"}
    rs = cluster.kubectl_json("get", "replicasets", "-l", "app=web", namespace=namespace)["items"]
    assert sorted(r["spec"]["replicas"] for r in rs) == [0, replicas]
    deploy = cluster.kubectl_json("get", "deployment", "web", namespace=namespace)
    assert deploy["metadata"]["annotations"]["deployment.kubernetes.io/revision"] == "2"
    progressing = {c["type"]: c for c in deploy["status"]["conditions"]}["Progressing"]
    assert progressing["reason"] == "NewReplicaSetAvailable"


def test_pod_that_does_not_fit_stays_pending(cluster, namespace):
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "hungry"},
           "spec": {"containers": [{"name": "c", "image": "python:3.11-slim", "command": ["python", "-c", "0"],
                                    "resources": {"limits": {"nvidia.com/gpu": "1000"}}}]}}
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps(pod), namespace=namespace)

    def unschedulable():
        live = cluster.kubectl_json("get", "pod", "hungry", namespace=namespace)
        cond = {c["type"]: c for c in live.get("status", {}).get("conditions", [])}.get("PodScheduled")
        return (live, cond) if cond and cond["status"] == "False" else None

    live, cond = wait_until(unschedulable, what="PodScheduled=False")
    assert live["status"]["phase"] == "Pending" and cond["reason"] == "Unschedulable"
    assert "Insufficient nvidia.com/gpu" in cond["message"]
    described = cluster.kubectl("describe", "pod", "hungry", namespace=namespace).stdout
    assert "FailedScheduling" in described


def test_graceful_termination_escalates_to_sigkill(cluster, namespace, local_node):
    stubborn = "import signal, time\nsignal.signal(signal.SIGTERM, lambda *_: print('ignoring SIGTERM', " \
               "flush=True))\nprint('up', flush=True)\nwhile True: time.sleep(0.1)\n"
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "stubborn"},
           "spec": {"terminationGracePeriodSeconds": 2,
                    "containers": [{"name": "c", "image": "python:3.11-slim", "command": ["python", "-c", stubborn]}]}}
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps(pod), namespace=namespace)
    live = wait_until(lambda: (lambda p: p if p["status"].get("phase") == "Running" and "running" in
                               p["status"]["containerStatuses"][0]["state"] else None)(
        cluster.kubectl_json("get", "pod", "stubborn", namespace=namespace)), what="pod running")
    pid = int(live["status"]["containerStatuses"][0]["containerID"].split("://")[1])
    wait_until(lambda: "up" in cluster.kubectl("logs", "stubborn", namespace=namespace).stdout, what="log line")
    start = time.monotonic()
    cluster.kubectl("delete", "pod", "stubborn", "--timeout=30s", namespace=namespace, timeout=40)
    elapsed = time.monotonic() - start
    assert 1.5 <= elapsed < 15, elapsed
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_recreate_strategy_replaces_all_pods(cluster, namespace):
    first = web_deployment(name="rec", replicas=2)
    first["spec"]["strategy"] = {"type": "Recreate"}
    _apply(cluster, namespace, first)
    cluster.kubectl("rollout", "status", "deployment/rec", "--timeout=90s", namespace=namespace, timeout=100)
    old = {p["metadata"]["name"] for p in _pods(cluster, namespace, "app=rec")}
    second = web_deployment(name="rec", replicas=2, version="v2")
    second["spec"]["strategy"] = {"type": "Recreate"}
    mixed: list[bool] = []
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            pods = [p for p in _pods(cluster, namespace, "app=rec") if _ready(p)]
            names = {p["metadata"]["name"] for p in pods}
            mixed.append(bool(names & old) and bool(names - old))
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        _apply(cluster, namespace, second)
        cluster.kubectl("rollout", "status", "deployment/rec", "--timeout=90s", namespace=namespace, timeout=100)
    finally:
        stop.set()
        sampler.join(timeout=10)
    assert not any(mixed), "Recreate ran old and new pods side by side"
    new = {p["metadata"]["name"] for p in _pods(cluster, namespace, "app=rec")}
    assert len(new) == 2 and not new & old
