"""Cluster DNS: CoreDNS (built from its Go module) with its ``kubernetes`` plugin, answering
``<service>.<namespace>.svc.cluster.local`` from the API as in every cluster. It listens on the
node's address, which the kubelet writes into every ClusterFirst pod's resolv.conf."""
from __future__ import annotations

from pathlib import Path

from ..kube.component import Component
from ..kube.control_plane import ControlPlane
from . import host

READY = "127.0.0.1:8181"
# What CoreDNS's kubernetes plugin reads (the upstream system:coredns role, no more).
RBAC = """
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: "system:coredns"}
rules:
- apiGroups: [""]
  resources: [endpoints, services, pods, namespaces]
  verbs: [list, watch]
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: "system:coredns"}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "system:coredns"}
subjects:
- {apiGroup: rbac.authorization.k8s.io, kind: User, name: "system:coredns"}
"""


def corefile(kubeconfig: Path) -> str:
    return f"""\
.:53 {{
    bind {host.NODE_IP}
    errors
    ready {READY}
    kubernetes cluster.local in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig} local
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
        ttl 5
    }}
    forward . /etc/resolv.conf
    cache 5
}}
"""


def cluster_dns_component(workdir: Path, control_plane: ControlPlane, bin_dir: Path) -> Component:
    kubeconfig = control_plane.client_kubeconfig("coredns", "system:coredns")
    config = workdir / "Corefile"
    config.write_text(corefile(kubeconfig))
    return Component("coredns", [str(bin_dir / "coredns"), "-conf", str(config)], workdir / "logs",
                     f"http://{READY}/ready")
