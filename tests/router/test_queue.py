"""The bounded priority queue: ordering, bounds, deadlines and cancellation."""
from __future__ import annotations

import asyncio

import pytest

from pagedmodel.server.router.queue import AdmissionQueue, QueueFull, QueueTimeout
from fakes import FakeClock


def order(q: AdmissionQueue) -> list[int]:
    out = []
    while (t := q.grant_next()) is not None:
        out.append(t.seq)
    return out


def test_fifo_within_a_priority():
    q = AdmissionQueue(max_len=10, timeout=30, clock=FakeClock())
    seqs = [q.enqueue(0).seq for _ in range(5)]
    assert order(q) == seqs


def test_lower_priority_value_leaves_first():
    q = AdmissionQueue(max_len=10, timeout=30, clock=FakeClock())
    a = q.enqueue(0)
    b = q.enqueue(5)
    c = q.enqueue(-1)
    d = q.enqueue(0)
    e = q.enqueue(-1)
    assert order(q) == [c.seq, e.seq, a.seq, d.seq, b.seq]


def test_full_queue_refuses_with_retry_after_of_earliest_deadline():
    clock = FakeClock()
    q = AdmissionQueue(max_len=2, timeout=10, clock=clock)
    q.enqueue(0)
    clock.advance(4)
    q.enqueue(0)
    clock.advance(2.5)
    with pytest.raises(QueueFull) as exc:
        q.enqueue(-100)   # priority does not bypass the bound
    assert exc.value.retry_after == 4   # the first request's deadline is 3.5 s away -> 4 whole seconds
    assert len(q) == 2


def test_zero_length_queue_refuses_at_once():
    q = AdmissionQueue(max_len=0, timeout=10, clock=FakeClock())
    with pytest.raises(QueueFull) as exc:
        q.enqueue()
    assert exc.value.retry_after == 1


def test_expired_requests_are_removed_and_not_granted():
    clock = FakeClock()
    q = AdmissionQueue(max_len=5, timeout=10, clock=clock)
    old = q.enqueue(0)
    clock.advance(6)
    young = q.enqueue(0)
    clock.advance(4)   # old reaches its deadline exactly
    assert [t.seq for t in q.expire()] == [old.seq]
    assert old.state == "expired" and len(q) == 1
    assert q.grant_next() is young


def test_cancelled_request_is_removed():
    q = AdmissionQueue(max_len=3, timeout=10, clock=FakeClock())
    a, b, c = q.enqueue(), q.enqueue(), q.enqueue()
    assert q.cancel(b) and not q.cancel(b)
    assert len(q) == 2
    q.enqueue()   # the freed slot is usable
    assert order(q)[:2] == [a.seq, c.seq]


def test_cancelling_head_then_granting():
    q = AdmissionQueue(max_len=3, timeout=10, clock=FakeClock())
    a, b = q.enqueue(), q.enqueue()
    q.cancel(a)
    assert q.peek() is b and q.grant_next() is b and q.grant_next() is None


@pytest.mark.parametrize("kwargs", [dict(max_len=-1, timeout=1), dict(max_len=1.5, timeout=1),
                                    dict(max_len=1, timeout=0)])
def test_bad_parameters(kwargs):
    with pytest.raises(ValueError):
        AdmissionQueue(**kwargs)


# asyncio waiting: real event loop, real (short) timeouts with generous margins.

def test_wait_is_released_by_grant():
    async def main():
        q = AdmissionQueue(max_len=2, timeout=30)
        t = q.enqueue(0, with_future=True)
        waiter = asyncio.create_task(q.wait(t))
        await asyncio.sleep(0)
        assert not waiter.done()
        assert q.grant_next() is t
        await asyncio.wait_for(waiter, 5)
        assert t.state == "granted"
    asyncio.run(main())


def test_wait_times_out_with_503_retry_after():
    async def main():
        q = AdmissionQueue(max_len=2, timeout=0.05)
        t = q.enqueue(0, with_future=True)
        with pytest.raises(QueueTimeout) as exc:
            await asyncio.wait_for(q.wait(t), 5)
        assert exc.value.retry_after == 1 and t.state == "expired" and len(q) == 0
        assert q.grant_next() is None
    asyncio.run(main())


def test_client_disconnect_while_queued_removes_it():
    async def main():
        q = AdmissionQueue(max_len=2, timeout=30)
        t1 = q.enqueue(0, with_future=True)
        t2 = q.enqueue(0, with_future=True)
        waiter = asyncio.create_task(q.wait(t1))
        await asyncio.sleep(0)
        waiter.cancel()          # what aiohttp does to a handler whose client went away
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert t1.state == "cancelled" and len(q) == 1
        assert q.grant_next() is t2
    asyncio.run(main())
