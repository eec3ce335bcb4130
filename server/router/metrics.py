"""Prometheus metrics of the router (names from ARCHITECTURE.md §Metrics), in a registry of its own."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("pagedmodel_router_requests", "Requests answered by the router, by HTTP status.",
                                ["code"], registry=r)
        self.queue_length = Gauge("pagedmodel_router_queue_length", "Requests waiting in the router queue.",
                                  registry=r)
        self.rate_limited = Counter("pagedmodel_router_rate_limited", "Requests refused with 429.",
                                    ["scope"], registry=r)
        self.inflight = Gauge("pagedmodel_router_upstream_inflight", "Requests open to each upstream.",
                              ["upstream"], registry=r)
        self.latency = Histogram("pagedmodel_router_upstream_latency_seconds",
                                 "Time from sending a request upstream to its last response byte.",
                                 ["upstream"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("pagedmodel_router_queue_time_seconds", "Time requests waited in the queue.",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.healthy = Gauge("pagedmodel_router_upstream_healthy", "1 when the upstream is in rotation, 0 ejected.",
                             ["upstream"], registry=r)
        self.retries = Counter("pagedmodel_router_retries", "Requests re-sent to another upstream after a "
                               "connection failure.", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
