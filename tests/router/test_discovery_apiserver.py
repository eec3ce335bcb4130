"""Pod discovery against a real kube-apiserver (e2e/kube/: built by `python -m e2e.kube.build`; real
`kubernetes` client, real list + watch). Pods are created and their status written by the test (as an
admin); nothing runs them."""
from __future__ import annotations

import threading
import time

import pytest

from kubernetes import client, config  # noqa: E402

from e2e.kube.control_plane import ControlPlane  # noqa: E402
from pagedmodel.server.router.discovery import PodDiscovery  # noqa: E402


def _wait(pred, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_discovery_follows_pods_through_the_api(tmp_path):
    control_plane = ControlPlane(tmp_path).start()   # no node: nothing runs the pods
    try:
        api = client.CoreV1Api(config.new_client_from_config(config_file=str(control_plane.admin_kubeconfig)))
        ns = "router-disco"
        api.create_namespace({"metadata": {"name": ns}})
        # Pods are admitted once the ServiceAccount controller made the namespace's "default" account.
        _wait(lambda: any(a.metadata.name == "default" for a in api.list_namespaced_service_account(ns).items))

        def make(name: str, ip: str, labels: dict[str, str]) -> None:
            # Bound to a node that does not exist: the scheduler leaves it alone and no kubelet runs it.
            api.create_namespaced_pod(ns, {"metadata": {"name": name, "labels": labels}, "spec": {
                "nodeName": "nobody", "containers": [
                {"name": "engine", "image": "x", "ports": [{"name": "http", "containerPort": 8000}]}]}})
            api.patch_namespaced_pod_status(name, ns, {"status": {"podIP": ip, "phase": "Running", "conditions": [
                {"type": "Ready", "status": "True"}]}})

        seen: list[list[str]] = []
        lock = threading.Lock()

        def on_change(urls: list[str]) -> None:
            with lock:
                seen.append(urls)

        make("engine-a", "127.0.0.11", {"app": "engine"})
        make("other", "127.0.0.99", {"app": "other"})
        disco = PodDiscovery("app=engine", ns, on_change, watch_timeout_s=5)
        disco._api = api
        disco._serialize = client.ApiClient().sanitize_for_serialization
        disco.start()
        try:
            _wait(lambda: seen and seen[-1] == ["http://127.0.0.11:8000"])
            make("engine-b", "127.0.0.12", {"app": "engine"})
            _wait(lambda: seen[-1] == ["http://127.0.0.11:8000", "http://127.0.0.12:8000"])
            api.delete_namespaced_pod("engine-a", ns, grace_period_seconds=0)
            _wait(lambda: seen[-1] == ["http://127.0.0.12:8000"])
        finally:
            disco.stop()
    finally:
        control_plane.stop()
