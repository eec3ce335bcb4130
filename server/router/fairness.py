"""Virtual token counters: which tenant the router's queue serves next when the upstreams are saturated.

After the Virtual Token Counter of "Fairness in Serving Large Language Models" (Sheng et al., OSDI 2024):
every tenant has a counter of the tokens served to it; the queue serves the waiting tenant with the
smallest counter. A tenant that becomes active (its first request waits) has its counter lifted to the
smallest counter among the tenants already waiting -- or, with none waiting, to that of the tenant
served last -- so time spent idle cannot be banked as credit for a later burst. Counters are charged
with a request's estimated tokens when it is dispatched and corrected by its real usage when it ends,
so two tenants that both keep the queue busy receive equal token throughput whatever their request sizes.

Pure bookkeeping, no clock: the queue decides when tenants are active.
"""
from __future__ import annotations

from collections.abc import Iterable


class VirtualTokenCounters:
    def __init__(self, max_tenants: int = 10_000) -> None:
        if max_tenants < 1:
            raise ValueError(f"max_tenants must be >= 1, got {max_tenants}")
        self.max_tenants = max_tenants
        self._counters: dict[str, float] = {}
        self._last_served: str | None = None

    def __getitem__(self, tenant: str) -> float:
        return self._counters.get(tenant, 0.0)

    def __len__(self) -> int:
        return len(self._counters)

    def activate(self, tenant: str, waiting: Iterable[str]) -> None:
        """`tenant` has its first request waiting; `waiting` are the other tenants with requests queued."""
        floor = min((self[t] for t in waiting if t != tenant), default=None)
        if floor is None and self._last_served is not None and self._last_served != tenant:
            floor = self[self._last_served]
        if floor is not None and self[tenant] < floor:
            self._counters[tenant] = floor
        elif tenant not in self._counters:
            self._counters[tenant] = 0.0
        self._bound(keep=set(waiting) | {tenant})

    def charge(self, tenant: str, tokens: float, *, dispatched: bool = True) -> None:
        """Add tokens served; `dispatched` False for a correction at the end of a request (negative when it
        used less than was charged), which must not make the tenant the one served last."""
        self._counters[tenant] = max(0.0, self[tenant] + tokens)
        if dispatched:
            self._last_served = tenant

    def _bound(self, keep: set[str]) -> None:
        # A forgotten tenant restarts at 0 and is lifted on its return, so dropping idle ones is safe.
        if len(self._counters) <= self.max_tenants:
            return
        for name in [t for t in self._counters if t not in keep][:len(self._counters) - self.max_tenants]:
            del self._counters[name]
