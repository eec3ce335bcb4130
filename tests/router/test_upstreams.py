"""Upstream pool bookkeeping: ejection with backoff, re-probe, draining, scraping."""
from __future__ import annotations

import pytest

from pagedmodel.server.router.upstreams import UpstreamPool, normalise_url

from fakes import FakeClock

METRICS = """# HELP vllm:kv_cache_usage_perc x
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="m"} 0.42
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 3.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 7.0
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{model_name="m"} 100.0
"""


@pytest.mark.parametrize("raw, url", [("10.0.0.1:8000", "http://10.0.0.1:8000"),
                                      ("http://a:8000/", "http://a:8000"),
                                      ("http://a:8000/v1", "http://a:8000"),
                                      ("https://a", "https://a")])
def test_normalise_url(raw, url):
    assert normalise_url(raw) == url


@pytest.mark.parametrize("raw", ["ftp://a", "http://", "http://a:8000/other"])
def test_bad_urls_are_refused(raw):
    with pytest.raises(ValueError, match="bad upstream URL"):
        normalise_url(raw)


def test_ejection_after_consecutive_failures_then_backoff_and_probe():
    clock = FakeClock()
    pool = UpstreamPool(["a:1", "b:1"], consecutive_failures_to_eject=2, base_backoff=1.0, max_backoff=4.0,
                        clock=clock)
    a = pool.upstreams["http://a:1"]
    assert not pool.record_failure(a)
    pool.record_success(a)            # a success in between resets the streak
    assert not pool.record_failure(a)
    assert pool.record_failure(a)
    assert [u.url for u in pool.available()] == ["http://b:1"]
    assert pool.due_for_probe() == []
    clock.advance(1.0)
    assert pool.due_for_probe() == [a]
    pool.probe_result(a, ok=False)    # still down: backoff doubles
    assert a.ejected_until == pytest.approx(clock.t + 2.0)
    clock.advance(2.0)
    pool.probe_result(a, ok=False)
    clock.advance(4.0)
    pool.probe_result(a, ok=False)
    assert a.ejected_until == pytest.approx(clock.t + 4.0)   # capped at max_backoff
    clock.advance(4.0)
    pool.probe_result(a, ok=True)
    assert not a.ejected and a in pool.available() and a.consecutive_failures == 0


def test_inflight_cap_hides_a_full_upstream():
    pool = UpstreamPool(["a:1"], max_inflight=2)
    a = pool.upstreams["http://a:1"]
    pool.acquire(a)
    pool.acquire(a)
    assert pool.available() == [] and pool.any_ready()
    pool.release(a)
    assert pool.available() == [a]


def test_removed_upstream_drains_then_disappears():
    pool = UpstreamPool(["a:1", "b:1"])
    a = pool.upstreams["http://a:1"]
    pool.acquire(a)
    pool.set_urls(["b:1"])
    assert a.draining and a not in pool.available() and "http://a:1" in pool.upstreams
    pool.release(a)
    assert "http://a:1" not in pool.upstreams
    pool.set_urls(["b:1", "c:1"])
    assert sorted(pool.upstreams) == ["http://b:1", "http://c:1"]


def test_scrape_parsing_and_staleness():
    clock = FakeClock()
    pool = UpstreamPool(["a:1"], stale_after=5, clock=clock)
    a = pool.upstreams["http://a:1"]
    pool.apply_scrape(a, METRICS)
    assert (a.kv_usage, a.waiting, a.running) == (0.42, 3.0, 7.0)
    clock.advance(5.1)
    pool.expire_stale()
    assert (a.kv_usage, a.waiting, a.running) == (None, None, None)


def test_inflight_cap_follows_the_engines_max_num_seqs_unless_pinned():
    pool = UpstreamPool(["a:1"])
    a = pool.upstreams["http://a:1"]
    assert a.max_inflight is None
    pool.apply_scrape(a, METRICS + 'pagedmodel:max_num_seqs{model_name="m"} 4.0\n')
    assert a.max_inflight == 4
    pinned = UpstreamPool(["a:1"], max_inflight=2)
    b = pinned.upstreams["http://a:1"]
    pinned.apply_scrape(b, METRICS + 'pagedmodel:max_num_seqs{model_name="m"} 4.0\n')
    assert b.max_inflight == 2
