"""The kubelet's side of a real kube-apiserver, over HTTPS with the node's client certificate.

It does what a kubelet must for the control plane to treat the node as healthy and its pods as
running: registers the Node, renews its Lease in ``kube-node-lease`` and posts NodeStatus
(the node-lifecycle controller marks silent nodes NotReady and evicts their pods), keeps a
watch-fed view of the pods bound to it, and writes pod status, final deletions and Events.
Writes are queued and retried, so the pod loop never blocks on the network and survives an
API-server restart. Credentials come from the TokenRequest API (see ``service_account.py``).
"""
from __future__ import annotations

import asyncio
import json
import logging
import ssl
import uuid
from pathlib import Path
from typing import Any, Callable

import aiohttp

from . import service_account
from .clock import now_iso, now_micro
from .environment import Lookup

log = logging.getLogger("e2e.kubelet.remote")
HEARTBEAT_S = 5.0          # well inside the controller-manager's node-monitor grace period
LEASE_DURATION_S = 40
MERGE = {"Content-Type": "application/merge-patch+json"}


class ApiStatus(Exception):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:300]}")
        self.status = status


class RemoteNodeApi:
    def __init__(self, api_url: str, ca_file: Path, cert_file: Path, key_file: Path, node_name: str) -> None:
        self.api_url = api_url
        self.ca_file = Path(ca_file)
        self.node_name = node_name
        self._ssl = ssl.create_default_context(cafile=str(ca_file))
        self._ssl.load_cert_chain(str(cert_file), str(key_file))
        self._session: aiohttp.ClientSession | None = None
        self._pods: dict[tuple[str, str], dict[str, Any]] = {}
        self._sent: dict[str, dict[str, Any]] = {}              # uid -> last status written
        self._writes: dict[tuple[str, str], Callable[[], Any]] = {}   # latest write per key wins
        self._events: dict[tuple[str, str, str], tuple[str, int]] = {}
        self._unsent_events: dict[str, dict[str, Any]] = {}   # event name -> body whose POST is still queued
        self._wake_writer = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._node: dict[str, Any] = {}
        self._on_change: Callable[[], None] = lambda: None
        self.synced = asyncio.Event()

    # --- HTTP -------------------------------------------------------------------------

    async def request(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
                      ok_missing: bool = False) -> Any:
        assert self._session is not None
        data = json.dumps(body) if body is not None else None
        hdrs = {"Content-Type": "application/json", "Accept": "application/json", **(headers or {})}
        async with self._session.request(method, self.api_url + path, data=data, headers=hdrs,
                                         ssl=self._ssl) as resp:
            text = await resp.text()
            if resp.status == 404 and ok_missing:
                return None
            if resp.status >= 400:
                raise ApiStatus(resp.status, text)
            return json.loads(text) if text else None

    # --- lifecycle --------------------------------------------------------------------

    async def start(self, node: dict[str, Any], on_change: Callable[[], None]) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5))
        self._node, self._on_change = node, on_change
        self._since = now_iso()
        try:
            await self.request("POST", "/api/v1/nodes", node)
        except ApiStatus as exc:
            if exc.status != 409:
                raise
        await self._heartbeat_once()
        for coro in (self._watch_pods(), self._heartbeat(), self._writer()):
            self._tasks.append(asyncio.create_task(coro))
        await asyncio.wait_for(self.synced.wait(), timeout=30)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._flush()
        if self._session is not None:
            await self._session.close()

    # --- node heartbeat ---------------------------------------------------------------

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            try:
                await self._heartbeat_once()
            except (aiohttp.ClientError, ApiStatus, asyncio.TimeoutError, OSError) as exc:
                log.info("node heartbeat failed (will retry): %s", exc)

    async def _heartbeat_once(self) -> None:
        status = dict(self._node["status"])
        status["conditions"] = [dict(c, lastHeartbeatTime=now_iso(), lastTransitionTime=self._since)
                                for c in status["conditions"]]
        node = await self.request("PATCH", f"/api/v1/nodes/{self.node_name}/status", {"status": status}, MERGE)
        path = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{self.node_name}"
        lease = await self.request("GET", path, ok_missing=True)
        spec = {"holderIdentity": self.node_name, "leaseDurationSeconds": LEASE_DURATION_S, "renewTime": now_micro()}
        if lease is None:
            owner = {"apiVersion": "v1", "kind": "Node", "name": self.node_name, "uid": node["metadata"]["uid"]}
            await self.request("POST", path.rsplit("/", 1)[0], {
                "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": self.node_name, "ownerReferences": [owner]}, "spec": spec})
        else:
            await self.request("PATCH", path, {"spec": spec}, MERGE)

    # --- pods -------------------------------------------------------------------------

    async def _watch_pods(self) -> None:
        selector = f"fieldSelector=spec.nodeName%3D{self.node_name}"
        while True:
            try:
                listing = await self.request("GET", f"/api/v1/pods?{selector}")
                self._pods = {(p["metadata"]["namespace"], p["metadata"]["name"]): p for p in listing["items"]}
                self.synced.set()
                self._on_change()
                await self._follow(selector, listing["metadata"]["resourceVersion"])
            except asyncio.CancelledError:
                raise
            except (aiohttp.ClientError, ApiStatus, asyncio.TimeoutError, OSError, ValueError) as exc:
                log.info("pod watch interrupted (relisting): %s", exc)
            await asyncio.sleep(0.5)

    async def _follow(self, selector: str, version: str) -> None:
        assert self._session is not None
        url = f"{self.api_url}/api/v1/pods?{selector}&watch=true&allowWatchBookmarks=true&resourceVersion={version}"
        async with self._session.get(url, ssl=self._ssl) as resp:
            if resp.status != 200:
                raise ApiStatus(resp.status, await resp.text())
            async for line in resp.content:
                event = json.loads(line)
                if event["type"] == "ERROR":
                    raise ApiStatus(event["object"].get("code", 500), json.dumps(event["object"]))
                if event["type"] == "BOOKMARK":
                    continue
                pod = event["object"]
                key = (pod["metadata"]["namespace"], pod["metadata"]["name"])
                if event["type"] == "DELETED":
                    self._pods.pop(key, None)
                else:
                    self._pods[key] = pod
                self._on_change()

    def pods_on_node(self) -> list[dict[str, Any]]:
        return list(self._pods.values())

    def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self._pods.get((namespace, name))

    # --- queued writes ----------------------------------------------------------------

    def _queue(self, key: tuple[str, str], write: Callable[[], Any]) -> None:
        self._writes[key] = write
        self._wake_writer.set()

    def write_status(self, pod: dict[str, Any], status: dict[str, Any]) -> None:
        meta = pod["metadata"]
        if self._sent.get(meta["uid"]) == status:
            return
        self._sent[meta["uid"]] = status
        path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status"
        # The uid in the patch is a precondition: a new pod of the same name is never overwritten.
        body = {"metadata": {"uid": meta["uid"]}, "status": status}
        self._queue(("status", meta["uid"]), lambda: self.request("PATCH", path, body, MERGE))

    def finalize(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}"
        body = {"gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}}
        self._queue(("delete", meta["uid"]), lambda: self.request("DELETE", path, body))

    def record_event(self, pod: dict[str, Any], event_type: str, reason: str, message: str) -> None:
        meta = pod["metadata"]
        key = (meta["uid"], reason, message)
        name, count = self._events.get(key, (f"{meta['name']}.{uuid.uuid4().hex[:16]}", 0))
        self._events[key] = (name, count + 1)
        base = f"/api/v1/namespaces/{meta['namespace']}/events"
        ts = now_iso()
        unsent = self._unsent_events.get(name)
        if count and unsent is not None:
            # Its POST is still queued: writes coalesce by key, so a PATCH here would replace the create
            # and patch an event that does not exist yet. The repeat rides on the create instead.
            unsent.update(count=count + 1, lastTimestamp=ts)
            return
        if count:
            self._queue(("event", name), self._event_patch(base, name, count + 1, ts))
            return
        event = {"apiVersion": "v1", "kind": "Event", "metadata": {"name": name, "namespace": meta["namespace"]},
                 "involvedObject": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"],
                                    "namespace": meta["namespace"], "uid": meta["uid"]},
                 "reason": reason, "message": message, "type": event_type, "count": 1,
                 "source": {"component": "kubelet", "host": self.node_name}, "firstTimestamp": ts,
                 "lastTimestamp": ts, "reportingComponent": "kubelet", "reportingInstance": self.node_name}
        self._unsent_events[name] = event

        async def create() -> None:
            sent = event["count"]
            await self.request("POST", base, event)
            self._unsent_events.pop(name, None)
            if event["count"] != sent:   # repeats arrived while the POST was in flight
                self._queue(("event", name), self._event_patch(base, name, event["count"], event["lastTimestamp"]))
        self._queue(("event", name), create)

    def _event_patch(self, base: str, name: str, count: int, ts: str) -> Callable[[], Any]:
        patch = {"count": count, "lastTimestamp": ts}
        return lambda: self.request("PATCH", f"{base}/{name}", patch, MERGE)

    async def _writer(self) -> None:
        while True:
            await self._wake_writer.wait()
            self._wake_writer.clear()
            await self._flush()
            if self._writes:   # something failed to reach the server: retry shortly
                await asyncio.sleep(0.5)
                self._wake_writer.set()

    async def _flush(self) -> None:
        for key in list(self._writes):
            write = self._writes.pop(key)
            try:
                await write()
            except ApiStatus as exc:
                if exc.status >= 500 or exc.status == 429:
                    self._writes.setdefault(key, write)
                else:   # 404/409/422: the pod is gone or replaced; nothing to retry
                    log.debug("dropped %s: %s", key, exc)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                self._writes.setdefault(key, write)

    # --- container inputs -------------------------------------------------------------

    async def lookup_for(self, pod: dict[str, Any], container: dict[str, Any]) -> Lookup:
        """Fetch the ConfigMaps and Secrets the container references (the Node authorizer allows
        exactly those) and answer the environment builder from that snapshot."""
        ns = pod["metadata"]["namespace"]
        found: dict[tuple[str, str, str], dict[str, Any] | None] = {}
        for storage, name in _references(container):
            try:
                found[(storage, ns, name)] = await self.request("GET", f"/api/v1/namespaces/{ns}/{storage}/{name}",
                                                                ok_missing=True)
            except (aiohttp.ClientError, ApiStatus, OSError) as exc:
                raise ValueError(f"CreateContainerConfigError: cannot read {storage[:-1]} {name!r}: {exc}") from None
        return lambda storage, namespace, name: found.get((storage, namespace, name))

    async def credentials(self, pod: dict[str, Any], directory: Path) -> str | None:
        return await service_account.project(self, pod, directory)


def _references(container: dict[str, Any]) -> set[tuple[str, str]]:
    refs: set[tuple[str, str]] = set()
    for source in container.get("envFrom") or []:
        if "configMapRef" in source:
            refs.add(("configmaps", source["configMapRef"]["name"]))
        if "secretRef" in source:
            refs.add(("secrets", source["secretRef"]["name"]))
    for item in container.get("env") or []:
        source = item.get("valueFrom") or {}
        if "configMapKeyRef" in source:
            refs.add(("configmaps", source["configMapKeyRef"]["name"]))
        if "secretKeyRef" in source:
            refs.add(("secrets", source["secretKeyRef"]["name"]))
    return refs
