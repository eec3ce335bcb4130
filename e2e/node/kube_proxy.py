"""kube-proxy (v1.37, built with the control plane) in iptables mode: Service ClusterIPs and NodePorts
work on the node as in any cluster (pods reach ``kubernetes.default`` at 10.96.0.1, the router
reaches engines through their Services)."""
from __future__ import annotations

from pathlib import Path

import yaml

from ..kube.component import Component
from ..kube.control_plane import ControlPlane

HEALTHZ = "127.0.0.1:10256"


def kube_proxy_component(workdir: Path, control_plane: ControlPlane, node_name: str, bin_dir: Path) -> Component:
    # system:kube-proxy is what the default system:node-proxier binding names.
    kubeconfig = control_plane.client_kubeconfig("kube-proxy", "system:kube-proxy")
    config = workdir / "kube-proxy.yaml"
    config.write_text(yaml.safe_dump({
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(kubeconfig)}, "mode": "iptables",
        "clusterCIDR": "10.244.0.0/16", "hostnameOverride": node_name,
        "healthzBindAddress": HEALTHZ, "metricsBindAddress": "127.0.0.1:10249",
        # Leave the host's conntrack table size alone (the sandbox may refuse the write).
        "conntrack": {"maxPerCore": 0, "min": 0},
        "iptables": {"minSyncPeriod": "0s", "syncPeriod": "30s"}}))
    return Component("kube-proxy", [str(bin_dir / "kube-proxy"), f"--config={config}", "--v=1"],
                     workdir / "logs", f"http://{HEALTHZ}/healthz")
