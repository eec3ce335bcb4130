"""kube-apiserver and etcd restarted while a PagedModel is serving: completions keep flowing through
the router and the engine while the API is down; afterwards the operator and the router reconnect
(a spec change is reconciled; a replaced engine pod is discovered by the router's watch), there
are no duplicate children, and the status is still there. And kube-apiserver SIGKILLed in the middle of a
reconcile pass that touches several children: the change is finished, nothing duplicated."""
from __future__ import annotations

import copy
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from .helpers import wait_until
from .test_operator_pagedmodel import operator, pagedmodel_crd, wait_phase  # noqa: F401  (fixture)

REPO = Path(__file__).resolve().parents[2]
NAME = "restart"
KINDS = ("deployments", "services", "poddisruptionbudgets", "serviceaccounts", "roles", "rolebindings")



def children(cluster, namespace):
    return {k: sorted(i["metadata"]["name"] for i in cluster.kubectl_json(
        "get", k, "-l", f"pagedmodel.io/name={NAME}", namespace=namespace)["items"]) for k in KINDS}


def complete(url: str) -> int:
    try:
        return httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": "smollm2", "prompt": "The capital of France is", "max_tokens": 2, "temperature": 0}).status_code
    except httpx.HTTPError:
        return 0


class Traffic(threading.Thread):
    """Completions through the router, one after another, recording each status code."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.codes, self.done = url, [], threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.codes.append(complete(self.url))


@pytest.mark.slow
def test_operator_and_router_survive_api_server_and_etcd_restarts(cluster, namespace, pagedmodel_crd, tmp_path):
    """Guards: with kube-apiserver and then etcd restarted under traffic, completions keep finishing (every
    one a 200) while the API is down; afterwards the operator reconciles a spec change with the status intact
    and no duplicate children, and the router's pod watch finds a replacement engine pod on its new IP."""
    pm = copy.deepcopy(yaml.safe_load((REPO / "examples" / "cpu-tiny.yaml").read_text()))
    pm["metadata"]["name"] = NAME
    pm["spec"]["router"] = {"replicas": 1}
    with operator(cluster, namespace, tmp_path / "operator.log", router="enabled"):
        cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(pm), namespace=namespace)
        wait_phase(cluster, namespace, "Ready", generation=1, name=NAME, timeout=240)
        before = children(cluster, namespace)
        with cluster.service_url(namespace, NAME, 80) as url:
            wait_until(lambda: complete(url) == 200, timeout=60, what="a completion through the router")
            traffic = Traffic(url)
            traffic.start()
            for component in ("kube-apiserver", "etcd"):
                served = len(traffic.codes)
                cluster.local.control_plane.restart(component)
                assert len(traffic.codes) > served, f"no completion finished while {component} restarted"
            traffic.done.set()
            traffic.join(timeout=60)
            assert traffic.codes and set(traffic.codes) == {200}, traffic.codes

            # The operator reconnected: a spec change is reconciled, status intact, no duplicates.
            cluster.kubectl("patch", "pm", NAME, "--type=merge", "-p", '{"spec":{"service":{"port":8080}}}',
                            namespace=namespace)
            pm_live = wait_phase(cluster, namespace, "Ready", generation=2, name=NAME, timeout=120)
            assert pm_live["status"]["ready"] == "1/1"
            assert children(cluster, namespace) == before

            # The router reconnected its watch: a replacement engine pod (new IP) is discovered.
            old = cluster.kubectl_json("get", "pods", "-l", f"pagedmodel.io/name={NAME},"
                                       "app.kubernetes.io/component=engine", namespace=namespace)["items"][0]
            cluster.kubectl("delete", "pod", old["metadata"]["name"], "--wait=false", namespace=namespace)
        with cluster.service_url(namespace, NAME, 8080) as url:
            wait_until(lambda: complete(url) == 200 and _engine_ips(cluster, namespace) not in
                       ([], [old["status"]["podIP"]]), timeout=240, interval=1,
                       what="a completion through the router to the replacement engine")
        assert children(cluster, namespace) == before


