"""A local Kubernetes cluster: the real control plane (e2e/kube/) and the real node, the kubelet v1.37
on containerd (e2e/node/; root only, one per machine).

    python -m e2e.cluster up [--gpus N] [--workdir DIR]

starts it in the foreground, prints the kubeconfig path and the node's pod addresses, and stops
everything (pods and control plane) on Ctrl-C. Tests use the same :class:`e2e.kube.local_cluster.KubeCluster`.
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from .kube.control_plane import BinariesMissing
from .kube.local_cluster import KubeCluster
from .node.host import BRIDGE, POD_SUBNET, NodeMissing


def _up(args: argparse.Namespace) -> int:
    try:
        cluster = KubeCluster(args.workdir, gpus=args.gpus).start()
    except (BinariesMissing, NodeMissing, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"control plane:  etcd, kube-apiserver, kube-controller-manager, kube-scheduler "
          f"(up in {cluster.startup_s:.1f}s; kubectl: {cluster.kubectl_path})")
    print(f"API server:     {cluster.url}")
    print(f"kubeconfig:     {cluster.kubeconfig}")
    print(f"pod addresses:  {POD_SUBNET} on bridge {BRIDGE} (node {cluster.node_name}: kubelet on containerd)")
    print(f"try:            KUBECONFIG={cluster.kubeconfig} {cluster.kubectl_path} get nodes")
    print("Ctrl-C stops the cluster and every pod.", flush=True)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    print("stopping...", flush=True)
    cluster.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.cluster", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start the control plane and the kubelet in the foreground")
    up.add_argument("--workdir", help="where the kubeconfig, logs and pod files go (default: a temporary directory)")
    up.add_argument("--gpus", type=int, default=0, help="nvidia.com/gpu devices of the node (default 0), "
                    "registered through its fake device plugin")
    up.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.gpus < 0:
        parser.error("--gpus must be >= 0")
    return _up(args)


if __name__ == "__main__":
    sys.exit(main())
