"""Token buckets with a fixed, hand-advanced clock: no sleeping, exact counts."""
from __future__ import annotations

import pytest

from pagedmodel.server.router.admission import RateLimiter, TokenBucket, retry_after_seconds

from fakes import FakeClock


def drain(check, n: int) -> int:
    return sum(1 for _ in range(n) if check())


def test_exactly_burst_pass_at_once_then_rate():
    clock = FakeClock()
    bucket = TokenBucket(rate=5, burst=10, clock=clock)
    assert drain(lambda: bucket.try_acquire() == 0, 50) == 10
    for _ in range(4):   # then exactly `rate` per second
        clock.advance(1.0)
        assert drain(lambda: bucket.try_acquire() == 0, 50) == 5
    clock.advance(0.2)   # a fifth of a second refills exactly one token at 5/s
    assert drain(lambda: bucket.try_acquire() == 0, 50) == 1


def test_refill_is_capped_at_burst():
    clock = FakeClock()
    bucket = TokenBucket(rate=100, burst=3, clock=clock)
    drain(lambda: bucket.try_acquire() == 0, 3)
    clock.advance(3600)
    assert drain(lambda: bucket.try_acquire() == 0, 10) == 3


def test_wait_reported_is_time_to_next_token():
    clock = FakeClock()
    bucket = TokenBucket(rate=0.5, burst=1, clock=clock)
    assert bucket.try_acquire() == 0
    assert bucket.try_acquire() == pytest.approx(2.0)
    clock.advance(1.5)
    assert bucket.try_acquire() == pytest.approx(0.5)
    clock.advance(0.5)
    assert bucket.try_acquire() == 0


def test_clock_going_backwards_mints_nothing():
    clock = FakeClock()
    bucket = TokenBucket(rate=1, burst=1, clock=clock)
    assert bucket.try_acquire() == 0
    clock.advance(-100)
    assert bucket.try_acquire() > 0
    clock.advance(100.5)
    assert bucket.try_acquire() > 0   # only 0.5 s past the last observed instant


@pytest.mark.parametrize("delay, expected", [(0.001, 1), (0.5, 1), (1.0, 1), (1.01, 2), (2.0, 2), (7.3, 8)])
def test_retry_after_rounds_up_to_whole_seconds(delay, expected):
    assert retry_after_seconds(delay) == expected


def test_global_limit_retry_after():
    clock = FakeClock()
    lim = RateLimiter(rate=0.25, burst=2, clock=clock)   # one token per 4 s
    assert lim.check(None).allowed and lim.check(None).allowed
    refused = lim.check(None)
    assert (refused.allowed, refused.retry_after, refused.scope) == (False, 4, "global")
    clock.advance(3.5)
    assert lim.check(None).retry_after == 1
    clock.advance(0.5)
    assert lim.check(None).allowed


def test_per_client_buckets_are_independent():
    clock = FakeClock()
    lim = RateLimiter(client_rate=1, client_burst=2, clock=clock)
    assert [lim.check("alice").allowed for _ in range(3)] == [True, True, False]
    assert [lim.check("bob").allowed for _ in range(3)] == [True, True, False]
    assert lim.check("alice").scope == "client"
    assert lim.check(None).allowed   # no key: only the (absent) global limit applies
    clock.advance(1.0)
    assert lim.check("alice").allowed and not lim.check("alice").allowed
    assert lim.check("bob").allowed


def test_global_refusal_refunds_the_client_token():
    clock = FakeClock()
    lim = RateLimiter(rate=1, burst=1, client_rate=1, client_burst=1, clock=clock)
    assert lim.check("alice").allowed
    refused = lim.check("bob")
    assert refused.scope == "global"
    clock.advance(1.0)
    assert lim.check("bob").allowed   # bob's own bucket was not charged by the refusal


def test_client_key_from_bearer_or_header():
    lim = RateLimiter(client_rate=1)
    assert lim.client_key({"Authorization": "Bearer sk-abc"}) == "sk-abc"
    assert lim.client_key({"authorization": "bearer  sk-x "}) == "sk-x"
    assert lim.client_key({"Authorization": "Basic Zm9v"}) is None
    assert lim.client_key({}) is None
    by_header = RateLimiter(client_rate=1, client_header="X-Tenant")
    assert by_header.client_key({"x-tenant": "team-a", "Authorization": "Bearer k"}) == "team-a"
    assert by_header.client_key({"Authorization": "Bearer k"}) is None


def test_client_buckets_are_bounded_and_idle_ones_go_first():
    clock = FakeClock()
    lim = RateLimiter(client_rate=1, client_burst=1, max_clients=2, clock=clock)
    assert lim.check("a").allowed
    clock.advance(10)                        # a is full again: forgetting it loses nothing
    assert lim.check("b").allowed            # b is now empty (owes a token)
    assert lim.check("c").allowed            # third client: a (idle, full) is evicted, not b
    assert lim.tracked_clients == 2
    assert not lim.check("b").allowed        # b's debt survived the eviction


def test_disabled_limiter_allows_everything():
    lim = RateLimiter()
    assert not lim.enabled
    assert all(lim.check(k).allowed for k in [None, "a"] * 100)


@pytest.mark.parametrize("kwargs", [dict(rate=0, burst=1), dict(rate=-1, burst=1), dict(rate=1, burst=0),
                                    dict(rate=1, burst=1.5), dict(rate=float("nan"), burst=1)])
def test_bad_bucket_parameters_are_refused(kwargs):
    with pytest.raises(ValueError):
        TokenBucket(**kwargs)


def test_client_burst_without_rate_is_refused():
    with pytest.raises(ValueError, match="per-client rate"):
        RateLimiter(client_burst=3)
