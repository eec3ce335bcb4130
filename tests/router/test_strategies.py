"""Routing strategies over fake upstream snapshots."""
from __future__ import annotations

import collections

import pytest

from pagedmodel.server.router.strategies import (PrefixAffinity, RoundRobin, Router, UpstreamView, kv_score,
                                                 pick_kv_aware, pick_least_load)

A, B, C = "http://a:8000", "http://b:8000", "http://c:8000"


def test_kv_aware_picks_most_kv_headroom():
    ups = [UpstreamView(A, kv_usage=0.9), UpstreamView(B, kv_usage=0.2), UpstreamView(C, kv_usage=0.5)]
    assert pick_kv_aware(ups).url == B


def test_kv_aware_avoids_a_replica_with_a_waiting_queue():
    ups = [UpstreamView(A, kv_usage=0.3, waiting=20, running=64, max_inflight=64),
           UpstreamView(B, kv_usage=0.5, waiting=0, running=10, max_inflight=64)]
    assert pick_kv_aware(ups).url == B


def test_kv_aware_counts_fresh_inflight_when_scrape_lags():
    # Both scraped as empty; the router already sent 30 requests to A since the scrape.
    ups = [UpstreamView(A, kv_usage=0.0, waiting=0, running=0, inflight=30, max_inflight=64),
           UpstreamView(B, kv_usage=0.1, waiting=0, running=0, inflight=0, max_inflight=64)]
    assert pick_kv_aware(ups).url == B


def test_kv_score_does_not_double_count_our_requests():
    ours = UpstreamView(A, running=10, inflight=10, max_inflight=100)
    assert kv_score(ours) == pytest.approx(0.1)
    others = UpstreamView(A, running=40, inflight=10, max_inflight=100)  # 30 from other routers
    assert kv_score(others) == pytest.approx(0.4)


def test_kv_aware_spreads_a_burst_when_metrics_are_stale():
    # Simulates a burst between scrapes: only the router's in-flight counts change.
    inflight = {A: 0, B: 0, C: 0}
    for _ in range(30):
        ups = [UpstreamView(u, kv_usage=0.1, inflight=n) for u, n in inflight.items()]
        inflight[pick_kv_aware(ups).url] += 1
    assert sorted(inflight.values()) == [10, 10, 10]


def test_least_load_uses_inflight_then_kv():
    ups = [UpstreamView(A, inflight=3), UpstreamView(B, inflight=1, kv_usage=0.9),
           UpstreamView(C, inflight=1, kv_usage=0.1)]
    assert pick_least_load(ups).url == C


@pytest.mark.parametrize("strategy", ["kv-aware", "least-load"])
def test_idle_replicas_take_turns_at_low_traffic(strategy):
    # Each request finishes before the next arrives: every pick sees the same idle snapshot. Breaking
    # the tie by URL sent them all to A; the tie rotates instead, so every replica serves (and stays warm).
    router = Router(strategy)
    ups = [UpstreamView(u, kv_usage=0.0, waiting=0, running=0, inflight=0) for u in (C, A, B)]
    picks = collections.Counter(router.pick(ups).url for _ in range(30))
    assert picks == {A: 10, B: 10, C: 10}
    # A real difference still wins over the rotation.
    busier = [UpstreamView(A, inflight=1), UpstreamView(B), UpstreamView(C, inflight=1)]
    assert {router.pick(busier).url for _ in range(5)} == {B}


def test_round_robin_cycles():
    rr = RoundRobin()
    ups = [UpstreamView(C), UpstreamView(A), UpstreamView(B)]
    assert [rr.pick(ups).url for _ in range(6)] == [A, B, C, A, B, C]


@pytest.mark.parametrize("strategy", ["kv-aware", "least-load", "prefix", "round-robin"])
def test_no_upstream_gives_none(strategy):
    assert Router(strategy).pick([], "hi") is None


def test_unknown_strategy_is_refused():
    with pytest.raises(ValueError, match="unknown strategy 'random'"):
        Router("random")


def test_prefix_keeps_same_prefix_on_one_replica():
    pa = PrefixAffinity()
    ups = [UpstreamView(A), UpstreamView(B), UpstreamView(C)]
    system = "You are a helpful assistant. " * 20   # longer than the hashed prefix
    chosen = {pa.pick(ups, system + f"question {i}").url for i in range(50)}
    assert len(chosen) == 1


def test_prefix_spreads_different_prefixes():
    pa = PrefixAffinity()
    ups = [UpstreamView(A), UpstreamView(B), UpstreamView(C)]
    counts = collections.Counter(pa.pick(ups, f"{i} distinct document").url for i in range(300))
    assert set(counts) == {A, B, C} and min(counts.values()) > 50


def test_prefix_spills_when_load_exceeds_bound_and_returns_after():
    pa = PrefixAffinity(load_factor=1.25)
    prompt = "shared system prompt"
    home = pa.pick([UpstreamView(A), UpstreamView(B), UpstreamView(C)], prompt).url
    inflight = {A: 0, B: 0, C: 0}
    spilled = 0
    for _ in range(30):
        ups = [UpstreamView(u, inflight=n) for u, n in inflight.items()]
        url = pa.pick(ups, prompt).url
        # stays home exactly while home is under the bound ceil(1.25 * (total + 1) / 3)
        assert (url == home) == (inflight[home] < pa.bound(ups))
        spilled += url != home
        inflight[url] += 1
    assert spilled > 0 and inflight[home] == max(inflight.values())
    # when the load drains, the prefix goes home again
    assert pa.pick([UpstreamView(A), UpstreamView(B), UpstreamView(C)], prompt).url == home


def test_prefix_mapping_is_mostly_stable_when_a_replica_leaves():
    pa = PrefixAffinity()
    three = [UpstreamView(A), UpstreamView(B), UpstreamView(C)]
    two = [UpstreamView(A), UpstreamView(B)]
    keys = [f"doc-{i}" for i in range(300)]
    before = {k: pa.pick(three, k).url for k in keys}
    after = {k: pa.pick(two, k).url for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(before[k] == C for k in moved)   # only C's keys move


def test_prefix_bound():
    pa = PrefixAffinity(load_factor=1.5)
    ups = [UpstreamView(A, inflight=4), UpstreamView(B, inflight=1)]
    assert pa.bound(ups) == 5   # ceil(1.5 * 6 / 2)
    with pytest.raises(ValueError):
        PrefixAffinity(load_factor=0.9)
