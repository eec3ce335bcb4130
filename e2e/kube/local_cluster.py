"""A local Kubernetes cluster: the real control plane (e2e/kube/control_plane.py) and the real node
(e2e/node/: the kubelet v1.37 on containerd, kube-proxy, CoreDNS, the local registry; root only, one per
machine).

    with KubeCluster(gpus=1) as cluster:
        cluster.kubeconfig      # admin (system:masters) kubeconfig
        cluster.control_plane   # restart("kube-apiserver"), restart("etcd"), pids()
        cluster.real_node       # containerd, the kubelet and the node's other components

``stop()`` drains the node (every pod's containers end) and ends every control-plane process.
"""
from __future__ import annotations

import atexit
import shutil
import tempfile
import time
from pathlib import Path

from ..node import host
from ..node.real_node import RealNode
from . import build
from .control_plane import ControlPlane


class KubeCluster:
    def __init__(self, workdir: str | Path | None = None, *, gpus: int = 0, node_name: str = "pagedmodel-node",
                 bin_dir: Path | None = None) -> None:
        """``gpus``: nvidia.com/gpu devices the node's fake device plugin registers."""
        if gpus < 0:
            raise ValueError(f"gpus must be >= 0, got {gpus}")
        self._own_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="pagedmodel-kube-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.control_plane = ControlPlane(self.workdir, bin_dir, advertise_address=host.NODE_IP)
        self.real_node = RealNode(self.workdir, self.control_plane, node_name, bin_dir, gpus=gpus)
        self.kubeconfig = self.control_plane.admin_kubeconfig
        self.url = self.control_plane.url
        self.node_name = node_name
        self.kubectl_path = str(build.bin_dir() / "kubectl")
        self.startup_s = 0.0

    def start(self, timeout: float = 60.0) -> "KubeCluster":
        started = time.monotonic()
        self.control_plane.start(timeout)
        try:
            self.real_node.start(started + timeout)
        except BaseException:
            self.control_plane.stop()
            raise
        self.startup_s = time.monotonic() - started
        atexit.register(self.stop)
        return self

    def stop(self) -> None:
        """Drain the node, then end the control plane. Safe to call twice."""
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
