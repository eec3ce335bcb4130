"""A local cluster: by default the real control plane (e2e/kube/) with our kubelet as the node;
``--emulator`` runs the API emulator plus its controller-manager and kubelet in one process.

    python -m e2e.cluster up [--emulator] [--gpus N] [--cpu N] [--memory SIZE] [--workdir DIR]

starts it in the foreground, prints the kubeconfig path and the node's loopback range,
and stops everything (pods included) on Ctrl-C. Tests use :class:`LocalCluster`.
"""
from __future__ import annotations

import argparse
import asyncio
import atexit
import logging
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Awaitable, Callable, TypeVar

import yaml
from aiohttp import web

from .apiserver.api import Api
from .apiserver.server import ApiServer
from .controllers.quantity import parse_quantity

log = logging.getLogger("e2e.cluster")
T = TypeVar("T")


class LocalCluster:
    """Runs the emulator (and optionally the local controllers/kubelet) on a private event loop thread."""

    def __init__(self, workdir: str | Path | None = None, *, controllers: bool = True,
                 node_capacity: dict[str, str] | None = None, node_name: str = "local-node",
                 restart_backoff_s: float = 1.0) -> None:
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
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="pagedmodel-e2e-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.kubeconfig = self.workdir / "kubeconfig"
        self.api = Api()
        self.server = ApiServer(self.api)
        self.with_controllers = controllers
        self.node_name = node_name
        self.restart_backoff_s = restart_backoff_s
        # A random /24 inside 127/8 so concurrent clusters on one machine do not collide.
        self.pod_network = f"127.{random.randint(10, 250)}.{random.randint(0, 255)}"
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._startup_error: BaseException | None = None
        self._components: list[Any] = []

    # --- lifecycle ---------------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> "LocalCluster":
        self._thread = threading.Thread(target=self._run, name="e2e-cluster", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError("the local cluster did not start in time")
        if self._startup_error is not None:
            raise RuntimeError("the local cluster failed to start") from self._startup_error
        atexit.register(self.stop)
        return self

    def stop(self) -> None:
        """Stop controllers, end every pod process, close the server. Safe to call twice."""
        if self._loop is None or self._thread is None:
            return
        loop, self._loop = self._loop, None
        if self._stop is not None:
            loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=60)
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the cluster's loop (the store is not thread-safe) and return its result."""
        assert self._loop is not None, "cluster not running"

        async def wrapper() -> T:
            return fn()

        return asyncio.run_coroutine_threadsafe(wrapper(), self._loop).result(timeout=30)

    def run(self, coro_fn: Callable[[], Awaitable[T]], timeout: float = 60) -> T:
        assert self._loop is not None, "cluster not running"
        return asyncio.run_coroutine_threadsafe(coro_fn(), self._loop).result(timeout=timeout)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:   # surface to start() rather than dying silently in the thread
            self._startup_error = exc
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        runner = web.AppRunner(self.server.app, handle_signals=False, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]   # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        self.server.address = f"127.0.0.1:{port}"
        self._bootstrap()
        self._write_kubeconfig()
        if self.with_controllers:
            await self._start_components()
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            for component in reversed(self._components):
                try:
                    await component.stop()
                except Exception:
                    log.exception("stopping %s failed", component)
            self.server.close()
            await runner.cleanup()

    async def _start_components(self) -> None:
        from .controllers.manager import ControllerManager
        from .kubelet.kubelet import Kubelet

        from .apiserver.discovery import KUBE_VERSION
        from .kubelet.node_api import EmulatorNodeApi

        kubelet = Kubelet(EmulatorNodeApi(self.api, self.url, self.node_name), node_name=self.node_name,
                          capacity=self.node_capacity, pod_network=self.pod_network, workdir=self.workdir / "pods",
                          restart_backoff_s=self.restart_backoff_s,
                          kubelet_version="v{}.{}.{}".format(*KUBE_VERSION))
        self.server.log_locator = kubelet.log_path
        self.server.exec_locator = kubelet.exec_context
        manager = ControllerManager(self.api, node_name=self.node_name)
        for component in (manager, kubelet):
            await component.start()
            self._components.append(component)

    def _bootstrap(self) -> None:
        ns_rt = self.api.builtin("namespaces")
        for name in ("default", "kube-system", "kube-public", "kube-node-lease"):
            self.api.create(ns_rt, None, {"metadata": {"name": name}})

    def _write_kubeconfig(self) -> None:
        config = {
            "apiVersion": "v1", "kind": "Config", "preferences": {},
            "clusters": [{"name": "pagedmodel-e2e", "cluster": {"server": self.url}}],
            "users": [{"name": "pagedmodel-e2e", "user": {"token": "pagedmodel-e2e"}}],
            "contexts": [{"name": "pagedmodel-e2e",
                          "context": {"cluster": "pagedmodel-e2e", "user": "pagedmodel-e2e", "namespace": "default"}}],
            "current-context": "pagedmodel-e2e",
        }
        self.kubeconfig.write_text(yaml.safe_dump(config))
        os.chmod(self.kubeconfig, 0o600)


def _up(args: argparse.Namespace) -> int:
    capacity = {"cpu": args.cpu, "memory": args.memory, "nvidia.com/gpu": str(args.gpus)}
    cluster: Any
    if args.emulator:
        cluster = LocalCluster(args.workdir, node_capacity=capacity).start()
    else:
        from .kube.control_plane import BinariesMissing
        from .kube.local_cluster import KubeCluster

        try:
            cluster = KubeCluster(args.workdir, node_capacity=capacity).start()
        except BinariesMissing as exc:
            print(f"error: {exc} (or pass --emulator)", file=sys.stderr)
            return 2
        print(f"control plane:  etcd, kube-apiserver, kube-controller-manager, kube-scheduler "
              f"(up in {cluster.startup_s:.1f}s; kubectl: {cluster.kubectl_path})")
    print(f"API server:     {cluster.url}")
    print(f"kubeconfig:     {cluster.kubeconfig}")
    print(f"pod addresses:  {cluster.pod_network}.2-254 (node {cluster.node_name})")
    print(f"try:            KUBECONFIG={cluster.kubeconfig} kubectl get nodes")
    print("Ctrl-C stops the cluster and every pod process.", flush=True)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    print("stopping...", flush=True)
    cluster.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.cluster", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start the control plane and the kubelet in the foreground")
    up.add_argument("--emulator", action="store_true",
                    help="the in-process API emulator instead of the real control plane (python -m e2e.kube.build)")
    up.add_argument("--workdir", help="where the kubeconfig and pod logs go (default: a temporary directory)")
    up.add_argument("--gpus", type=int, default=0, help="nvidia.com/gpu capacity of the node (default 0)")
    up.add_argument("--cpu", default="16", help="cpu capacity of the node (default 16)")
    up.add_argument("--memory", default="64Gi", help="memory capacity of the node (default 64Gi)")
    up.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.gpus < 0:
        parser.error("--gpus must be >= 0")
    for flag, value in (("--cpu", args.cpu), ("--memory", args.memory)):
        try:
            parse_quantity(value)
        except ValueError as exc:
            parser.error(f"{flag}: {exc}")
    return _up(args)


if __name__ == "__main__":
    sys.exit(main())
