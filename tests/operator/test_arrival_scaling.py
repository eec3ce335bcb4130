"""Scaling on the router's arrival rate: per-replica capacity measured near the KV target, scale-up on
arrival rate / capacity, the backlog only as what drains it, and the routers' gauges read by the scrape."""
from __future__ import annotations

import json

import pytest

from pagedmodel.operator import capacity
from pagedmodel.operator.autoscaler import AutoscalerState, AutoscalingPolicy, decide
from pagedmodel.operator.observation import Observation
from pagedmodel.operator.scrape import PodScrape, RouterSample, parse_router_metrics, router_totals
from test_autoscaler import INTERVAL, policy


def obs(t: float, engines: int, kv: float, waiting: int, *, finished: float = 0.0, rate: float = 0.0,
        routers: int = 1) -> Observation:
    return Observation(t, engines, kv, waiting, 8 * engines, finished=finished, arrival_rate=rate, routers=routers)


def window(n: int, engines: int, kv: float, waiting: int, rate: float, *, finished: float = 0.0,
           routers: int = 1) -> list[Observation]:
    return [obs(1000 + i * INTERVAL, engines, kv, waiting, finished=finished, rate=rate, routers=routers)
            for i in range(n)]


def test_capacity_is_measured_only_on_steady_passes_near_the_target():
    a, b = obs(0, 2, 0.78, 0), obs(15, 2, 0.82, 0, finished=150)
    # 150 finished / 15 s / 2 engines = 5 req/s at a mean usage of 0.8
    assert capacity.measure([a, b], 0.8) == pytest.approx(5.0)
    assert capacity.measure([obs(0, 2, 0.7, 0), obs(15, 2, 0.76, 0, finished=150)], 0.8) is None   # climbing
    assert capacity.measure([obs(0, 2, 0.4, 0), obs(15, 2, 0.4, 0, finished=150)], 0.8) is None    # far below
    assert capacity.measure([obs(0, 1, 0.8, 0), obs(15, 2, 0.8, 0, finished=150)], 0.8) is None    # new engine
    assert capacity.measure([a, obs(15, 2, 0.82, 0, finished=3)], 0.8) is None                     # too few
    assert capacity.measure([b], 0.8) is None
    assert capacity.smoothed(None, 5.0) == 5.0 and capacity.smoothed(4.0, None) == 4.0
    assert capacity.smoothed(4.0, 5.0) == pytest.approx(4.3)


def test_a_backlog_does_not_buy_replicas_the_arrival_rate_does_not_need():
    # 3 engines with 600 queued and 15 req/s arriving; an engine serves 5 req/s at target.
    p = policy(capacity_fallback_rps=5.0)
    w = window(4, 3, 0.8, 600, 15.0)
    on_queue = decide(p, window(4, 3, 0.8, 600, 15.0, routers=0), 3, AutoscalerState(), w[-1].time)
    on_arrivals = decide(p, w, 3, AutoscalerState(), w[-1].time)
    assert on_queue.desired == 7            # 600 waiting / 5 per replica = 120 engines' worth, doubling + 4 a step
    # 15 / 5 = 3 engines for the flow + 600 / (5 req/s * 300 s) = 0.4 to drain: 4
    assert on_arrivals.desired == 4 and on_arrivals.cause == "arrival_rate"
    assert "arrivals 15.00 req/s / 5.00 per replica" in on_arrivals.reason


def test_a_rising_arrival_rate_scales_up_before_any_queue_builds():
    p = policy(capacity_fallback_rps=5.0)
    w = window(3, 2, 0.5, 0, 10.0) + [obs(1045, 2, 0.55, 0, rate=27.0)]
    d = decide(p, w, 2, AutoscalerState(), 1045)
    assert d.desired == 6 and d.panic     # the newest rate counts: 27 / 5 = 5.4 -> 6, 2.7x on 2 engines


