"""The real kubelet (v1.37, built with the control plane) on containerd, as the cluster's one node.

Its root directory and pod logs live in the cluster's work directory; its identity is
``system:node:<name>`` (Node authorizer, NodeRestriction), its serving certificate is signed by the
cluster's CA so kube-apiserver reaches it for logs, exec and port-forward.
"""
from __future__ import annotations

from pathlib import Path

import yaml

from ..kube.component import Component
from ..kube.control_plane import ControlPlane
from . import host

HEALTHZ_PORT = 10248


def kubelet_configuration(*, ca: Path, serving: tuple[Path, Path], runtime_endpoint: str,
                          pod_logs: Path, max_pods: int = 110) -> dict:
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
        "address": host.NODE_IP, "port": 10250, "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1", "healthzPort": HEALTHZ_PORT,
        "tlsCertFile": str(serving[0]), "tlsPrivateKeyFile": str(serving[1]),
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                           "x509": {"clientCAFile": str(ca)}},
        "authorization": {"mode": "Webhook"},
        # This host: cgroup v1 (hybrid) managed by hand, swap not off.
        "cgroupDriver": "cgroupfs", "failCgroupV1": False, "failSwapOn": False,
        "containerRuntimeEndpoint": runtime_endpoint,
        "clusterDNS": [host.NODE_IP], "clusterDomain": "cluster.local", "resolvConf": "/etc/resolv.conf",
        "podLogsDir": str(pod_logs), "maxPods": max_pods,
        # A shared developer machine: evict only when truly out of memory or disk, never GC our images.
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%",
                         "nodefs.inodesFree": "1%"},
        "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
        # The project's image is several GB: a first pull takes minutes, not the default 2.
        "runtimeRequestTimeout": "20m", "serializeImagePulls": False,
        "nodeStatusUpdateFrequency": "4s", "syncFrequency": "10s",
        "rotateCertificates": False, "serverTLSBootstrap": False,
        "shutdownGracePeriod": "0s",
    }


def kubelet_component(workdir: Path, control_plane: ControlPlane, node_name: str, runtime_endpoint: str,
                      bin_dir: Path) -> Component:
    directory = workdir / "kubelet"
    directory.mkdir(parents=True, exist_ok=True)
    serving = control_plane.ca.issue(f"kubelet-serving-{node_name}", f"system:node:{node_name}",
                                     ("system:nodes",), server_hosts=(host.NODE_IP, node_name))
    config = directory / "config.yaml"
    config.write_text(yaml.safe_dump(kubelet_configuration(
        ca=control_plane.ca.cert, serving=(serving.cert, serving.key), runtime_endpoint=runtime_endpoint,
        pod_logs=workdir / "pod-logs")))
    return Component("kubelet", [
        str(bin_dir / "kubelet"), f"--config={config}",
        f"--kubeconfig={control_plane.node_kubeconfig(node_name)}",
        f"--root-dir={directory / 'root'}", f"--hostname-override={node_name}", f"--node-ip={host.NODE_IP}",
        "--v=1"], workdir / "logs", f"http://127.0.0.1:{HEALTHZ_PORT}/healthz")
