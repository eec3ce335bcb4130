"""Prometheus metrics of the router, in a registry of its own; names, help and buckets come from
pagedmodel/metrics_contract.py."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from pagedmodel import metrics_contract as mc


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = mc.register(mc.ROUTER_REQUESTS, r)
        self.queue_length = mc.register(mc.ROUTER_QUEUE_LENGTH, r)
        self.rate_limited = mc.register(mc.ROUTER_RATE_LIMITED, r)
        self.inflight = mc.register(mc.ROUTER_UPSTREAM_INFLIGHT, r)
        self.latency = mc.register(mc.ROUTER_UPSTREAM_LATENCY, r)
        self.queue_time = mc.register(mc.ROUTER_QUEUE_TIME, r)
        self.healthy = mc.register(mc.ROUTER_UPSTREAM_HEALTHY, r)
        self.retries = mc.register(mc.ROUTER_RETRIES, r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
