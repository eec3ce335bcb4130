"""Fair queueing between tenants: virtual token counters in the router's queue, on a simulated clock.

A fake upstream of fixed capacity (`slots` requests at once, each taking its tokens / `tok_s` seconds)
is kept saturated by tenants that flood the queue; the queue decides who is served next. Deterministic:
an event list, no sleeping, no asyncio.
"""
from __future__ import annotations

import heapq

import pytest

from fakes import FakeClock
from pagedmodel.server.router.fairness import VirtualTokenCounters
from pagedmodel.server.router.queue import AdmissionQueue


def saturate(tenants: dict[str, tuple[int, int]], *, fair: bool = True, slots: int = 4, tok_s: float = 100.0,
             horizon: float = 2000.0, warmup: float = 200.0, backlog: int = 8,
             priorities: dict[str, int] | None = None, start: dict[str, float] | None = None) -> dict[str, float]:
    """Tokens served per tenant in [warmup, horizon]. tenants: name -> (tokens charged at admission, tokens
    actually used); every tenant keeps `backlog` requests waiting from its start time on."""
    clock = FakeClock(0.0)
    queue = AdmissionQueue(max_len=10_000, timeout=1e9, clock=clock)
    served = dict.fromkeys(tenants, 0.0)
    events: list[tuple[float, int, str, int]] = []   # (time, seq, tenant, tokens used) of completions
    busy = 0
    seq = 0
    begun: set[str] = set()

    def top_up() -> None:
        for name, (charged, _used) in tenants.items():
            if (start or {}).get(name, 0.0) > clock.t:
                continue
            begun.add(name)
            while sum(1 for t in queue._tickets() if t.payload == name) < backlog:
                queue.enqueue((priorities or {}).get(name, 0), payload=name,
                              tenant=name if fair else "", cost=charged)

    def dispatch() -> None:
        nonlocal busy, seq
        while busy < slots and (ticket := queue.grant_next()) is not None:
            name = ticket.payload
            used = tenants[name][1]
            busy += 1
            seq += 1
            heapq.heappush(events, (clock.t + used / tok_s, seq, name, used))

    top_up()
    dispatch()
    while events:
        t, _, name, used = heapq.heappop(events)
        if t > horizon:
            break
        clock.t = t
        busy -= 1
        if fair:
            queue.charge(name, used - tenants[name][0])    # the real usage replaces the estimate
        if t >= warmup:
            served[name] += used
        top_up()
        dispatch()
    return served


def ratio(served: dict[str, float], a: str, b: str) -> float:
    return served[a] / served[b]


def test_two_flooding_tenants_get_equal_token_throughput_whatever_their_request_sizes():
    # "small" sends 100-token requests but reserves 300 (a generous max_tokens), "big" 400-token ones:
    # request-fair or reservation-fair service would be far off; token-fair service is even.
    served = saturate({"small": (300, 100), "big": (400, 400)})
    assert abs(ratio(served, "small", "big") - 1) <= 0.10, served


def test_without_tenants_the_queue_is_fifo_and_far_from_fair():
    # The control: the same load through one shared lane (no tenant names) is served in arrival order,
    # which hands the big requests four times the tokens. The fairness test can fail.
    served = saturate({"small": (300, 100), "big": (400, 400)}, fair=False)
    assert ratio(served, "big", "small") > 2.5, served


def test_a_heavier_flood_does_not_buy_more_throughput():
    # one tenant keeps 500 requests queued, the other 2: equal shares all the same
    served = _uneven_backlog()
    assert abs(ratio(served, "flood", "steady") - 1) <= 0.10, served
    assert _uneven_backlog() == served   # deterministic


def _uneven_backlog() -> dict[str, float]:
    clock = FakeClock(0.0)
    queue = AdmissionQueue(max_len=10_000, timeout=1e9, clock=clock)
    served = {"flood": 0.0, "steady": 0.0}
    for _ in range(500):
        queue.enqueue(payload="flood", tenant="flood", cost=200)
    pending = 0
    for step in range(400):
        if pending < 2:
            queue.enqueue(payload="steady", tenant="steady", cost=200)
            pending += 1
        ticket = queue.grant_next()
        assert ticket is not None
        if ticket.tenant == "steady":
            pending -= 1
        if step >= 40:
            served[ticket.tenant] += 200
    return served


def test_priority_stays_strict_across_tenants():
    served = saturate({"urgent": (100, 100), "normal": (100, 100)}, priorities={"urgent": -1})
    assert served["normal"] == 0 and served["urgent"] > 0


def test_a_tenant_idle_for_a_while_cannot_bank_credit():
    # "late" starts after "early" has been served alone for 1000 s; lifted to early's counter, it shares
    # evenly from then on instead of being served alone until it caught up.
    served = saturate({"early": (200, 200), "late": (200, 200)}, start={"late": 1000.0}, warmup=1000.0)
    assert abs(ratio(served, "early", "late") - 1) <= 0.10, served


def test_counters_lift_newcomers_and_stay_bounded():
    c = VirtualTokenCounters(max_tenants=3)
    c.activate("a", [])
    c.charge("a", 500)
    c.activate("b", ["a"])
    assert c["b"] == 500                     # lifted to the smallest active counter
    c.charge("b", 100)
    c.activate("c", [])                      # nobody waiting: lifted to the last served (b)
    assert c["c"] == 600
    c.charge("a", -10_000, dispatched=False)   # corrections never go below zero
    assert c["a"] == 0
    c.activate("d", ["c"])
    assert len(c) <= 3 and c["d"] == 600
    with pytest.raises(ValueError):
        VirtualTokenCounters(0)
