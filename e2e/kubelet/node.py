"""The Node object the local kubelet registers: capacity, addresses, readiness."""
from __future__ import annotations

import os
import platform
from typing import Any


def node_object(name: str, capacity: dict[str, str], internal_ip: str, version: str = "v1.37.0") -> dict[str, Any]:
    arch = "arm64" if platform.machine() in ("aarch64", "arm64") else "amd64"
    resources = {k: str(v) for k, v in capacity.items() if not (k == "nvidia.com/gpu" and str(v) in ("0", ""))}
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                                              "kubernetes.io/arch": arch, "beta.kubernetes.io/os": "linux",
                                              "beta.kubernetes.io/arch": arch}},
        "spec": {},
        "status": {
            "capacity": resources, "allocatable": dict(resources),
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                            "message": "kubelet is posting ready status (local process kubelet)"}],
            "addresses": [{"type": "InternalIP", "address": internal_ip}, {"type": "Hostname", "address": name}],
            "nodeInfo": {"kubeletVersion": version, "kubeProxyVersion": "", "containerRuntimeVersion": "local-process://1",
                         "operatingSystem": "linux", "architecture": arch, "osImage": platform.platform(),
                         "kernelVersion": platform.release(), "machineID": "", "systemUUID": "",
                         "bootID": str(os.getpid())},
        },
    }
