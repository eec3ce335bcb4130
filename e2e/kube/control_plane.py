"""etcd, kube-apiserver, kube-controller-manager and kube-scheduler as local processes.

Built by ``python -m e2e.kube.build``; each component authenticates with its own client
certificate from a throwaway CA (e2e/kube/pki.py), the API server authorizes with Node,RBAC and
runs its default admission plugins, so what the tests see is what a cluster does.
"""
from __future__ import annotations

import ssl
import time
from pathlib import Path

import yaml

from . import build
from .component import Component, free_port
from .pki import CertificateAuthority, KeyPair

SERVICE_CIDR = "10.96.0.0/12"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"


class BinariesMissing(RuntimeError):
    pass


def kubeconfig(server: str, ca: Path, client: KeyPair, user: str, namespace: str | None = None) -> dict:
    context = {"cluster": "local", "user": user, **({"namespace": namespace} if namespace else {})}
    return {"apiVersion": "v1", "kind": "Config", "preferences": {},
            "clusters": [{"name": "local", "cluster": {"server": server, "certificate-authority": str(ca)}}],
            "users": [{"name": user, "user": {"client-certificate": str(client.cert),
                                              "client-key": str(client.key)}}],
            "contexts": [{"name": "local", "context": context}], "current-context": "local"}