def _engine_ips(cluster, namespace):
    pods = cluster.kubectl_json("get", "pods", "-l", f"pagedmodel.io/name={NAME},app.kubernetes.io/component=engine",
                                namespace=namespace)["items"]
    return sorted(p["status"].get("podIP", "") for p in pods if p["metadata"].get("deletionTimestamp") is None)


MID = "midpass"


def _max_num_seqs(apps, namespace: str) -> str | None:
    from kubernetes.client.exceptions import ApiException
    try:
        dep = apps.read_namespaced_deployment(f"{MID}-engine", namespace)
    except (ApiException, OSError):
        return None
    args = dep.spec.template.spec.containers[0].args
    return args[args.index("--max-num-seqs") + 1]


@pytest.mark.slow
def test_api_server_killed_mid_reconcile_converges_without_duplicates(cluster, namespace, pagedmodel_crd, tmp_path,
                                                                        local_node):
    """Guards: kube-apiserver SIGKILLed as soon as the operator's pass for a spec change that touches several
    children has made its first write (maxNumSeqs: the engine Deployment, applied first; service.port: the
    public Service, applied after it; whether the kill lands before the second write is a race, printed):
    once the server is back, the operator finishes the change (both children updated, the engines rolled to
    the new flag), creates no duplicate children, and status is consistent (Ready, observedGeneration 2,
    the new port in status.url)."""
    from kubernetes import client as k8s

    pm = copy.deepcopy(yaml.safe_load((REPO / "examples" / "cpu-tiny.yaml").read_text()))
    pm["metadata"]["name"] = MID
    apps = k8s.AppsV1Api(cluster.api_client())
    api_server = cluster.local.control_plane.components["kube-apiserver"]
    with operator(cluster, namespace, tmp_path / "operator.log", router="disabled"):
        cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(pm), namespace=namespace)
        wait_phase(cluster, namespace, "Ready", generation=1, name=MID, timeout=240)
        before = _children(cluster, namespace, MID)
        cluster.kubectl("patch", "pm", MID, "--type=merge", "-p",
                        '{"spec":{"engine":{"maxNumSeqs":8},"service":{"port":8080}}}', namespace=namespace)
        # The pass has begun once the engine Deployment carries the new flag: kill the API server right then.
        wait_until(lambda: _max_num_seqs(apps, namespace) == "8", timeout=30, interval=0.005,
                   what="the operator's first write of the change")
        api_server.stop(grace_s=0)
        api_server.start()
        api_server.wait_healthy(time.monotonic() + 60)
        port = cluster.kubectl_json("get", "service", MID, namespace=namespace)["spec"]["ports"][0]["port"]
        print(f"public Service port right after the restart: {port} (80: the pass was cut before it)")

        st = wait_phase(cluster, namespace, "Ready", generation=2, name=MID, timeout=240)["status"]
        assert st["url"] == f"http://{MID}.{namespace}.svc:8080/v1" and st["engine"]["maxNumSeqs"] == 8
        assert st["ready"] == "1/1" and st["desiredReplicas"] == 1
        service = cluster.kubectl_json("get", "service", MID, namespace=namespace)
        assert service["spec"]["ports"][0]["port"] == 8080
        assert _children(cluster, namespace, MID) == before
        pods = wait_until(lambda: (lambda ps: ps if len(ps) == 1 else None)(_engines(cluster, namespace, MID)),
                          timeout=90, what="the old engine pod gone")
        args = pods[0]["spec"]["containers"][0]["args"]
        assert args[args.index("--max-num-seqs") + 1] == "8"


def _children(cluster, namespace, name):
    return {k: sorted(i["metadata"]["name"] for i in cluster.kubectl_json(
        "get", k, "-l", f"pagedmodel.io/name={name}", namespace=namespace)["items"]) for k in KINDS}


def _engines(cluster, namespace, name):
    pods = cluster.kubectl_json("get", "pods", "-l", f"pagedmodel.io/name={name},app.kubernetes.io/component=engine",
                                namespace=namespace)["items"]
    return [p for p in pods if p["metadata"].get("deletionTimestamp") is None]
