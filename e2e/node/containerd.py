"""containerd (Debian's package) as the node's container runtime, with runc and the CNI bridge.

Its content store and snapshots live in ``~/.cache/pagedmodel/containerd`` so an image pulled once is
not pulled again; its state (sockets, running tasks) lives in the cluster's work directory.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from ..kube.component import Component
from . import host, registry

PAUSE_IMAGE = "registry.k8s.io/pause:3.10"
NAMESPACE = "k8s.io"   # the CRI plugin's containerd namespace


def root_dir() -> Path:
    base = os.environ.get("PAGEDMODEL_CONTAINERD_ROOT") or Path.home() / ".cache" / "pagedmodel" / "containerd"
    return Path(base)


class Containerd:
    def __init__(self, workdir: Path) -> None:
        self.dir = workdir / "containerd"
        self.socket = self.dir / "containerd.sock"
        self.config = self.dir / "config.toml"
        self.cni_dir = self.dir / "cni"
        self.certs_dir = self.dir / "certs.d"
        self.component = Component("containerd", ["containerd", "--config", str(self.config)],
                                   workdir / "logs", "", health_check=self._answers)

    @property
    def endpoint(self) -> str:
        return f"unix://{self.socket}"

    def _write_config(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        root_dir().mkdir(parents=True, exist_ok=True)
        self.cni_dir.mkdir(exist_ok=True)
        (self.cni_dir / "10-pagedmodel.conflist").write_text(json.dumps(host.cni_config(self.dir / "ipam"), indent=1))
        for registry_host in registry.MIRRORED:
            (self.certs_dir / registry_host).mkdir(parents=True, exist_ok=True)
            (self.certs_dir / registry_host / "hosts.toml").write_text(registry.hosts_toml(registry_host))
        cri = 'plugins."io.containerd.grpc.v1.cri"'
        self.config.write_text("\n".join([
            "version = 2",
            f'root = "{root_dir()}"',
            f'state = "{self.dir / "state"}"',
            # Snapshotters this host cannot run only log noise at start.
            'disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",'
            ' "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper"]',
            "[grpc]", f'  address = "{self.socket}"',
            "[ttrpc]", f'  address = "{self.socket}.ttrpc"',
            "[debug]", '  level = "warn"',
            f"[{cri}]",
            f'  sandbox_image = "{PAUSE_IMAGE}"',
            # The sandbox lacks CAP_SYS_RESOURCE: raising a container's oom_score_adj is refused.
            "  restrict_oom_score_adj = true",
            f"[{cri}.containerd]", '  snapshotter = "overlayfs"', '  default_runtime_name = "runc"',
            f"[{cri}.containerd.runtimes.runc]", '  runtime_type = "io.containerd.runc.v2"',
            f"[{cri}.containerd.runtimes.runc.options]", "  SystemdCgroup = false",
            f"[{cri}.cni]", f'  bin_dir = "{host.CNI_BIN_DIR}"', f'  conf_dir = "{self.cni_dir}"',
            f"[{cri}.registry]", f'  config_path = "{self.certs_dir}"', ""]))

    def _answers(self) -> bool:
        if not self.socket.exists():
            return False
        return self.ctr("version", check=False).returncode == 0

    def ctr(self, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["ctr", "--address", str(self.socket), "--namespace", NAMESPACE, *args],
                              capture_output=True, text=True, check=check, timeout=timeout)

    def start(self, deadline: float) -> None:
        self._write_config()
        self.component.start()
        self.component.wait_healthy(deadline)
        self.forget_containers()

    def forget_containers(self) -> None:
        """Kill and remove every container in the CRI namespace: at start, what a killed run left in the
        shared root (a fresh kubelet would spend its first minute killing them); at stop, the pods the
        stopped kubelet can no longer end."""
        containers = self.ctr("containers", "ls", "-q", check=False).stdout.split()
        namespaces = [path for ident in containers for path in self._network_namespaces(ident)]
        for ident in self.ctr("tasks", "ls", "-q", check=False).stdout.split():
            self.ctr("tasks", "kill", "-s", "SIGKILL", ident, check=False)
            self.ctr("tasks", "delete", "-f", ident, check=False)
        for ident in containers:
            self.ctr("containers", "delete", ident, check=False)
        host.remove_network_namespaces(namespaces)

    def _network_namespaces(self, ident: str) -> list[str]:
        """The pinned network namespace a sandbox joined (the CRI plugin's /var/run/netns/cni-*)."""
        info = self.ctr("containers", "info", ident, check=False)
        try:
            spec = json.loads(info.stdout).get("Spec") or {}
        except ValueError:
            return []
        return [ns["path"] for ns in (spec.get("linux") or {}).get("namespaces", [])
                if ns.get("type") == "network" and ns.get("path", "").startswith("/var/run/netns/")]

    def pull(self, image: str, timeout: float = 900) -> None:
        """Pull ``image`` through the node's registry mirrors, as the kubelet would, so the node runs
        what the registry holds now: a tag the node already has is not pulled again by the kubelet
        (IfNotPresent), and an image rebuilt since would silently stay stale."""
        self.ctr("images", "pull", "--hosts-dir", str(self.certs_dir), image, timeout=timeout)
        self.forget_untagged_images()

    def forget_untagged_images(self) -> None:
        """Images no tag names any more, with their layers and unpacked snapshots. A tag pulled again moves
        to the new build, but the CRI's store keeps the old one by digest and ID: 6 GB a build of the
        chart's image, on every code change, until the disk is full."""
        rows = [line.split() for line in self.ctr("images", "ls").stdout.splitlines()[1:] if line.strip()]
        tagged = {row[2] for row in rows if "@" not in row[0] and not row[0].startswith("sha256:")}
        stale = [row[0] for row in rows if row[2] not in tagged]
        if stale:
            self.ctr("images", "rm", "--sync", *stale, timeout=300)

    def stop(self) -> None:
        self.component.stop(grace_s=10.0)
        host.kill(host.runc_shims(str(self.socket)))   # any left belong to this cluster's pods
        shutil.rmtree(self.dir / "state", ignore_errors=True)
