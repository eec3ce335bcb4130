"""The cluster's node, for real: containerd + runc, the kubelet, kube-proxy, CoreDNS and the local
registry, on this machine (one per machine). Pods are containers of images pulled from the local
registry, on a bridge network with Service ClusterIPs and cluster DNS.

    node = RealNode(workdir, control_plane, "pagedmodel-node")
    node.start(deadline)      # Ready and untainted on return
    node.stop()               # every container killed, mounts released
"""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from ..kube import build
from ..kube.component import Component
from ..kube.control_plane import BinariesMissing, ControlPlane
from . import host, images, registry
from .cluster_dns import RBAC as DNS_RBAC, cluster_dns_component
from .containerd import Containerd
from .kube_proxy import kube_proxy_component
from .kubelet import kubelet_component

NODE_BINARIES = ("kubelet", "kube-proxy", "coredns", "registry", "kubectl", "fake-gpu-plugin")
# A unix socket's path holds at most 107 bytes; the kubelet binds the longest one, a temporary name beside
# its pod-resources socket, about this much below its root directory.
_LONGEST_SOCKET_SUFFIX = len("/pod-resources/0123456789")


class RealNode:
    def __init__(self, workdir: Path, control_plane: ControlPlane, node_name: str,
                 bin_dir: Path | None = None, gpus: int = 0) -> None:
        host.check_host()
        self.bin_dir = Path(bin_dir or build.bin_dir())
        missing = [name for name in NODE_BINARIES if not (self.bin_dir / name).is_file()]
        if missing:
            raise BinariesMissing(f"node binaries missing in {self.bin_dir}: {', '.join(missing)}; "
                                  "build them with: python -m e2e.kube.build")
        self.workdir = Path(workdir).resolve() / "node"
        longest = len(str(self.workdir / "kubelet" / "root")) + _LONGEST_SOCKET_SUFFIX
        if longest > 107:
            raise ValueError(f"the work directory {workdir} is too long for the node's unix sockets ({longest} > 107 "
                             "bytes; the kubelet would fail to bind them): choose a shorter one")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.control_plane = control_plane
        self.node_name = node_name
        self.containerd = Containerd(self.workdir)
        self.registry = registry.registry_component(self.workdir)
        self.kubelet = kubelet_component(self.workdir, control_plane, node_name, self.containerd.endpoint,
                                         self.bin_dir)
        self.kube_proxy = kube_proxy_component(self.workdir, control_plane, node_name, self.bin_dir)
        self.cluster_dns = cluster_dns_component(self.workdir, control_plane, self.bin_dir)
        self.gpus = gpus
        # nvidia.com/gpu as a GPU node has it: devices registered over the kubelet's device-plugin API.
        self.device_plugin = Component("fake-gpu-plugin", [str(self.bin_dir / "fake-gpu-plugin"), f"--count={gpus}"],
                                       self.workdir / "logs", "", health_check=lambda: True)

    @property
    def components(self) -> dict[str, Component]:
        return {c.name: c for c in (self.registry, self.containerd.component, self.kubelet, self.kube_proxy,
                                    self.cluster_dns, self.device_plugin)}

    def kubectl(self, *args: str, stdin: str | None = None) -> str:
        proc = subprocess.run([str(self.bin_dir / "kubectl"), f"--kubeconfig={self.control_plane.admin_kubeconfig}",
                               *args], input=stdin, capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)}: {proc.stderr.strip()}")
        return proc.stdout

    def start(self, deadline: float) -> None:
        try:
            host.setup_network()
            host.clear_leftover_pods()
            self.registry.start()
            self.registry.wait_healthy(deadline)
            images.ensure_pause()
            self.containerd.start(deadline)
            self.kubectl("apply", "-f", "-", stdin=DNS_RBAC)
            for component in (self.kubelet, self.kube_proxy, self.cluster_dns):
                component.start()
            for component in (self.kubelet, self.kube_proxy, self.cluster_dns):
                component.wait_healthy(deadline)
            if self.gpus:
                self.device_plugin.start()
            self._until_schedulable(deadline)
        except BaseException:
            self.stop()
            raise

    def _until_schedulable(self, deadline: float) -> None:
        """Ready, and the node-lifecycle controller has lifted its not-ready taint."""
        node: dict = {}
        while time.monotonic() < deadline:
            try:
                node = json.loads(self.kubectl("get", "node", self.node_name, "-o", "json"))
            except RuntimeError:
                time.sleep(0.3)
                continue
            ready = any(c["type"] == "Ready" and c["status"] == "True" for c in node["status"].get("conditions", []))
            taints = [t for t in node["spec"].get("taints") or [] if t["key"].startswith("node.kubernetes.io/")]
            gpus = int(node["status"].get("allocatable", {}).get("nvidia.com/gpu", "0"))
            if ready and not taints and gpus == self.gpus:
                return
            time.sleep(0.3)
        raise RuntimeError(f"node {self.node_name} not schedulable in time: "
                           f"{node.get('status', {}).get('conditions')} taints={node.get('spec', {}).get('taints')}; "
                           f"kubelet log:\n{self.kubelet.log_tail()}")

    def stop(self) -> None:
        """Everything down, nothing left running or mounted (safe to call twice)."""
        if self.kubelet.running:
            self._drain()
        for component in (self.device_plugin, self.cluster_dns, self.kube_proxy, self.kubelet):
            component.stop()
        if self.containerd.component.running:
            self.containerd.forget_containers()
        self.containerd.stop()
        self.registry.stop()
        prefix = str(self.workdir.resolve()) + "/"
        host.unmount_where(lambda mount: mount.startswith(prefix))   # volume mounts the kubelet left


    def _drain(self, timeout: float = 30.0) -> None:
        """Delete the pods still bound here and let the kubelet end them as it does on a node drain:
        their sandboxes torn down through CNI (addresses released, namespaces removed)."""
        try:
            self.kubectl("delete", "pods", "--all", "--all-namespaces", "--force", "--grace-period=0",
                         "--wait=false")
        except RuntimeError:
            return   # the API server is down: the kill below does it the hard way
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.containerd.ctr("containers", "ls", "-q", check=False).stdout.strip():
            time.sleep(0.3)

