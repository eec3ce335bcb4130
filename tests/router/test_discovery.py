"""Kubernetes pod discovery: which pods are upstreams, and the list+watch loop against a fake API."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
from kubernetes import client

from pagedmodel.server.router.discovery import PodDiscovery, upstreams_from_pods


def pod(name: str, ip: str | None, ready: bool = True, terminating: bool = False, port: int | None = 8000) -> dict:
    return {"metadata": {"name": name, **({"deletionTimestamp": "2026-01-01T00:00:00Z"} if terminating else {})},
            "spec": {"containers": [{"name": "engine",
                                     "ports": [{"name": "http", "containerPort": port}] if port else []}]},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def test_only_ready_running_pods_with_ips_are_upstreams():
    pods = [pod("a", "10.0.0.2"), pod("b", "10.0.0.1", port=9000), pod("c", None), pod("d", "10.0.0.4", ready=False),
            pod("e", "10.0.0.5", terminating=True), pod("f", "fd00::7", port=None)]
    assert upstreams_from_pods(pods, default_port=8123) == ["http://10.0.0.1:9000", "http://10.0.0.2:8000",
                                                          "http://[fd00::7]:8123"]


def _v1pod(name: str, ip: str, ready: bool = True) -> client.V1Pod:
    return client.V1Pod(metadata=client.V1ObjectMeta(name=name),
                        spec=client.V1PodSpec(containers=[client.V1Container(
                            name="engine", ports=[client.V1ContainerPort(name="http", container_port=8000)])]),
                        status=client.V1PodStatus(pod_ip=ip, conditions=[client.V1PodCondition(
                            type="Ready", status="True" if ready else "False")]))


def test_list_then_watch_reports_every_membership_change(monkeypatch):
    seen: list[list[str]] = []
    done = threading.Event()
    disco = PodDiscovery("app=engine", "ns", seen.append)

    class FakeWatch:
        def stream(self, fn, namespace, **kw):
            assert namespace == "ns" and kw["label_selector"] == "app=engine" and kw["resource_version"] == "7"
            yield {"type": "ADDED", "object": _v1pod("b", "10.0.0.2", ready=False)}
            yield {"type": "MODIFIED", "object": _v1pod("b", "10.0.0.2")}        # became Ready
            yield {"type": "DELETED", "object": _v1pod("a", "10.0.0.1")}
            disco.stop()
            done.set()
            yield {"type": "MODIFIED", "object": _v1pod("c", "10.0.0.3")}        # after stop: ignored

        def stop(self):
            pass

    api = SimpleNamespace(list_namespaced_pod=lambda ns, **kw: SimpleNamespace(
        items=[_v1pod("a", "10.0.0.1")], metadata=SimpleNamespace(resource_version="7")))
    monkeypatch.setattr("kubernetes.watch.Watch", FakeWatch)
    disco._api = api
    disco._serialize = client.ApiClient().sanitize_for_serialization
    disco.start()
    assert done.wait(10)
    disco._thread.join(10)
    assert seen == [["http://10.0.0.1:8000"],
                    ["http://10.0.0.1:8000", "http://10.0.0.2:8000"],
                    ["http://10.0.0.2:8000"]]


def test_api_errors_keep_the_last_set_and_retry(monkeypatch):
    calls = []
    seen: list[list[str]] = []
    disco = PodDiscovery("app=engine", "ns", seen.append, retry_s=0.01)

    def flaky_list(ns, **kw):
        calls.append(1)
        if len(calls) < 3:
            raise RuntimeError("API server unreachable")
        disco.stop()
        return SimpleNamespace(items=[_v1pod("a", "10.0.0.1")], metadata=SimpleNamespace(resource_version="1"))

    class EmptyWatch:
        def stream(self, *a, **kw):
            return iter(())

        def stop(self):
            pass

    monkeypatch.setattr("kubernetes.watch.Watch", EmptyWatch)
    disco._api = SimpleNamespace(list_namespaced_pod=flaky_list)
    disco._serialize = client.ApiClient().sanitize_for_serialization
    disco.start()
    disco._thread.join(10)
    assert len(calls) == 3 and seen == [["http://10.0.0.1:8000"]]


def test_empty_selector_is_refused():
    with pytest.raises(ValueError, match="non-empty label selector"):
        PodDiscovery("  ", "ns", lambda urls: None)
