"""Runs the controllers level-triggered: after any write (debounced) and on a short resync timer."""
from __future__ import annotations

import asyncio
import logging

from ..apiserver.api import Api
from ..apiserver.store import WatchEvent
from . import endpoints, garbage_collector, jobs, namespaces, replicasets, scheduler
from .deployments import DeploymentController

log = logging.getLogger("e2e.controllers")
RESYNC_S = 0.5


class ControllerManager:
    def __init__(self, api: Api, node_name: str) -> None:
        self.api = api
        self.node_name = node_name
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.deployments = DeploymentController(api)

    async def start(self) -> None:
        self.api.store.add_listener(self._on_write)
        self._task = asyncio.create_task(self._loop(), name="controller-manager")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    def _on_write(self, event: WatchEvent) -> None:
        if event.storage != "events":
            self._wake.set()

    async def _loop(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=RESYNC_S)
            except asyncio.TimeoutError:
                pass
            await asyncio.sleep(0.02)   # let a burst of writes land before reconciling
            self._wake.clear()
            try:
                self.reconcile_all()
            except Exception:   # one bad object must not stop the control plane
                log.exception("controller pass failed")

    def reconcile_all(self) -> None:
        api = self.api
        for ns in api.store.list("namespaces"):
            namespaces.reconcile(api, ns)
        garbage_collector.collect(api)
        for d in api.store.list("deployments.apps"):
            self.deployments.reconcile(d)
        for rs in api.store.list("replicasets.apps"):
            replicasets.reconcile(api, rs)
        for job in api.store.list("jobs.batch"):
            jobs.reconcile(api, job)
        node = api.store.peek("nodes", "", self.node_name)
        if node is not None:
            scheduler.schedule(api, node)
        for ns in api.store.list("namespaces"):
            endpoints.reconcile_namespace(api, ns["metadata"]["name"])
