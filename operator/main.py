"""`pagedmodel operator`: run the PagedModel operator (kopf) for some namespaces or the whole cluster."""
from __future__ import annotations

import argparse
import logging

from .handlers import OperatorConfig, register
from .telemetry import OperatorMetrics


def add_arguments(parser: argparse.ArgumentParser) -> None:
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=[], metavar="NS",
                       help="watch this namespace (repeatable; globs like 'team-*' allowed)")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace (default)")
    parser.add_argument("--status-interval", type=float, default=5.0, metavar="S",
                        help="seconds between status refreshes of each PagedModel (default 5); engines are "
                             "scraped every spec.autoscaling.intervalSeconds, checked at each refresh")
    parser.add_argument("--router", choices=["auto", "enabled", "disabled"], default="auto",
                        help="deploy `pagedmodel router` in front of the engines (auto, the default, is enabled)")
    parser.add_argument("--pod-bind", choices=["all", "pod-ip"], default="all",
                        help="engines and routers listen on 0.0.0.0 (all) or only on their pod IP (pod-ip: for "
                             "pods that share the host's network namespace, e.g. hostNetwork)")
    parser.add_argument("--liveness", metavar="URL", default=None,
                        help="serve kopf's liveness probe here, e.g. http://0.0.0.0:8080/healthz")
    parser.add_argument("--metrics-port", type=int, default=0, metavar="PORT",
                        help="serve the operator's own Prometheus metrics on this port at /metrics (0: off)")
    parser.add_argument("--metrics-host", default="0.0.0.0", metavar="HOST",
                        help="address the metrics port listens on (default 0.0.0.0; the chart gives the pod IP)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def run(args: argparse.Namespace) -> int:
    import kopf

    if args.status_interval <= 0:
        raise SystemExit("pagedmodel operator: --status-interval must be > 0")
    if not 0 <= args.metrics_port <= 65535:
        raise SystemExit(f"pagedmodel operator: --metrics-port must be in [0, 65535], not {args.metrics_port}")
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    registry = kopf.OperatorRegistry()
    metrics = OperatorMetrics()
    if args.metrics_port:
        try:
            metrics.serve(args.metrics_port, addr=args.metrics_host)
        except OSError as exc:
            raise SystemExit(f"pagedmodel operator: cannot serve metrics on {args.metrics_host}:{args.metrics_port}: "
                             f"{exc}") from exc
    register(registry, OperatorConfig(status_interval_s=args.status_interval, router=args.router,
                                      bind=args.pod_bind), metrics)
    namespaces = list(args.namespace)
    # standalone: one replica (Recreate) and no peering CRD, so nothing beyond our CRD must be installed.
    kopf.run(registry=registry, standalone=True, clusterwide=not namespaces, namespaces=namespaces,
             liveness_endpoint=args.liveness)
    return 0
