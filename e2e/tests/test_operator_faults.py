"""Operator faults on the real control plane (issue #19): the operator SIGKILLed in the middle of an autoscaler
scale-up, and an engine that cannot load its model. Each test's docstring says the outcome it guards.

The operator and the engines are real processes (`pagedmodel operator`, `pagedmodel serve` with SmolLM2-135M
on CPU); the router is off, so each PagedModel costs only its engine pods.
"""
from __future__ import annotations

import json
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from kubernetes import client as k8s

from .helpers import wait_until
from .test_operator_pagedmodel import operator, pagedmodel_crd, pm_json, stop, wait_phase  # noqa: F401  (fixture)

KINDS = ("deployments", "services", "poddisruptionbudgets", "serviceaccounts", "roles", "rolebindings")
STABLE_WINDOW_S = 60     # longer than the restart takes, so the cooldown it leaves is still running afterwards


def manifest(name: str, spec: dict[str, Any]) -> str:
    return yaml.safe_dump({"apiVersion": "pagedmodel.io/v1alpha1", "kind": "PagedModel",
                           "metadata": {"name": name}, "spec": spec})


def cheap_spec(**extra: Any) -> dict[str, Any]:
    return {"model": {"source": "builtin://smollm2", "servedName": "smollm2"},
            "engine": {"maxNumSeqs": 2, "maxModelLen": 256, "kvCacheMemoryBytes": 16_000_000, "swapSpaceGiB": 0,
                       "device": "cpu"},
            "resources": {"gpus": 0, "cpu": "1", "memory": "2Gi"}, **extra}


def children(cluster, namespace: str, name: str) -> dict[str, list[str]]:
    return {k: sorted(i["metadata"]["name"] for i in cluster.kubectl_json(
        "get", k, "-l", f"pagedmodel.io/name={name}", namespace=namespace)["items"]) for k in KINDS}


def engine_pods(cluster, namespace: str, name: str) -> list[dict[str, Any]]:
    pods = cluster.kubectl_json("get", "pods", "-l", f"pagedmodel.io/name={name},app.kubernetes.io/component=engine",
                                namespace=namespace)["items"]
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def ready_count(pods: list[dict[str, Any]]) -> int:
    return sum(any(c["type"] == "Ready" and c["status"] == "True" for c in (p.get("status") or {}).get("conditions")
                   or []) for p in pods)


def reasons(cluster, namespace: str, name: str) -> list[str]:
    return [e["reason"] for e in cluster.kubectl_json("get", "events", "--field-selector",
                                                       f"involvedObject.name={name}", namespace=namespace)["items"]]


def epoch(iso: str) -> float:
    from pagedmodel.operator.scaling import epoch as parse
    value = parse(iso)
    assert value is not None, iso
    return value


