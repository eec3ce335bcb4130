"""What the kubelet needs from an API server, and its in-process implementation over the emulator.

The kubelet's pod loop is synchronous over a local view (``pods_on_node``, ``get_pod``) and hands
writes off (``write_status``, ``finalize``, ``record_event``); only container preparation awaits
(``lookup_for`` fetches the ConfigMaps/Secrets a container references, ``credentials`` its
service-account kubeconfig). ``remote_api.RemoteNodeApi`` implements the same over HTTPS against
kube-apiserver.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Protocol

from .environment import Lookup


class NodeApi(Protocol):
    api_url: str

    async def start(self, node: dict[str, Any], on_change: Callable[[], None]) -> None: ...

    async def stop(self) -> None: ...

    def pods_on_node(self) -> list[dict[str, Any]]: ...

    def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None: ...

    def write_status(self, pod: dict[str, Any], status: dict[str, Any]) -> None: ...

    def finalize(self, pod: dict[str, Any]) -> None: ...

    def record_event(self, pod: dict[str, Any], event_type: str, reason: str, message: str) -> None: ...

    async def lookup_for(self, pod: dict[str, Any], container: dict[str, Any]) -> Lookup: ...

    async def credentials(self, pod: dict[str, Any], directory: Path) -> str | None: ...


class EmulatorNodeApi:
    """The emulator's store, used in-process (the emulator's kubelet shares its event loop)."""

    def __init__(self, api: Any, api_url: str, node_name: str) -> None:
        self.api = api
        self.api_url = api_url
        self.node_name = node_name

    async def start(self, node: dict[str, Any], on_change: Callable[[], None]) -> None:
        if self.api.store.peek("nodes", "", node["metadata"]["name"]) is None:
            self.api.create(self.api.builtin("nodes"), None, node)
        self.api.store.add_listener(
            lambda event: on_change() if event.storage in ("pods", "configmaps", "secrets") else None)

    async def stop(self) -> None:
        return None

    def pods_on_node(self) -> list[dict[str, Any]]:
        return [p for p in self.api.store.list("pods") if p.get("spec", {}).get("nodeName") == self.node_name]

    def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.api.store.get("pods", namespace, name)

    def write_status(self, pod: dict[str, Any], status: dict[str, Any]) -> None:
        from ..apiserver.errors import ApiError

        if pod.get("status") == status:
            return
        pods_rt = self.api.builtin("pods")
        body = self.api.served(pods_rt, pod)
        body["status"] = status
        try:
            self.api.update(pods_rt, pod["metadata"]["namespace"], pod["metadata"]["name"], body,
                            subresource="status")
        except ApiError:
            pass

    def finalize(self, pod: dict[str, Any]) -> None:
        from ..apiserver.errors import ApiError

        meta = pod["metadata"]
        try:
            self.api.delete(self.api.builtin("pods"), meta["namespace"], meta["name"],
                            {"gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}})
        except ApiError:
            pass

    def record_event(self, pod: dict[str, Any], event_type: str, reason: str, message: str) -> None:
        current = self.api.store.get("pods", pod["metadata"]["namespace"], pod["metadata"]["name"])
        if current is not None and current["metadata"]["uid"] == pod["metadata"]["uid"]:
            current["apiVersion"], current["kind"] = "v1", "Pod"
            self.api.record_event(current, event_type, reason, message, "kubelet")

    async def lookup_for(self, pod: dict[str, Any], container: dict[str, Any]) -> Lookup:
        return self.api.store.peek

    async def credentials(self, pod: dict[str, Any], directory: Path) -> str | None:
        from . import credentials

        if not self.api_url or not credentials.automounts_token(self.api, pod):
            return None   # no API server to point at (a bare kubelet), or a pod that opted out
        return str(credentials.write_kubeconfig(directory / "kubeconfig", self.api_url,
                                                pod["metadata"]["namespace"], credentials.service_account_name(pod)))
