"""What the real node needs from this machine, and the machine-wide network it sets up.

One real node per machine: the kubelet owns port 10250, the pod bridge and its iptables chains are
the host's. Everything missing is named in one sentence (never a silent skip).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Callable

BRIDGE = "pm-cni0"
POD_SUBNET = "10.244.0.0/24"
NODE_IP = "10.244.0.1"        # the bridge's address: the kubelet's --node-ip, the pods' gateway
CNI_BIN_DIR = Path("/usr/lib/cni")
APT_PACKAGES = "containerd runc containernetworking-plugins buildah mmdebstrap iptables conntrack iproute2"


class NodeMissing(RuntimeError):
    """Something the real node needs is not on this machine; the message says what and how to get it."""


def _needed() -> dict[str, str]:
    """What must exist -> the Debian package that brings it."""
    return {"containerd": "containerd", "runc": "runc", "buildah": "buildah", "mmdebstrap": "mmdebstrap",
            "iptables": "iptables", "conntrack": "conntrack", "ip": "iproute2",
            str(CNI_BIN_DIR / "bridge"): "containernetworking-plugins",
            str(CNI_BIN_DIR / "host-local"): "containernetworking-plugins",
            str(CNI_BIN_DIR / "portmap"): "containernetworking-plugins",
            str(CNI_BIN_DIR / "loopback"): "containernetworking-plugins"}


def check_host() -> None:
    """Raise NodeMissing, in one sentence, if this machine cannot run the real node."""
    if os.geteuid() != 0:
        raise NodeMissing("the real node (containerd, the kubelet, pod networking) must run as root")
    missing = {}
    for thing, package in _needed().items():
        found = Path(thing).exists() if thing.startswith("/") else shutil.which(thing) is not None
        if not found:
            missing[thing] = package
    if missing:
        packages = " ".join(sorted(set(missing.values())))
        raise NodeMissing(f"the real node needs {', '.join(missing)}, which this machine lacks: "
                          f"apt-get install {packages}")
    if not Path("/proc/sys/net/bridge/bridge-nf-call-iptables").exists():
        raise NodeMissing("the kernel has no br_netfilter (/proc/sys/net/bridge is missing), so kube-proxy "
                          "cannot see traffic between pods on the bridge: modprobe br_netfilter")


def _sysctl(key: str, value: str) -> None:
    Path("/proc/sys", key.replace(".", "/")).write_text(value)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def setup_network() -> None:
    """Forwarding on, bridged traffic through iptables (kube-proxy's rules), and the pod bridge up
    with the node's address, before the API server and the kubelet bind to it."""
    _sysctl("net.ipv4.ip_forward", "1")
    _sysctl("net.bridge.bridge-nf-call-iptables", "1")
    if _ip("link", "show", BRIDGE, check=False).returncode != 0:
        _ip("link", "add", BRIDGE, "type", "bridge")
    if NODE_IP not in _ip("-4", "addr", "show", BRIDGE).stdout:
        _ip("addr", "add", f"{NODE_IP}/24", "dev", BRIDGE)
    _ip("link", "set", BRIDGE, "up")
    # Pods reach the API server and DNS on the node's address; allow it whatever the host's policy.
    rule = ["INPUT", "-i", BRIDGE, "-j", "ACCEPT"]
    if subprocess.run(["iptables", "-C", *rule], capture_output=True).returncode != 0:
        subprocess.run(["iptables", "-I", *rule], check=True, capture_output=True)


def cni_config(ipam_dir: Path) -> dict:
    """The bridge network: pods get 10.244.0.x behind NAT, reachable from the host; hairpin so a pod
    reaches itself through its own Service. Address leases live in ``ipam_dir`` (the cluster's own:
    a killed run cannot leak the subnet's addresses into the next)."""
    return {"cniVersion": "1.0.0", "name": "pagedmodel-pods", "plugins": [
        {"type": "bridge", "bridge": BRIDGE, "isGateway": True, "ipMasq": True, "hairpinMode": True,
         "ipam": {"type": "host-local", "dataDir": str(ipam_dir), "ranges": [[{"subnet": POD_SUBNET, "gateway": NODE_IP}]],
                  "routes": [{"dst": "0.0.0.0/0"}]}},
        {"type": "portmap", "capabilities": {"portMappings": True}}]}


def clear_leftover_pods() -> None:
    """What a killed run left on the machine (one real node per machine, so all of it is ours): pod
    processes in the kubelet's cgroups, and pod interfaces on the bridge. A leftover interface still
    holds its pod's address; the next pod given that address would be unreachable."""
    kubepods = Path("/sys/fs/cgroup/pids/kubepods")
    kill([int(pid) for procs in (kubepods.rglob("cgroup.procs") if kubepods.is_dir() else [])
          for pid in procs.read_text().split()])
    # Called before this node's containerd starts: every real-node shim found belongs to a run that is over.
    kill(runc_shims("/node/containerd/containerd.sock"))
    # Container root filesystems, shm and volume mounts of a run killed before it could unmount them.
    unmount_where(lambda m: "/node/containerd/state/" in m or "/node/kubelet/root" in m)
    links = _ip("-j", "link", "show", "master", BRIDGE, check=False)
    for link in json.loads(links.stdout or "[]") if links.returncode == 0 else []:
        _ip("link", "delete", link["ifname"], check=False)


def remove_network_namespaces(paths: list[str]) -> None:
    """Pod network namespaces (``/var/run/netns/cni-*``) whose sandboxes were killed, not torn down."""
    for path in paths:
        subprocess.run(["umount", path], capture_output=True)
        Path(path).unlink(missing_ok=True)


def kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def unmount_where(wanted: Callable[[str], bool]) -> None:
    """Lazily unmount every mount point ``wanted`` selects, innermost first."""
    mounts = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
    for mount in sorted(filter(wanted, mounts), key=len, reverse=True):
        subprocess.run(["umount", "-l", mount], capture_output=True)


def runc_shims(address_suffix: str) -> list[int]:
    """Process ids of the runc shims serving a containerd whose socket path ends with ``address_suffix``
    (shims outlive containerd by design)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if not argv or not argv[0].endswith(b"containerd-shim-runc-v2") or b"-address" not in argv:
            continue
        address = argv[argv.index(b"-address") + 1].decode(errors="replace")
        if address.endswith(address_suffix):
            found.append(int(cmdline.parent.name))
    return found