class Load:
    """Streamed completions against one engine pod, `clients` at a time, until stopped: enough KV in use
    (and requests waiting behind maxNumSeqs) to ask the autoscaler for a second engine."""

    def __init__(self, url: str, clients: int) -> None:
        self.url, self.stop = url, threading.Event()
        self.threads = [threading.Thread(target=self.run, daemon=True) for _ in range(clients)]

    def run(self) -> None:
        body = {"model": "smollm2", "prompt": "Tell me a long story about a dragon.", "max_tokens": 60,
                "ignore_eos": True, "temperature": 0}
        with httpx.Client(timeout=120) as client:
            while not self.stop.is_set():
                try:
                    client.post(f"{self.url}/v1/completions", json=body)
                except httpx.HTTPError:
                    time.sleep(0.5)

    def __enter__(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()      # no join: a request in flight finishes on its own (daemon threads)


@pytest.mark.slow
def test_operator_killed_during_an_autoscaler_scale_up(cluster, namespace, pagedmodel_crd, tmp_path, local_node):
    """Guards: SIGKILL the operator while the autoscaler scales a PagedModel 1 -> 2 under load (its decision
    made, the second engine still starting); a new operator converges on 2 ready engines without deciding
    again (the same status.lastScale and scaleHistory, the same lastScaleTime in status.autoscaler.state),
    creates no duplicate children and rolls nothing; and the cooldown it inherited holds: with the load gone,
    the scale back down waits for the stable window measured from the decision made before the kill."""
    name, log = "killed", tmp_path / "operator.log"
    auto = {"enabled": True, "minReplicas": 1, "maxReplicas": 2, "intervalSeconds": 2, "targetKVCacheUsage": 0.05,
            "targetWaitingPerReplica": 1, "stableWindowSeconds": STABLE_WINDOW_S, "scaleDownStabilizationSeconds": 5}
    spec = cheap_spec(autoscaling=auto)
    spec["engine"]["maxNumSeqs"] = 1          # a second client waits: both signals say "more engines"
    with operator(cluster, namespace, log) as op:
        cluster.kubectl("apply", "-f", "-", stdin=manifest(name, spec), namespace=namespace)
        wait_phase(cluster, namespace, "Ready", generation=1, name=name, timeout=240)
        before = children(cluster, namespace, name)
        [pod] = engine_pods(cluster, namespace, name)
        # Polled through the API client (milliseconds, not kubectl's tenths) so that the kill often lands
        # between the decision's status write and the Deployment's resize.
        objects = k8s.CustomObjectsApi(cluster.api_client())
        with Load(f"http://{pod['status']['podIP']}:8000", clients=2):
            up = wait_until(lambda: (lambda s: s if (s.get("lastScale") or {}).get("to") == 2 else None)(
                objects.get_namespaced_custom_object("pagedmodel.io", "v1alpha1", namespace, "pagedmodels", name)
                .get("status") or {}), timeout=120, interval=0.005, what="the scale-up decision")
            stop(op, signal.SIGKILL)          # no graceful shutdown
    resized = cluster.kubectl_json("get", "deployment", f"{name}-engine", namespace=namespace)["spec"]["replicas"]
    print(f"engine Deployment replicas at the kill: {resized} (1: killed between the decision and the resize)")
    assert ready_count(engine_pods(cluster, namespace, name)) < 2, "the scale-up had finished before the kill"
    decided = up["autoscaler"]["state"]

    with operator(cluster, namespace, log):
        st = wait_until(lambda: (lambda s: s if s.get("phase") == "Ready" and s.get("ready") == "2/2" else None)(
            pm_json(cluster, namespace, name)["status"]), timeout=240, interval=1, what="2/2 engines ready")
        assert st["lastScale"] == up["lastScale"] and st["scaleHistory"] == up["scaleHistory"]
        assert [h["to"] for h in st["scaleHistory"]] == [2]
        assert st["autoscaler"]["state"]["lastScaleTime"] == decided["lastScaleTime"]
        assert children(cluster, namespace, name) == before                       # no duplicates
        replica_sets = cluster.kubectl_json("get", "rs", "-l", f"pagedmodel.io/name={name}", namespace=namespace)
        assert len([rs for rs in replica_sets["items"] if "engine" in rs["metadata"]["name"]]) == 1, \
            "the restart rolled the engines"
        assert len(engine_pods(cluster, namespace, name)) == 2

        # The inherited cooldown: no scale-down before the stable window since the pre-kill decision has passed.
        down = wait_until(lambda: (lambda s: s if s.get("desiredReplicas") == 1 else None)(
            pm_json(cluster, namespace, name)["status"]), timeout=STABLE_WINDOW_S + 90, interval=1,
            what="the scale back down")
        waited = epoch(down["lastScale"]["time"]) - decided["lastScaleTime"]
        assert waited >= STABLE_WINDOW_S - 1, f"scaled down {waited:.0f} s after the scale-up"
        assert [h["to"] for h in down["scaleHistory"]] == [2, 1]
    assert "Traceback" not in log.read_text(errors="replace"), log.read_text(errors="replace")[-4000:]


def _corrupt_model(src: Path, dst: Path) -> Path:
    """SmolLM2's config and tokenizer with its weights cut in half: what an interrupted copy leaves."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and f.name != "model.safetensors" and not f.name.startswith("."):
            shutil.copyfile(f, dst / f.name)
    with open(src / "model.safetensors", "rb") as whole, open(dst / "model.safetensors", "wb") as half:
        half.write(whole.read((src / "model.safetensors").stat().st_size // 2))
    return dst


def test_a_corrupt_model_on_a_volume_shows_in_describe_pm(cluster, namespace, pagedmodel_crd, tmp_path, local_node):
    """Guards: an engine whose model directory holds truncated weights exits with one line; the pod's
    termination message (FallbackToLogsOnError) carries it, and the PagedModel goes Degraded saying it in
    status.message, the Degraded condition and a Warning event, so `kubectl describe pm` shows why."""
    from pagedmodel.operator.desired_state import MODEL_MOUNT
    from pagedmodel.server.engine.model_store import resolve_model

    name, claim, pv = "corrupt", "models", f"{namespace}-models"
    # Local pods are host processes and volumes are not mounted: the engine reads MODEL_MOUNT on this machine.
    host_dir = _corrupt_model(resolve_model(None), Path(MODEL_MOUNT) / namespace)
    volume = {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv}, "spec": {
        "capacity": {"storage": "1Gi"}, "accessModes": ["ReadOnlyMany"], "storageClassName": "",
        "hostPath": {"path": MODEL_MOUNT}, "claimRef": {"namespace": namespace, "name": claim}}}
    pvc = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": claim}, "spec": {
        "accessModes": ["ReadOnlyMany"], "storageClassName": "", "volumeName": pv,
        "resources": {"requests": {"storage": "1Gi"}}}}
    try:
        cluster.kubectl("apply", "-f", "-", stdin=json.dumps(volume))
        cluster.kubectl("apply", "-f", "-", stdin=json.dumps(pvc), namespace=namespace)
        spec = cheap_spec()
        spec["model"]["source"] = f"pvc://{claim}/{namespace}"
        with operator(cluster, namespace, tmp_path / "operator.log"):
            cluster.kubectl("apply", "-f", "-", stdin=manifest(name, spec), namespace=namespace)
            pm = wait_phase(cluster, namespace, "Degraded", name=name, timeout=180)
            said = f"{host_dir}/model.safetensors is truncated or corrupt"
            message = pm["status"]["message"]
            assert said in message and "exit code 2: pagedmodel serve: error: cannot load the model:" in message, message
            degraded = next(c for c in pm["status"]["conditions"] if c["type"] == "Degraded")
            assert degraded["status"] == "True" and said in degraded["message"]
            [pod] = engine_pods(cluster, namespace, name)
            terminated = pod["status"]["containerStatuses"][0]["lastState"]["terminated"]
            assert terminated["exitCode"] == 2 and said in terminated["message"].splitlines()[-1]
            warned = wait_until(lambda: [e for e in cluster.kubectl_json(
                "get", "events", "--field-selector", f"involvedObject.name={name}", namespace=namespace)["items"]
                if e["reason"] == "Degraded"], timeout=30, what="the Degraded event")    # kopf posts from a queue
            assert warned[0]["type"] == "Warning" and said in warned[0]["message"], warned
            described = cluster.kubectl("describe", "pm", name, namespace=namespace).stdout
            assert said in described and "Degraded" in described, described
            assert "Traceback" not in terminated["message"]
    finally:
        cluster.kubectl("delete", "pv", pv, "--wait=false", check=False)
        shutil.rmtree(host_dir, ignore_errors=True)
