"""Prometheus metrics of the router, in a registry of its own; names, help and buckets come from
pagedmodel/metrics_contract.py."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from pagedmodel import metrics_contract as mc

OTHER_TENANTS = "other"


class TenantLabels:
    """Bounded label cardinality: the first `cap` tenants seen get their own label value, the rest share
    "other" (a Prometheus series per API key would grow without bound)."""

    def __init__(self, cap: int = 100) -> None:
        if cap < 1:
            raise ValueError(f"cap must be >= 1, got {cap}")
        self.cap = cap
        self._named: set[str] = set()

    def __call__(self, tenant: str) -> str:
        if tenant in self._named:
            return tenant
        if len(self._named) < self.cap and tenant != OTHER_TENANTS:
            self._named.add(tenant)
            return tenant
        return OTHER_TENANTS


class RouterMetrics:
    def __init__(self, max_tenant_labels: int = 100) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = mc.register(mc.ROUTER_REQUESTS, r)
        self.queue_length = mc.register(mc.ROUTER_QUEUE_LENGTH, r)
        self.rate_limited = mc.register(mc.ROUTER_RATE_LIMITED, r)
        self.inflight = mc.register(mc.ROUTER_UPSTREAM_INFLIGHT, r)
        self.pending_prefill = mc.register(mc.ROUTER_UPSTREAM_PENDING_PREFILL, r)
        self.latency = mc.register(mc.ROUTER_UPSTREAM_LATENCY, r)
        self.queue_time = mc.register(mc.ROUTER_QUEUE_TIME, r)
        self.healthy = mc.register(mc.ROUTER_UPSTREAM_HEALTHY, r)
        self.retries = mc.register(mc.ROUTER_RETRIES, r)
        self.adapter_routing = mc.register(mc.ROUTER_ADAPTER_ROUTING, r)
        self.tenant_requests = mc.register(mc.ROUTER_TENANT_REQUESTS, r)
        self.tenant_tokens = mc.register(mc.ROUTER_TENANT_TOKENS, r)
        self.arrival_requests = mc.register(mc.ROUTER_ARRIVAL_REQUESTS, r)
        self.arrival_tokens = mc.register(mc.ROUTER_ARRIVAL_TOKENS, r)
        self.client_connections = mc.register(mc.ROUTER_CLIENT_CONNECTIONS, r)
        self.upstream_connections = mc.register(mc.ROUTER_UPSTREAM_CONNECTIONS, r)
        self.asyncio_tasks = mc.register(mc.ROUTER_ASYNCIO_TASKS, r)
        self.tenant_label = TenantLabels(max_tenant_labels)

    def tenant_outcome(self, tenant: str, outcome: str, tokens: int) -> None:
        """Count one request (admitted or rejected) and its reserved tokens under the tenant's label."""
        label = self.tenant_label(tenant)
        self.tenant_requests.labels(label, outcome).inc()
        self.tenant_tokens.labels(label, outcome).inc(max(0, tokens))

    def tenant_used(self, tenant: str, tokens: int) -> None:
        self.tenant_tokens.labels(self.tenant_label(tenant), "used").inc(max(0, tokens))

    def render(self) -> bytes:
        return generate_latest(self.registry)