class ControlPlane:
    """The four control-plane processes of one local cluster, files under ``workdir``."""

    def __init__(self, workdir: Path, bin_dir: Path | None = None, advertise_address: str | None = None) -> None:
        """``advertise_address``: the node-reachable address pods use (through the ``kubernetes`` Service);
        None keeps the API server on loopback, for nodes whose pods are host processes."""
        self.workdir = Path(workdir)
        self.advertise_address = advertise_address
        self.bin_dir = Path(bin_dir or build.bin_dir())
        missing = [n for n in ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")
                   if not (self.bin_dir / n).is_file()]
        if missing:
            raise BinariesMissing(f"control-plane binaries missing in {self.bin_dir}: {', '.join(missing)}; "
                                  "build them with: python -m e2e.kube.build")
        self.pki_dir = self.workdir / "pki"
        self.ca = CertificateAuthority(self.pki_dir)
        self.api_port = free_port()
        self.url = f"https://127.0.0.1:{self.api_port}"
        self.admin_kubeconfig = self._kubeconfig("admin", "kubernetes-admin", ("system:masters",), "kubeconfig")
        self.components: dict[str, Component] = {}
        self._define()

    # --- configuration ----------------------------------------------------------------

    def _kubeconfig(self, name: str, user: str, groups: tuple[str, ...] = (), filename: str = "") -> Path:
        pair = self.ca.issue(name, user, groups)
        path = self.workdir / (filename or f"{name}.kubeconfig")
        path.write_text(yaml.safe_dump(kubeconfig(self.url, self.ca.cert, pair, user)))
        path.chmod(0o600)
        return path

    def client_kubeconfig(self, name: str, user: str, groups: tuple[str, ...] = ()) -> Path:
        """A kubeconfig with a client certificate for ``user`` (in ``groups``), for one component."""
        return self._kubeconfig(name, user, groups)

    def node_kubeconfig(self, node_name: str) -> Path:
        """The kubelet's identity: ``system:node:<name>`` in ``system:nodes`` (what the Node authorizer wants)."""
        return self._kubeconfig(f"kubelet-{node_name}", f"system:node:{node_name}", ("system:nodes",))

    def _tls(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.ca.cert))
        return context

    def _insecure(self) -> ssl.SSLContext:
        # The controller-manager and scheduler serve /healthz with self-signed certificates of their own.
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        return context

    def _define(self) -> None:
        logs = self.workdir / "logs"
        etcd_port, peer_port = free_port(), free_port()
        etcd_url = f"http://127.0.0.1:{etcd_port}"
        self.components["etcd"] = Component("etcd", [
            str(self.bin_dir / "etcd"), "--name=local", f"--data-dir={self.workdir / 'etcd'}",
            f"--listen-client-urls={etcd_url}", f"--advertise-client-urls={etcd_url}",
            f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
            f"--initial-cluster=local=http://127.0.0.1:{peer_port}",
            "--unsafe-no-fsync",   # a throwaway cluster: durability across power loss is not the point
            "--log-level=warn"], logs, f"{etcd_url}/health")
        serving = self.ca.issue("apiserver", "kube-apiserver", server_hosts=(
            "127.0.0.1", "localhost", "10.96.0.1", "kubernetes", "kubernetes.default",
            "kubernetes.default.svc", "kubernetes.default.svc.cluster.local",
            *([self.advertise_address] if self.advertise_address else [])), client=False)
        kubelet_client = self.ca.issue("apiserver-kubelet-client", "kube-apiserver-kubelet-client",
                                       ("system:masters",))
        self.sa_keys = self.ca.service_account_keys()
        self.components["kube-apiserver"] = Component("kube-apiserver", [
            str(self.bin_dir / "kube-apiserver"), f"--etcd-servers={etcd_url}",
            *self._addresses(), f"--secure-port={self.api_port}",
            f"--tls-cert-file={serving.cert}", f"--tls-private-key-file={serving.key}",
            f"--client-ca-file={self.ca.cert}", "--authorization-mode=Node,RBAC",
            "--enable-admission-plugins=NodeRestriction", f"--service-cluster-ip-range={SERVICE_CIDR}",
            f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
            f"--service-account-key-file={self.sa_keys.cert}",
            f"--service-account-signing-key-file={self.sa_keys.key}",
            f"--kubelet-client-certificate={kubelet_client.cert}", f"--kubelet-client-key={kubelet_client.key}",
            "--kubelet-preferred-address-types=InternalIP", "--allow-privileged=true",
            "--profiling=false", "--v=1"], logs, f"{self.url}/readyz", self._tls())
        self.components["kube-controller-manager"] = self._manager(
            "kube-controller-manager", "system:kube-controller-manager", logs, [
                "--use-service-account-credentials=true", "--controllers=*",
                f"--service-account-private-key-file={self.sa_keys.key}", f"--root-ca-file={self.ca.cert}",
                f"--cluster-signing-cert-file={self.ca.cert}", f"--cluster-signing-key-file={self.ca.key}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                # notice the new node's Ready status (and lift its not-ready taint) within a second
                "--node-monitor-period=1s"])
        self.components["kube-scheduler"] = self._manager("kube-scheduler", "system:kube-scheduler", logs, [])

    def _addresses(self) -> list[str]:
        if self.advertise_address:
            # Pods reach the API at 10.96.0.1 (kube-proxy) -> the advertised address, on the node's bridge.
            return ["--bind-address=0.0.0.0", f"--advertise-address={self.advertise_address}"]
        # Loopback, which the kubernetes-Service endpoint reconciler refuses: process pods reach the API
        # through the kubeconfig their kubelet writes, not that Service.
        return ["--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", "--endpoint-reconciler-type=none"]

    def _manager(self, name: str, user: str, logs: Path, extra: list[str]) -> Component:
        config = self._kubeconfig(name, user)
        port = free_port()
        return Component(name, [
            str(self.bin_dir / name), f"--kubeconfig={config}", f"--authentication-kubeconfig={config}",
            f"--authorization-kubeconfig={config}", "--leader-elect=false", "--bind-address=127.0.0.1",
            f"--secure-port={port}", f"--cert-dir={self.workdir / name}", *extra, "--v=1"],
            logs, f"https://127.0.0.1:{port}/healthz", self._insecure())

    # --- lifecycle --------------------------------------------------------------------

    def start(self, timeout: float = 60.0) -> "ControlPlane":
        deadline = time.monotonic() + timeout
        try:
            for name in ("etcd", "kube-apiserver"):
                self.components[name].start()
                self.components[name].wait_healthy(deadline)
            for name in ("kube-controller-manager", "kube-scheduler"):
                self.components[name].start()
            for name in ("kube-controller-manager", "kube-scheduler"):
                self.components[name].wait_healthy(deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def restart(self, name: str, timeout: float = 60.0) -> None:
        """Stop one component and start it again (its data and certificates stay)."""
        component = self.components[name]
        component.stop()
        component.start()
        component.wait_healthy(time.monotonic() + timeout)

    def stop(self) -> None:
        for name in ("kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd"):
            self.components[name].stop()

    def pids(self) -> list[int]:
        return [c.proc.pid for c in self.components.values() if c.proc is not None and c.proc.poll() is None]
