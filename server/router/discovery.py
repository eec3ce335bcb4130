"""Kubernetes discovery of engine replicas for `pagedmodel router --discover SELECTOR`.

A background thread lists the pods matching the label selector in the router's namespace and
then watches them (resuming from the list's resourceVersion, re-listing after errors or expiry),
so replicas the operator adds are used, and ones it removes are drained, within about a second.
Each change hands the full set of upstream URLs to a callback (the router schedules it onto its
event loop). Only Ready pods with an IP that are not terminating are upstreams.

`upstreams_from_pods` is pure (pods as plain dicts, as the API serves them) for unit tests.
"""
from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

logger = logging.getLogger("pagedmodel.router")

SA_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def pod_is_upstream(pod: dict[str, Any]) -> bool:
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    if meta.get("deletionTimestamp") or not status.get("podIP"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def pod_port(pod: dict[str, Any], default: int) -> int:
    """The container port named `http` (what the operator declares), else `default`."""
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == "http" and port.get("containerPort"):
                return int(port["containerPort"])
    return default


def upstreams_from_pods(pods: Iterable[dict[str, Any]], default_port: int = 8000) -> list[str]:
    urls = []
    for pod in pods:
        if pod_is_upstream(pod):
            ip = pod["status"]["podIP"]
            host = f"[{ip}]" if ":" in ip else ip   # IPv6 pod IPs need brackets in URLs
            urls.append(f"http://{host}:{pod_port(pod, default_port)}")
    return sorted(urls)


def current_namespace() -> str:
    """POD_NAMESPACE if set, else the service account's namespace, else the kubeconfig context's, else default."""
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    if SA_NAMESPACE.is_file():
        return SA_NAMESPACE.read_text().strip()
    try:
        from kubernetes import config
        _, context = config.list_kube_config_contexts()
        return (context or {}).get("context", {}).get("namespace") or "default"
    except Exception:  # no kubeconfig at all
        return "default"


class PodDiscovery:
    """List + watch pods by selector in a daemon thread; `on_change(urls)` after every change."""

    def __init__(self, selector: str, namespace: str, on_change: Callable[[list[str]], None], *,
                 default_port: int = 8000, watch_timeout_s: int = 60, retry_s: float = 2.0) -> None:
        if not selector.strip():
            raise ValueError("--discover needs a non-empty label selector")
        self.selector = selector
        self.namespace = namespace
        self.on_change = on_change
        self.default_port = default_port
        self.watch_timeout_s = watch_timeout_s
        self.retry_s = retry_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last: list[str] | None = None

    def connect(self) -> None:
        """Load in-cluster credentials (or a kubeconfig outside a cluster); raises when there are none."""
        from kubernetes import client, config
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()   # running outside a cluster (development, tests)
        self._api = client.CoreV1Api()
        self._serialize = client.ApiClient().sanitize_for_serialization

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="router-discovery", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _emit(self, pods: dict[str, dict[str, Any]]) -> None:
        urls = upstreams_from_pods(pods.values(), self.default_port)
        if urls != self._last:
            self._last = urls
            logger.info("discovered %d ready engine(s): %s", len(urls), ", ".join(urls) or "-")
            self.on_change(urls)

    def _run(self) -> None:
        from kubernetes import watch
        while not self._stop.is_set():
            try:
                listed = self._api.list_namespaced_pod(self.namespace, label_selector=self.selector)
                pods = {p.metadata.name: self._serialize(p) for p in listed.items}
                self._emit(pods)
                w = watch.Watch()
                for event in w.stream(self._api.list_namespaced_pod, self.namespace, label_selector=self.selector,
                                      resource_version=listed.metadata.resource_version,
                                      timeout_seconds=self.watch_timeout_s):
                    if self._stop.is_set():
                        w.stop()
                        break
                    kind, obj = event["type"], event["object"]
                    if kind == "ERROR":   # e.g. 410 Gone: our resourceVersion expired; re-list
                        break
                    pod = self._serialize(obj)
                    name = (pod.get("metadata") or {}).get("name")
                    if kind == "DELETED":
                        pods.pop(name, None)
                    else:
                        pods[name] = pod
                    self._emit(pods)
            except Exception as exc:   # API unreachable, RBAC, network: keep the last set and retry
                logger.warning("pod discovery (%s in %s) failed: %s; retrying in %.0fs",
                               self.selector, self.namespace, exc, self.retry_s)
                self._stop.wait(self.retry_s)
