"""A local Kubernetes cluster: the real control plane (e2e/kube/control_plane.py) plus our process
kubelet as its one node, talking to kube-apiserver over HTTPS like any kubelet.

    with KubeCluster(node_capacity={"nvidia.com/gpu": "1"}) as cluster:
        cluster.kubeconfig      # admin (system:masters) kubeconfig
        cluster.control_plane   # restart("kube-apiserver"), restart("etcd"), pids()

The kubelet runs on its own event-loop thread; ``stop()`` ends every pod and every control-plane
process.
"""
from __future__ import annotations

import asyncio
import atexit
import logging
import random
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from ..kubelet.kubelet import Kubelet
from ..kubelet.log_server import LogServer
from ..kubelet.quantity import parse_quantity
from ..kubelet.remote_api import RemoteNodeApi
from ..node import host
from ..node.real_node import RealNode
from . import build
from .control_plane import ControlPlane

log = logging.getLogger("e2e.kube")


class KubeCluster:
    def __init__(self, workdir: str | Path | None = None, *, node_capacity: dict[str, str] | None = None,
                 node_name: str = "local-node", restart_backoff_s: float = 1.0,
                 bin_dir: Path | None = None, node: str = "process") -> None:
        """``node``: "real" runs the real kubelet on containerd (e2e/node/, root only); "process" our
        process kubelet."""
        self.node_capacity = {"cpu": "16", "memory": "64Gi", "pods": "110", "nvidia.com/gpu": "0",
                              **(node_capacity or {})}
        for resource, amount in self.node_capacity.items():
            try:
                if parse_quantity(amount) < 0:
                    raise ValueError("must not be negative")
            except ValueError as exc:
                raise ValueError(f"node capacity {resource}={amount!r} is not a valid quantity: {exc}") from None
        if restart_backoff_s <= 0:
            raise ValueError(f"restart_backoff_s must be > 0, got {restart_backoff_s}")
        self._own_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="pagedmodel-kube-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        if node not in ("real", "process"):
            raise ValueError(f"node must be 'real' or 'process', not {node!r}")
        self.real_node: RealNode | None = None
        if node == "real":
            self.control_plane = ControlPlane(self.workdir, bin_dir, advertise_address=host.NODE_IP)
            self.real_node = RealNode(self.workdir, self.control_plane, node_name, bin_dir,
                                      gpus=int(parse_quantity(self.node_capacity["nvidia.com/gpu"])))
        else:
            self.control_plane = ControlPlane(self.workdir, bin_dir)
        self.kubeconfig = self.control_plane.admin_kubeconfig
        self.url = self.control_plane.url
        self.node_name = node_name
        self.restart_backoff_s = restart_backoff_s
        self.pod_network = f"127.{random.randint(10, 250)}.{random.randint(0, 255)}"
        self.kubectl_path = str(build.bin_dir() / "kubectl")
        self.startup_s = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self.kubelet: Kubelet | None = None

    def start(self, timeout: float = 60.0) -> "KubeCluster":
        started = time.monotonic()
        self.control_plane.start(timeout)
        if self.real_node is not None:
            try:
                self.real_node.start(started + timeout)
            except BaseException:
                self.control_plane.stop()
                raise
            self.startup_s = time.monotonic() - started
            atexit.register(self.stop)
            return self
        self._thread = threading.Thread(target=self._run, name="e2e-kubelet", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout) or self._error is not None:
            self.stop()
            raise RuntimeError("the local kubelet failed to start") from self._error
        self.startup_s = time.monotonic() - started
        atexit.register(self.stop)
        return self

    def stop(self) -> None:
        """End every pod, the kubelet and the control plane. Safe to call twice."""
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout=60)
        self._loop = self._thread = None
        if self.real_node is not None:
            # No new pods get bound while the node drains (a Deployment would replace each one it ends).
            self.control_plane.components["kube-scheduler"].stop()
            self.real_node.stop()
        self.control_plane.stop()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "KubeCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:   # surfaced by start()
            self._error = exc
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        identity = yaml.safe_load(self.control_plane.node_kubeconfig(self.node_name).read_text())
        user = identity["users"][0]["user"]
        ca = self.control_plane.ca
        node_api = RemoteNodeApi(self.url, ca.cert, Path(user["client-certificate"]), Path(user["client-key"]),
                                 self.node_name)
        node_ip = f"{self.pod_network}.1"
        serving = ca.issue(f"kubelet-serving-{self.node_name}", f"system:node:{self.node_name}",
                           ("system:nodes",), server_hosts=(node_ip,))
        kubelet = Kubelet(node_api, node_name=self.node_name, capacity=self.node_capacity,
                          pod_network=self.pod_network, workdir=self.workdir / "pods",
                          restart_backoff_s=self.restart_backoff_s, kubelet_version=build.KUBERNETES_VERSION)
        logs = LogServer(node_ip, kubelet.log_path, kubelet.container_running, ca.cert, serving.cert, serving.key)
        kubelet.kubelet_port = await logs.start()
        await kubelet.start()
        self.kubelet = kubelet
        await self._until_schedulable(node_api)
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            await kubelet.stop()
            await logs.stop()

    async def _until_schedulable(self, node_api: RemoteNodeApi, timeout: float = 30.0) -> None:
        """The node-lifecycle controller taints a new node not-ready until it has seen it Ready."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            node = await node_api.request("GET", f"/api/v1/nodes/{self.node_name}")
            if not [t for t in node["spec"].get("taints") or [] if t["key"].startswith("node.kubernetes.io/")]:
                return
            await asyncio.sleep(0.2)
        raise RuntimeError(f"node {self.node_name} still tainted after {timeout:.0f}s: {node['spec'].get('taints')}")

    def call_soon(self, fn: Any) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(fn)
