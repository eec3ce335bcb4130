"""The router's bounded admission queue: requests wait here for a free upstream slot.

Ordering follows vLLM's convention for the `priority` request field: a LOWER value is MORE
urgent (0 is the default; -1 goes before it, 5 after it), and priority is strict: a more urgent
request always leaves first. Among requests of the same priority, tenants are served fairly by
virtual token counters (fairness.py): the tenant with the fewest tokens served goes next, and one
tenant's requests leave in arrival order. The queue is bounded (`max_len`): a full queue refuses
with 503; a request that waits longer than `timeout` is removed and answered 503. Both carry a
Retry-After.

The bookkeeping (enqueue / grant / cancel / expire) is synchronous and uses an injectable clock;
`wait()` is the only asyncio part, so tests can drive ordering and deadlines without sleeping.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from .admission import Clock, retry_after_seconds
from .fairness import VirtualTokenCounters


class QueueFull(Exception):
    def __init__(self, retry_after: int) -> None:
        super().__init__(f"router queue is full; retry after {retry_after}s")
        self.retry_after = retry_after


class QueueTimeout(Exception):
    def __init__(self, retry_after: int, waited: float) -> None:
        super().__init__(f"no upstream capacity within {waited:.1f}s; retry after {retry_after}s")
        self.retry_after = retry_after


@dataclass(eq=False)
class Ticket:
    """One queued request. `future` resolves (to None) when the request may proceed."""

    priority: int
    seq: int
    enqueued_at: float
    deadline: float
    future: asyncio.Future[None] | None = field(default=None, repr=False)
    state: str = "waiting"   # waiting | granted | cancelled | expired
    payload: Any = field(default=None, repr=False)   # whatever the dispatcher needs (prompt, chosen upstream)
    tenant: str = ""
    cost: int = 0            # tokens charged to the tenant's virtual counter when granted


class AdmissionQueue:
    def __init__(self, max_len: int, timeout: float, clock: Clock = time.monotonic,
                 max_tenants: int = 10_000) -> None:
        if int(max_len) != max_len or max_len < 0:
            raise ValueError(f"max_len must be an integer >= 0, got {max_len!r}")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        self.max_len = int(max_len)
        self.timeout = float(timeout)
        self._clock = clock
        # priority -> tenant -> that tenant's tickets in arrival order (cancelled ones removed lazily)
        self._lanes: dict[int, dict[str, deque[Ticket]]] = {}
        self._seq = itertools.count()
        self._live = 0   # waiting tickets
        self._per_tenant: Counter[str] = Counter()   # waiting tickets per tenant: who is active
        self.counters = VirtualTokenCounters(max_tenants)

    def __len__(self) -> int:
        return self._live

    def _tickets(self) -> list[Ticket]:
        return [t for lane in self._lanes.values() for dq in lane.values() for t in dq if t.state == "waiting"]

    def full_retry_after(self) -> int:
        """When a queue slot is certain to free up: the earliest deadline among waiting requests."""
        now = self._clock()
        deadlines = [t.deadline for t in self._tickets()]
        return retry_after_seconds(min(deadlines) - now if deadlines else 1.0)

    def enqueue(self, priority: int = 0, *, with_future: bool = False, payload: Any = None, tenant: str = "",
                cost: int = 0) -> Ticket:
        """Add a request; raises QueueFull when `max_len` requests already wait."""
        if self._live >= self.max_len:
            raise QueueFull(self.full_retry_after())
        now = self._clock()
        ticket = Ticket(int(priority), next(self._seq), now, now + self.timeout, payload=payload, tenant=tenant,
                        cost=int(cost))
        if with_future:
            ticket.future = asyncio.get_running_loop().create_future()
        if self._per_tenant[tenant] == 0:
            self.counters.activate(tenant, [t for t, n in self._per_tenant.items() if n > 0])
        self._lanes.setdefault(ticket.priority, {}).setdefault(tenant, deque()).append(ticket)
        self._per_tenant[tenant] += 1
        self._live += 1
        return ticket

    def charge(self, tenant: str, tokens: float, *, dispatched: bool = False) -> None:
        """Charge a request that went straight to a free upstream without queueing (`dispatched`), or correct
        a tenant's counter when a request ends (its real usage against the estimate it paid)."""
        self.counters.charge(tenant, tokens, dispatched=dispatched)

    def _leave(self, ticket: Ticket, state: str) -> None:
        ticket.state = state
        self._live -= 1
        self._per_tenant[ticket.tenant] -= 1
        if self._per_tenant[ticket.tenant] <= 0:
            del self._per_tenant[ticket.tenant]

    def peek(self) -> Ticket | None:
        """The next request: most urgent priority first, then the tenant with the smallest counter."""
        for priority in sorted(self._lanes):
            lane = self._lanes[priority]
            best: Ticket | None = None
            for tenant in list(lane):
                dq = lane[tenant]
                while dq and dq[0].state != "waiting":
                    dq.popleft()
                if not dq:
                    del lane[tenant]
                    continue
                head = dq[0]
                if best is None or (self.counters[tenant], head.seq) < (self.counters[best.tenant], best.seq):
                    best = head
            if best is not None:
                return best
            del self._lanes[priority]
        return None

    def grant_next(self) -> Ticket | None:
        """Let the next request proceed (call expire() first to drop overdue ones); charges its tenant."""
        ticket = self.peek()
        if ticket is not None:
            self.grant(ticket)
        return ticket

    def waiting_in_order(self) -> list[Ticket]:
        """Every waiting request in the order grant_next would take them if no counter changed."""
        return sorted(self._tickets(), key=lambda t: (t.priority, self.counters[t.tenant], t.seq))

    def grant(self, ticket: Ticket) -> None:
        """Let this waiting request proceed, at its turn or ahead of it (the router had no upstream for the
        requests before it: they ask for a model only full replicas serve); charges its tenant."""
        if ticket.state != "waiting":
            raise ValueError(f"ticket {ticket.seq} is {ticket.state}, not waiting")
        self._lanes[ticket.priority][ticket.tenant].remove(ticket)
        self._leave(ticket, "granted")
        self.counters.charge(ticket.tenant, ticket.cost)
        if ticket.future is not None and not ticket.future.done():
            ticket.future.set_result(None)

    def cancel(self, ticket: Ticket) -> bool:
        """Remove a waiting request (its client went away). False if it already left the queue."""
        if ticket.state != "waiting":
            return False
        self._leave(ticket, "cancelled")
        if ticket.future is not None and not ticket.future.done():
            ticket.future.cancel()
        return True

    def expire(self) -> list[Ticket]:
        """Remove every request whose deadline passed; their waiters get QueueTimeout."""
        now = self._clock()
        expired = [t for t in self._tickets() if t.deadline <= now]
        for ticket in expired:
            self._leave(ticket, "expired")
            if ticket.future is not None and not ticket.future.done():
                ticket.future.set_exception(QueueTimeout(retry_after_seconds(self.timeout), now - ticket.enqueued_at))
        return expired

    async def wait(self, ticket: Ticket) -> None:
        """Wait until granted; QueueTimeout after the deadline; cancellation (client gone) dequeues."""
        assert ticket.future is not None, "enqueue(..., with_future=True) for tickets that are awaited"
        remaining = ticket.deadline - self._clock()
        try:
            await asyncio.wait_for(asyncio.shield(ticket.future), timeout=max(0.0, remaining))
        except asyncio.TimeoutError:
            if ticket.state == "granted":
                return  # granted in the same instant the timer fired: proceed
            if ticket.state == "waiting":
                self._leave(ticket, "expired")
            raise QueueTimeout(retry_after_seconds(self.timeout), self._clock() - ticket.enqueued_at) from None
        except asyncio.CancelledError:
            self.cancel(ticket)
            raise
