"""One request's life as a tenant's: admitted against its limits, charged to the fair queue, settled by usage.

The router app calls `admit` before queueing and `finish` once the request is over, whatever happened in
between (answered, refused by the queue, cut off by the client). The pieces it ties together each keep
their own state: TenantLimiter the buckets, AdmissionQueue the virtual counters, RouterMetrics the series;
this module only moves numbers between them.
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .admission import Clock
from .arrival_rate import ArrivalRate
from .metrics import RouterMetrics
from .queue import AdmissionQueue
from .token_limits import TenantLimiter, TokenDecision, estimate_prompt_tokens, reservation
from .usage import UsageMeter


@dataclass
class Admission:
    """An admitted request's accounts; the app fills `meter`, `relayed` and `status` as it proxies."""

    tenant: str
    reserved: int                 # tokens taken from the tenant's bucket at admission
    prompt_estimate: int
    headers: dict[str, str] = field(default_factory=dict)   # x-ratelimit-* for the response
    charged: int = 0              # tokens charged to the tenant's virtual counter so far
    meter: UsageMeter | None = None
    relayed: bool = False         # an upstream answer reached the client (False: the router refused it)
    status: int = 0
    generates: bool = True        # a completion: charged by its usage (else one request and no tokens)


class Tenancy:
    def __init__(self, limiter: TenantLimiter, queue: AdmissionQueue, metrics: RouterMetrics, *,
                 default_max_tokens: int = 256, arrival_tau_s: float = 10.0, clock: Clock = time.monotonic) -> None:
        if default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {default_max_tokens}")
        self.limiter = limiter
        self.queue = queue
        self.metrics = metrics
        self.default_max_tokens = default_max_tokens
        self.request_rate = ArrivalRate(arrival_tau_s, clock)
        self.token_rate = ArrivalRate(arrival_tau_s, clock)

    def admit(self, headers: Mapping[str, str], body: Mapping[str, Any], *,
              generates: bool = True) -> Admission | TokenDecision:
        """The request's Admission, or the refusal (a TokenDecision with allowed False) to answer 429 with.
        `generates` False (a POST other than completions, such as tokenize): one request, no tokens."""
        tenant = self.limiter.tenant(headers)
        reserved = reservation(body, self.default_max_tokens) if generates else 0
        if self.limiter.enabled:
            decision = self.limiter.admit(tenant, reserved)
            if not decision.allowed:
                self.metrics.tenant_outcome(tenant, "rejected", reserved)
                return decision
            rate_headers = decision.headers
        else:
            rate_headers = {}
        self.metrics.tenant_outcome(tenant, "admitted", reserved)
        if generates:   # the autoscaler divides this by engines' completions per second: count only those
            self.request_rate.add(1.0)
            self.token_rate.add(reserved)
        return Admission(tenant, reserved, estimate_prompt_tokens(body) if generates else 0, rate_headers,
                         generates=generates)

    def dispatched(self, adm: Admission, *, queued: bool) -> None:
        """The request got an upstream slot; one that skipped the queue is charged here (the queue charges
        the ones it grants), so counters reflect every token served."""
        if not queued:
            self.queue.charge(adm.tenant, adm.reserved, dispatched=True)
        adm.charged += adm.reserved

    def finish(self, adm: Admission) -> None:
        """Settle the reservation: refund a request the router refused, else charge what it used."""
        if not adm.relayed:
            self.limiter.cancel(adm.tenant, adm.reserved)
            used = 0
        elif not adm.generates:
            used = 0
        else:
            measured = adm.meter.used(adm.prompt_estimate) if adm.meter is not None else None
            # No usage in the answer: an upstream error used nothing; a success without it keeps its reservation.
            used = measured if measured is not None else (0 if adm.status >= 400 else adm.reserved)
            self.limiter.settle(adm.tenant, adm.reserved, used)
            self.metrics.tenant_used(adm.tenant, used)
        if adm.charged != used:
            self.queue.charge(adm.tenant, used - adm.charged)
            adm.charged = used

    def update_gauges(self) -> None:
        self.metrics.arrival_requests.set(round(self.request_rate.rate(), 6))
        self.metrics.arrival_tokens.set(round(self.token_rate.rate(), 3))
