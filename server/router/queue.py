"""The router's bounded admission queue: requests wait here for a free upstream slot.

Ordering follows vLLM's convention for the `priority` request field: a LOWER value is MORE
urgent (0 is the default; -1 goes before it, 5 after it). Within one priority requests leave in
arrival order. The queue is bounded (`max_len`): a full queue refuses with 503; a request that
waits longer than `timeout` is removed and answered 503. Both carry a Retry-After.

The bookkeeping (enqueue / grant / cancel / expire) is synchronous and uses an injectable clock;
`wait()` is the only asyncio part, so tests can drive ordering and deadlines without sleeping.
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from .admission import Clock, retry_after_seconds


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

    def sort_key(self) -> tuple[int, int]:
        return (self.priority, self.seq)


class AdmissionQueue:
    def __init__(self, max_len: int, timeout: float, clock: Clock = time.monotonic) -> None:
        if int(max_len) != max_len or max_len < 0:
            raise ValueError(f"max_len must be an integer >= 0, got {max_len!r}")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        self.max_len = int(max_len)
        self.timeout = float(timeout)
        self._clock = clock
        self._heap: list[tuple[int, int, Ticket]] = []
        self._seq = itertools.count()
        self._live = 0   # waiting tickets; the heap may still hold cancelled ones (removed lazily)

    def __len__(self) -> int:
        return self._live

    def full_retry_after(self) -> int:
        """When a queue slot is certain to free up: the earliest deadline among waiting requests."""
        now = self._clock()
        deadlines = [t.deadline for _, _, t in self._heap if t.state == "waiting"]
        return retry_after_seconds(min(deadlines) - now if deadlines else 1.0)

    def enqueue(self, priority: int = 0, *, with_future: bool = False, payload: Any = None) -> Ticket:
        """Add a request; raises QueueFull when `max_len` requests already wait."""
        if self._live >= self.max_len:
            raise QueueFull(self.full_retry_after())
        now = self._clock()
        seq = next(self._seq)
        ticket = Ticket(int(priority), seq, now, now + self.timeout, payload=payload)
        if with_future:
            ticket.future = asyncio.get_running_loop().create_future()
        heapq.heappush(self._heap, (ticket.priority, seq, ticket))
        self._live += 1
        return ticket

    def _drop_dead_head(self) -> None:
        while self._heap and self._heap[0][2].state != "waiting":
            heapq.heappop(self._heap)

    def peek(self) -> Ticket | None:
        self._drop_dead_head()
        return self._heap[0][2] if self._heap else None

    def grant_next(self) -> Ticket | None:
        """Pop the most urgent waiting request and let it proceed (call expire() first to drop overdue ones)."""
        self._drop_dead_head()
        if not self._heap:
            return None
        ticket = heapq.heappop(self._heap)[2]
        ticket.state = "granted"
        self._live -= 1
        if ticket.future is not None and not ticket.future.done():
            ticket.future.set_result(None)
        return ticket

    def cancel(self, ticket: Ticket) -> bool:
        """Remove a waiting request (its client went away). False if it already left the queue."""
        if ticket.state != "waiting":
            return False
        ticket.state = "cancelled"
        self._live -= 1
        if ticket.future is not None and not ticket.future.done():
            ticket.future.cancel()
        self._drop_dead_head()
        return True

    def expire(self) -> list[Ticket]:
        """Remove every request whose deadline passed; their waiters get QueueTimeout."""
        now = self._clock()
        expired = [t for _, _, t in self._heap if t.state == "waiting" and t.deadline <= now]
        for ticket in expired:
            ticket.state = "expired"
            self._live -= 1
            if ticket.future is not None and not ticket.future.done():
                ticket.future.set_exception(QueueTimeout(retry_after_seconds(self.timeout), now - ticket.enqueued_at))
        if expired:
            self._heap = [e for e in self._heap if e[2].state == "waiting"]
            heapq.heapify(self._heap)
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
                ticket.state = "expired"
                self._live -= 1
                self._drop_dead_head()
            raise QueueTimeout(retry_after_seconds(self.timeout), self._clock() - ticket.enqueued_at) from None
        except asyncio.CancelledError:
            self.cancel(ticket)
            raise
