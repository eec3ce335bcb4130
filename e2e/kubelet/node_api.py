"""What the kubelet needs from an API server.

The kubelet's pod loop is synchronous over a local view (``pods_on_node``, ``get_pod``) and hands
writes off (``write_status``, ``finalize``, ``record_event``); only container preparation awaits
(``lookup_for`` fetches the ConfigMaps/Secrets a container references, ``credentials`` its
service-account kubeconfig). ``remote_api.RemoteNodeApi`` implements it over HTTPS against
kube-apiserver; tests may implement it over anything else.
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