def test_measured_capacity_replaces_the_fallback_and_is_persisted():
    p = policy(capacity_fallback_rps=10.0)
    w = [obs(1000, 2, 0.79, 0, rate=20.0), obs(1015, 2, 0.81, 0, finished=120, rate=20.0)]
    d = decide(p, w, 2, AutoscalerState(), 1015)
    # measured 120 / 15 / 2 = 4 req/s per engine: 20 req/s needs 5 engines (the fallback would say 2)
    assert d.state.capacity_rps == pytest.approx(4.0)
    assert d.desired == 5
    restored = AutoscalerState.from_json(json.loads(json.dumps(d.state.to_json())))
    assert restored.capacity_rps == pytest.approx(4.0)
    assert AutoscalerState.from_json({"capacityRps": -1}).capacity_rps is None


def test_without_capacity_or_router_rates_the_queue_rule_applies():
    w = window(4, 3, 0.8, 600, 15.0)
    assert decide(policy(), w, 3, AutoscalerState(), w[-1].time).cause == "waiting"        # nothing to divide by
    mixed = window(3, 3, 0.8, 600, 15.0) + [obs(1045, 3, 0.8, 600, rate=15.0, routers=0)]
    assert decide(policy(capacity_fallback_rps=5.0), mixed, 3, AutoscalerState(), 1045).cause == "waiting"


def test_pods_still_starting_block_the_drain_but_not_the_flow():
    p = policy(capacity_fallback_rps=5.0)
    started = AutoscalerState(last_scale_up_time=1030.0)
    # 4 replicas asked for, 2 answer; 30 req/s need 6 whatever the starting pods will do
    w = window(4, 2, 0.8, 300, 30.0)
    d = decide(p, w, 4, started, w[-1].time)
    assert d.desired == 6
    # 18 req/s: 4 replicas serve the flow (3.6); draining 1200 waiting (+0.8) asks for 5, which waits for the pods
    w = window(4, 2, 0.8, 1200, 18.0)
    d = decide(p, w, 4, started, w[-1].time)
    assert d.desired == 4 and "until the pods asked for" in d.reason


def test_policy_reads_the_fallback_from_the_spec():
    spec = {"minReplicas": 1, "maxReplicas": 4, "targetKVCacheUsage": 0.8, "targetWaitingPerReplica": 5,
            "intervalSeconds": 15, "scaleUpStabilizationSeconds": 0, "scaleDownStabilizationSeconds": 300}
    assert AutoscalingPolicy.from_spec(spec).capacity_fallback_rps is None
    assert AutoscalingPolicy.from_spec({**spec, "requestsPerSecondPerReplica": 2.5}).capacity_fallback_rps == 2.5
    with pytest.raises(ValueError):
        AutoscalingPolicy.from_spec({**spec, "requestsPerSecondPerReplica": 0})
    assert AutoscalingPolicy.from_spec(spec).drain_horizon_s == 300


def test_router_metrics_and_totals():
    text = ("pagedmodel_router_queue_length 4.0\n"
            "pagedmodel_router_arrival_requests_per_second 2.5\n")
    assert parse_router_metrics(text) == RouterSample(4, 2.5)
    assert parse_router_metrics("pagedmodel_router_queue_length 1.0\n") == RouterSample(1, None)
    with pytest.raises(ValueError):
        parse_router_metrics("something_else 1\n")
    both = [PodScrape("r1", RouterSample(4, 2.5)), PodScrape("r2", RouterSample(1, 1.0))]
    assert router_totals(both) == (5, 3.5, 2)
    # one router silent or without the gauge: its share of arrivals is unknown, so no arrival signal
    assert router_totals([both[0], PodScrape("r2", None, "timeout")]) == (4, 0.0, 0)
    assert router_totals([both[0], PodScrape("r2", RouterSample(1, None))]) == (5, 0.0, 0)
    assert router_totals([]) == (None, 0.0, 0)
