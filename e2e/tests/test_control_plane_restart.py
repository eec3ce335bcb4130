"""kube-apiserver and etcd restarted while a PagedModel is serving: completions keep flowing through
the router and the engine while the API is down; afterwards the operator and the router reconnect
(a spec change is reconciled; a replaced engine pod is discovered by the router's watch), there
are no duplicate children, and the status is still there."""
from __future__ import annotations

import copy
import threading
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
