"""The autoscaler policy on synthetic traces, fed back pass by pass as the operator does."""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field, replace
from typing import Callable

import pytest

from pagedmodel.operator import autoscaler as autoscaler_mod
from pagedmodel.operator.autoscaler import AutoscalerState, AutoscalingPolicy, ScaleDecision, decide, trim
from pagedmodel.operator.observation import Observation
from pagedmodel.operator.spec import DEFAULTS

INTERVAL = 15.0


def policy(**kw) -> AutoscalingPolicy:
    base = dict(min_replicas=1, max_replicas=10, target_kv_cache_usage=0.8, target_waiting_per_replica=5,
                interval_s=INTERVAL, scale_up_stabilization_s=0, scale_down_stabilization_s=300)
    base.update(kw)
    return AutoscalingPolicy(**base)


@dataclass
class Trace:
    """Runs decide() every interval against a load given as (total kv demand, total waiting) at time t.

    Total kv demand is the KV usage summed over engines the load would cause (2.4 = three engines at
    0.8); each answering engine reports min(1, demand / engines). New replicas answer after
    `startup` seconds, as pods that load a model do.
    """

    policy: AutoscalingPolicy
    load: Callable[[float], tuple[float, int]]
    current: int = 1
    startup: float = 0.0
    running: int = 10
    state: AutoscalerState = field(default_factory=AutoscalerState)
    window: list[Observation] = field(default_factory=list)
    ready_at: list[float] = field(default_factory=list)
    decisions: list[tuple[float, ScaleDecision]] = field(default_factory=list)
    events: list[tuple[float, int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.ready_at = [-math.inf] * self.current

    def step(self, t: float, *, stale: bool = False) -> ScaleDecision:
        engines = sum(1 for r in self.ready_at if r <= t)
        kv_total, waiting = self.load(t)
        if engines:
            obs = Observation(t, engines, min(1.0, kv_total / engines), waiting if engines else 0,
                              self.running if kv_total > 0 or waiting else 0,
                              finished=1.0 if kv_total > 0 or waiting else 0.0)
        else:
            obs = Observation(t, 0, 0.0, 0, 0)
        self.window = trim([*self.window, obs], self.policy, t)
        d = decide(self.policy, self.window, self.current, self.state, t, stale=stale)
        # The operator persists the state as JSON in status: go through it every pass.
        self.state = AutoscalerState.from_json(json.loads(json.dumps(d.state.to_json())))
        if d.desired != self.current:
            self.events.append((t, self.current, d.desired))
            if d.desired > self.current:
                self.ready_at += [t + self.startup] * (d.desired - self.current)
            else:
                self.ready_at = sorted(self.ready_at)[: d.desired]
            self.current = d.desired
        self.decisions.append((t, d))
        return d

    def run(self, start: float, end: float) -> "Trace":
        t = start
        while t < end:
            self.step(t)
            t += self.policy.interval_s
        return self


def flat(kv_total: float, waiting: int = 0) -> Callable[[float], tuple[float, int]]:
    return lambda t: (kv_total, waiting)


# ---------------------------------------------------------------- the rule on traces

def test_step_up_reaches_the_demand_within_the_stable_window_and_stays():
    # 2 engines at 0.7 (in target), then the load jumps to what 5 engines at 0.8 would carry.
    tr = Trace(policy(), lambda t: (1.4, 0) if t < 300 else (4.0, 0), current=2)
    tr.run(0, 300)
    assert tr.events == []
    tr.run(300, 1200)
    first_up = tr.events[0][0]
    assert first_up - 300 <= 4 * INTERVAL          # within the 60 s averaging window
    assert tr.current == 5                         # ceil(4.0 / 0.8), no overshoot
    assert all(new > old for _, old, new in tr.events)
    last = tr.decisions[-1][1]
    assert "kv cache usage" in last.reason and "target 0.80" in last.reason


def test_ramp_scales_up_monotonically_and_tracks_demand():
    # Demand grows from 1 to 8 engines' worth over 30 minutes.
    tr = Trace(policy(), lambda t: (0.8 * (1 + 7 * min(t, 1800) / 1800), 0), current=1, startup=30)
    tr.run(0, 2400)
    assert tr.events, "a ramp to 8x must scale"
    assert all(new > old for _, old, new in tr.events), tr.events   # never down during a ramp
    assert tr.current in (8, 9)
    assert len(tr.events) <= 12                   # steps, not a change every pass


def test_burst_panics_scales_within_one_interval_and_never_down_while_panicking():
    p = policy(max_replicas=20)
    burst = lambda t: (1.4, 60) if 600 <= t < 660 else (1.4, 0)   # 60 waiting on 2 engines for a minute
    tr = Trace(p, burst, current=2)
    tr.run(0, 600)
    assert tr.events == []
    d = tr.step(600)
    # The panic window (newest 2 scrapes) averages 0 and 60 waiting: 30 / 5 per replica = 6, at once.
    assert d.panic and tr.current == 6
    assert "panic: newest 2 scrapes at 3.00x target" in d.reason and "2 -> 6" in d.reason
    d = tr.step(615)          # the new engines answer: their effect on the queue shows next scrape
    assert tr.current == 6 and "just answered" in d.reason
    tr.step(630)
    assert tr.current == 12
    tr.run(615, 660 + p.panic_hold)
    # The burst is gone at 660, but while panicking nothing scales down.
    assert all(new >= old for _, old, new in tr.events)
    panic_times = [t for t, d in tr.decisions if d.panic]
    assert max(panic_times) < 660 + p.panic_hold
    tr.run(660 + p.panic_hold, 2000)
    assert tr.current == 2                         # back to the base load after the down window
    downs = [t for t, old, new in tr.events if new < old]
    assert min(downs) >= 660 + p.scale_down_stabilization_s - INTERVAL


def test_burst_below_the_panic_threshold_waits_for_the_average():
    tr = Trace(policy(), lambda t: (1.6, 15) if t >= 300 else (1.6, 0), current=2)   # 1.5x, no panic
    tr.run(0, 300)
    d = tr.step(300)
    assert not d.panic and tr.current == 2
    tr.run(315, 400)
    assert tr.current == 3


def test_oscillating_load_has_a_bounded_number_of_scale_events():
    # Square wave between 2 and 5 engines' worth, period 4 minutes, for 2 hours.
    wave = lambda t: (4.0, 0) if (t // 120) % 2 else (1.6, 0)
    tr = Trace(policy(), wave, current=2, startup=30)
    tr.run(0, 7200)
    assert 1 <= len(tr.events) <= 3, tr.events     # up to the peak once, then held by the down window


def test_slow_oscillation_follows_the_load_without_flapping():
    # Period 40 minutes: long enough for the down window to pass at each trough. With no queue,
    # saturated KV shows at most 1/0.8 of the engines' load, so a rise takes a few steps.
    wave = lambda t: (4.0, 0) if (t // 1200) % 2 else (1.6, 0)
    tr = Trace(policy(), wave, current=2)
    tr.run(0, 4 * 2400)
    phases: dict[int, list[int]] = {}
    for t, old, new in tr.events:
        phases.setdefault(int(t // 1200), []).append(new - old)
    assert len(phases) == 7                          # every phase after the first moved
    for phase, moves in phases.items():
        high = phase % 2 == 1
        assert all((m > 0) == high for m in moves), (phase, moves)   # never against the load
        assert len(moves) <= 3, (phase, moves)
    assert tr.current == 5


def test_steady_noisy_load_causes_zero_scale_events_over_hours():
    rng = random.Random(7)
    noise = {}

    def load(t: float) -> tuple[float, int]:
        noise.setdefault(t, rng.uniform(-0.06, 0.06))
        return 3 * 0.8 * (1 + noise[t]), rng.choice([0, 1, 2])
    tr = Trace(policy(), load, current=3)
    tr.run(0, 4 * 3600)
    assert tr.events == []
    assert all(not d.frozen for _, d in tr.decisions)


# ---------------------------------------------------------------- freezing

def test_stale_metrics_freeze_the_decision_and_keep_the_state():
    tr = Trace(policy(), flat(4.0, 40), current=2)
    tr.run(0, 60)
    before = tr.state
    d = decide(tr.policy, tr.window, tr.current, tr.state, 60.0, stale=True)
    assert d.frozen and d.desired == tr.current and not d.limited
    assert "stale" in d.reason
    assert d.state.recommendations == before.recommendations


def test_no_metrics_or_no_engine_answering_or_old_metrics_freeze():
    p = policy()
    d = decide(p, [], 3, AutoscalerState(), 100.0)
    assert d.frozen and d.desired == 3 and "no metrics" in d.reason
    d = decide(p, [Observation(95.0, 0, 0.0, 0, 0)], 3, AutoscalerState(), 100.0)
    assert d.frozen and d.desired == 3 and "no engine answered" in d.reason
    d = decide(p, [Observation(60.0, 3, 1.0, 90, 30)], 3, AutoscalerState(), 100.0)
    assert d.frozen and d.desired == 3 and "40 s old" in d.reason
    # Observations from the future (clock skew) are not used either.
    d = decide(p, [Observation(130.0, 3, 1.0, 90, 30)], 3, AutoscalerState(), 100.0)
    assert d.frozen


# ---------------------------------------------------------------- bounds

def test_max_clamp_binds_and_says_so():
    tr = Trace(policy(max_replicas=4), flat(8.0, 100), current=2)
    d = tr.step(0)
    assert tr.current == 4 and d.limited == "maxReplicas 4 reached; load asks for 20"
    tr.step(15)
    d = tr.step(30)
    assert tr.current == 4 and d.desired == 4 and d.limited == "maxReplicas 4 reached; load asks for 20"


def test_min_clamp_binds_and_says_so():
    tr = Trace(policy(min_replicas=3, scale_down_stabilization_s=0), flat(0.5), current=3)
    d = tr.step(0)
    assert tr.current == 3 and d.limited == "minReplicas 3 holds; load asks for 1"


def test_bounds_apply_even_without_metrics():
    p = policy(min_replicas=2, max_replicas=4)
    d = decide(p, [], 6, AutoscalerState(), 10.0, stale=True)
    assert d.desired == 4 and not d.frozen and "maxReplicas 4" in d.reason and d.state.last_scale_time == 10.0
    d = decide(p, [], 0, AutoscalerState(), 10.0)
    assert d.desired == 2 and "minReplicas 2" in d.reason


def test_scale_down_at_most_halves_per_step():
    tr = Trace(policy(scale_down_stabilization_s=0), flat(0.4), current=8)
    tr.run(0, 300)
    steps = [(old, new) for _, old, new in tr.events]
    assert steps == [(8, 4), (4, 2), (2, 1)]
    assert "at most halving" in tr.decisions[0][1].reason
    # Each step is measured for a stable window before the next.
    times = [t for t, _, _ in tr.events]
    assert all(b - a >= tr.policy.stable_window for a, b in zip(times, times[1:]))
    assert any("measuring the last scale" in d.reason for _, d in tr.decisions)


# ---------------------------------------------------------------- stabilization

def test_scale_down_waits_for_the_whole_down_window_of_lower_recommendations():
    p = policy(scale_down_stabilization_s=300)
    tr = Trace(p, lambda t: (4.0, 0) if t < 600 else (1.6, 0), current=5)
    tr.run(0, 600)
    assert tr.events == []
    tr.run(600, 1200)
    # The averaging window's transition left a recommendation of 4 behind the drop; then 3, which
    # leaves the engines at 0.53 of... 1.6 / 3 = 0.53 KV: 2 engines would sit right at the target,
    # and a scale-down only goes as far as the bottom of the band (0.9 x target).
    assert [(o, n) for _, o, n in tr.events] == [(5, 4), (4, 3)]
    t = tr.events[0][0]
    assert 600 + 300 - INTERVAL <= t <= 600 + 300 + 4 * INTERVAL
    assert tr.events[1][0] - t >= tr.policy.stable_window
    held = [d.reason for tt, d in tr.decisions if 700 < tt < t]
    assert held and all("holds the scale-down" in r for r in held)


def test_a_single_high_recommendation_restarts_the_down_window():
    p = policy(scale_down_stabilization_s=300)
    tr = Trace(p, lambda t: (4.0, 0) if t < 600 or 840 <= t < 900 else (1.6, 0), current=5)
    tr.run(0, 1400)
    t = tr.events[0][0]
    assert t >= 900 + 300 - INTERVAL


def test_fresh_start_does_not_scale_down_before_a_full_window_of_history():
    tr = Trace(policy(scale_down_stabilization_s=300), flat(1.6), current=5)
    tr.run(0, 300)
    assert tr.events == []
    assert "of the 300 s scale-down window" in tr.decisions[-1][1].reason
    tr.run(300, 400)
    assert tr.events and tr.events[0][2] == 3


def test_scale_up_stabilization_ignores_a_short_rise():
    p = policy(scale_up_stabilization_s=120)
    tr = Trace(p, lambda t: (3.2, 0) if 300 <= t < 390 else (1.6, 0), current=2)
    tr.run(0, 600)
    assert tr.events == []
    assert any("waits for scaleUpStabilizationSeconds" in d.reason for _, d in tr.decisions)
    tr2 = Trace(p, lambda t: (3.2, 0) if t >= 300 else (1.6, 0), current=2)
    tr2.run(0, 700)
    assert tr2.events and tr2.events[0][0] >= 300 + 120


def test_no_scale_down_while_new_engines_are_starting():
    p = policy(scale_down_stabilization_s=0)
    tr = Trace(p, lambda t: (1.6, 25) if t < 60 else (0.8, 0), current=2, startup=600)
    tr.run(0, 400)
    assert [(o, n) for _, o, n in tr.events] == [(2, 5)]
    assert "no scale-down while a scale-up is still starting" in tr.decisions[-1][1].reason
    tr.run(400, 800)    # once the pods answer, the low load scales down
    assert tr.current < 5


def test_starting_engines_count_as_capacity_so_load_on_the_old_ones_does_not_cascade():
    # 25 waiting asks for 5; the 3 new pods take 5 minutes to start. The 2 answering engines stay
    # loaded meanwhile, but demand in engine units is unchanged, so it does not ask for more.
    tr = Trace(policy(), flat(1.6, 25), current=2, startup=300)
    tr.run(0, 300)
    assert [(o, n) for _, o, n in tr.events] == [(2, 5)]
    assert len(tr.decisions) == 20 and all(d.desired == 5 for _, d in tr.decisions[1:])


def test_a_queue_growing_while_pods_start_does_not_cascade_until_the_grace_expires():
    # The queue keeps growing (nothing serves it faster until the new pods answer); they never do.
    p = policy(max_replicas=40, pending_grace_s=300)
    tr = Trace(p, lambda t: (1.6, int(12 + t / 5)), current=2, startup=10_000)
    tr.run(0, 300)
    assert [(o, n) for _, o, n in tr.events] == [(2, 3)]
    assert "no further scale-up" in tr.decisions[-1][1].reason
    tr.run(300, 400)         # 300 s after the scale-up the pods count as failed, not starting
    assert tr.current > 3


def test_a_draining_queue_asks_for_nothing():
    p = policy()
    base = [Observation(t, 4, 0.6, w, 60, finished=5.0) for t, w in ((0.0, 80), (15.0, 60), (30.0, 40))]
    d = decide(p, base + [Observation(45.0, 4, 0.6, 15, 60, finished=5.0)], 4, AutoscalerState(), 45.0)
    assert d.desired == 4 and "queue draining (40 -> 15 waiting, empty in ~9 s): not counted" in d.reason
    slow = base + [Observation(45.0, 4, 0.6, 38, 60, finished=5.0)]     # 2 per 15 s: minutes to drain
    assert decide(p, slow, 4, AutoscalerState(), 45.0).desired > 4


def test_scale_down_leaves_the_engines_at_the_bottom_of_the_band():
    p = policy(scale_down_stabilization_s=0)
    # 2.0 of KV over 4 engines: 2.5 engines at target, but 3 are needed to stay <= 0.9 x target.
    d = decide(p, [Observation(0.0, 4, 0.5, 0, 40, finished=1.0)], 4, AutoscalerState(), 0.0)
    assert d.desired == 3
    d = decide(p, [Observation(0.0, 4, 0.36, 0, 40, finished=1.0)], 4, AutoscalerState(), 0.0)
    assert d.desired == 2       # 1.44 / 0.8 = 1.8 engines, / 0.9 = 2


def test_zero_waiting_target_turns_the_queue_signal_off():
    tr = Trace(policy(target_waiting_per_replica=0), flat(1.6, 500), current=2)
    d = tr.step(0)
    assert tr.current == 2 and not d.panic and "queue signal off" in d.reason


# ---------------------------------------------------------------- zero

def test_scale_to_zero_only_after_a_whole_idle_window():
    p = policy(min_replicas=0, scale_down_stabilization_s=300)
    tr = Trace(p, lambda t: (0.4, 0) if t < 300 else (0.0, 0), current=2)
    tr.run(0, 1200)
    assert [(o, n) for _, o, n in tr.events] == [(2, 1), (1, 0)]
    zero_at = tr.events[-1][0]
    assert zero_at >= 300 + 300 - INTERVAL
    d = tr.decisions[-1][1]
    assert d.frozen and d.desired == 0 and "no request queued at the router" in d.reason


def test_requests_queued_at_the_router_bring_a_scaled_to_zero_model_back():
    p = policy(min_replicas=0, max_replicas=4)
    idle = Observation(100.0, 0, 0.0, 0, 0)
    assert decide(p, [idle], 0, AutoscalerState(), 100.0).desired == 0
    queued = Observation(115.0, 0, 0.0, 3, 0)
    d = decide(p, [idle, queued], 0, AutoscalerState(), 115.0)
    assert (d.desired, d.frozen) == (1, False) and "3 requests queued at the router" in d.reason
    assert d.state.last_scale_up_time == 115.0
    # an old queue reading (the router stopped answering) is no reason to start an engine
    assert decide(p, [queued], 0, AutoscalerState(), 115.0 + 3 * p.interval_s).desired == 0
    # with minReplicas above 0 the bound alone brings it up, queue or not
    assert decide(policy(min_replicas=2), [idle], 0, AutoscalerState(), 100.0).desired == 2


def test_light_load_never_scales_to_zero():
    tr = Trace(policy(min_replicas=0, scale_down_stabilization_s=60), flat(0.01), current=1)
    tr.run(0, 1800)
    assert tr.events == [] and tr.current == 1


# ---------------------------------------------------------------- state and restarts

def test_state_json_round_trip_and_tolerance():
    s = AutoscalerState(((10.0, 3), (25.0, 2)), panic_until=70.5, last_scale_time=10.0, history_since=0.0)
    assert AutoscalerState.from_json(json.loads(json.dumps(s.to_json()))) == s
    assert AutoscalerState.from_json(None) == AutoscalerState()
    assert AutoscalerState.from_json("garbage") == AutoscalerState()   # type: ignore[arg-type]
    messy = {"recommendations": [[1, 2], ["x", 3], [2, -1], [3, True], "no", [4.0, 5]], "panicUntil": "soon",
             "lastScaleTime": float("nan")}
    assert AutoscalerState.from_json(messy) == AutoscalerState(((1.0, 2), (4.0, 5)))


def test_restart_with_persisted_state_does_not_scale_twice():
    tr = Trace(policy(), lambda t: (1.6, 0) if t < 300 else (4.0, 40), current=2, startup=120)
    tr.run(0, 360)
    assert tr.events
    replicas, state = tr.current, tr.state
    # A restarted operator re-runs the same pass (same now, same window) with the persisted state.
    last_t = tr.decisions[-1][0]
    d = decide(tr.policy, tr.window, replicas, AutoscalerState.from_json(state.to_json()), last_t)
    assert d.desired == replicas
    # ... and the next passes continue as if nothing happened.
    again = decide(tr.policy, tr.window, replicas, state, last_t)
    assert again == d


def test_restart_keeps_the_scale_down_clock_running():
    p = policy(scale_down_stabilization_s=300)
    tr = Trace(p, lambda t: (4.0, 0) if t < 600 else (1.6, 0), current=5)
    tr.run(0, 800)
    persisted = json.dumps(tr.state.to_json())
    tr.state = AutoscalerState.from_json(json.loads(persisted))    # the operator restarts at 800
    tr.run(800, 1000)
    t = tr.events[0][0]
    assert t <= 600 + 300 + 4 * INTERVAL            # not 800 + 300


def test_a_gap_in_passes_restarts_the_down_window():
    p = policy(scale_down_stabilization_s=300)
    tr = Trace(p, lambda t: (4.0, 0) if t < 300 else (1.6, 0), current=5)
    tr.run(0, 450)
    tr.run(1000, 1300)                               # the operator was down from 450 to 1000
    assert tr.events == []
    tr.run(1300, 1400)
    assert tr.events and tr.events[0][0] >= 1000 + 300 - INTERVAL


def test_a_few_late_passes_do_not_restart_the_down_window():
    p = policy(scale_down_stabilization_s=300)
    tr = Trace(p, lambda t: (4.0, 0) if t < 300 else (1.6, 0), current=5)
    tr.run(0, 450)                                   # last pass at 435
    tr.run(485, 900)                                 # the next 50 s later: within the stable window
    assert tr.events and tr.events[0][0] < 300 + 300 + 4 * INTERVAL


def test_panic_survives_a_restart():
    p = policy(max_replicas=20, scale_down_stabilization_s=0)
    tr = Trace(p, lambda t: (0.8, 60) if t == 300 else (0.4, 0), current=1)
    tr.run(0, 315)
    assert tr.current == 5 and "at most x2 or +4 per step (load asks for 6)" in tr.decisions[-1][1].reason
    state = AutoscalerState.from_json(json.loads(json.dumps(tr.state.to_json())))
    assert state.panic_until == 300 + p.panic_hold
    window = tr.window + [Observation(t, 5, 0.1, 0, 5, finished=1.0) for t in (315.0, 330.0, 345.0)]
    d = decide(p, window, 5, state, 345.0)
    assert d.panic and d.desired == 5
    forgotten = decide(p, window, 5, replace(state, panic_until=None, last_scale_time=None), 345.0)
    assert not forgotten.panic and forgotten.desired < 5      # without the persisted panic it would shrink


def test_compaction_keeps_state_small_and_changes_no_decision(monkeypatch):
    rng = random.Random(3)
    levels = {}

    def load(t: float) -> tuple[float, int]:
        levels.setdefault(t // 600, rng.uniform(0.5, 6.0))
        return levels[t // 600] * rng.uniform(0.9, 1.1), rng.choice([0, 0, 3, 12])
    p = policy(interval_s=5.0, scale_up_stabilization_s=30, scale_down_stabilization_s=900)
    compacted = Trace(p, load, current=2, startup=20).run(0, 12000)
    sizes = [len(d.state.recommendations) for _, d in compacted.decisions]
    assert max(sizes) <= 2 * (p.max_replicas + 2)
    levels.clear()
    rng.seed(3)
    monkeypatch.setattr(autoscaler_mod, "_compact", lambda recs, now, policy: tuple(sorted(recs)))
    full = Trace(p, load, current=2, startup=20).run(0, 12000)
    assert max(len(d.state.recommendations) for _, d in full.decisions) > 100
    assert full.events == compacted.events and len(full.events) >= 4


def test_decide_is_deterministic():
    tr = Trace(policy(), lambda t: (2.0 + math.sin(t / 300), int(5 + 5 * math.cos(t / 200))), current=3)
    tr.run(0, 1800)
    tr2 = Trace(policy(), lambda t: (2.0 + math.sin(t / 300), int(5 + 5 * math.cos(t / 200))), current=3)
    tr2.run(0, 1800)
    assert [d for _, d in tr.decisions] == [d for _, d in tr2.decisions]


# ---------------------------------------------------------------- spec and inputs

def test_policy_from_the_defaulted_spec():
    p = AutoscalingPolicy.from_spec(DEFAULTS["autoscaling"])
    assert (p.min_replicas, p.max_replicas, p.target_kv_cache_usage, p.target_waiting_per_replica) == (1, 4, 0.8, 5)
    assert (p.interval_s, p.scale_up_stabilization_s, p.scale_down_stabilization_s) == (15, 0, 300)
    assert p.stable_window == 60 and p.panic_hold == 60 and p.window_s() == 75
    assert AutoscalingPolicy.from_spec({**DEFAULTS["autoscaling"], "intervalSeconds": 30}).stable_window == 90
    short = AutoscalingPolicy.from_spec({**DEFAULTS["autoscaling"], "stableWindowSeconds": 20, "intervalSeconds": 5})
    assert short.stable_window == 20 and short.panic_hold == 20 and short.window_s() == 25
    assert AutoscalingPolicy.from_spec(DEFAULTS["autoscaling"], startup_timeout_s=120).pending_grace_s == 120


@pytest.mark.parametrize("change, message", [
    ({"minReplicas": 5, "maxReplicas": 2}, "must not exceed"),
    ({"targetKVCacheUsage": 0}, "target_kv_cache_usage"),
    ({"targetKVCacheUsage": 1.5}, "target_kv_cache_usage"),
    ({"targetWaitingPerReplica": -1}, "target_waiting_per_replica"),
    ({"intervalSeconds": 0}, "interval_s"),
    ({"maxReplicas": 0}, "max_replicas"),
    ({"minReplicas": True}, "min_replicas"),
    ({"scaleDownStabilizationSeconds": float("inf")}, "scale_down_stabilization_s"),
    ({"stableWindowSeconds": 0}, "stable_window_s"),
])
def test_bad_specs_are_rejected_with_the_field(change, message):
    with pytest.raises(ValueError, match=message):
        AutoscalingPolicy.from_spec({**DEFAULTS["autoscaling"], **change})


def test_spec_missing_fields_or_not_an_object():
    with pytest.raises(ValueError, match="lacks intervalSeconds"):
        AutoscalingPolicy.from_spec({k: v for k, v in DEFAULTS["autoscaling"].items() if k != "intervalSeconds"})
    with pytest.raises(ValueError, match="must be an object"):
        AutoscalingPolicy.from_spec([])  # type: ignore[arg-type]


def test_bad_decide_arguments():
    with pytest.raises(ValueError, match="current replicas"):
        decide(policy(), [], -1, AutoscalerState(), 0.0)
    with pytest.raises(ValueError, match="now"):
        decide(policy(), [], 1, AutoscalerState(), float("nan"))


def test_trim_keeps_the_needed_window_sorted():
    p = policy()
    obs = [Observation(t, 1, 0.5, 0, 1) for t in (100.0, 0.0, 50.0, 90.0)]
    assert [o.time for o in trim(obs, p, 100.0)] == [50.0, 90.0, 100.0]


# ---------------------------------------------------------------- observations

def test_observation_json_round_trip_is_compact():
    o = Observation(1700000000.25, 3, 0.8125, 4, 12, max_num_seqs=256, block_size=16, preemptions=2.0)
    raw = o.to_json()
    assert raw == [1700000000.25, 3, 0.8125, 4, 12, 256, 16, 2.0]
    assert Observation.from_json(json.loads(json.dumps(raw))) == o
    assert Observation.from_json({"time": 1.0, "engines": 1, "kv_cache_usage": 0.5, "waiting": 0,
                                  "running": 2}) == Observation(1.0, 1, 0.5, 0, 2)
    # No engine answering, requests queued at the router: a valid observation (what scale-from-zero reads).
    router_only = Observation.from_json([5.0, 0, 0.0, 12, 0])
    assert router_only.waiting == 12 and router_only.engines == 0


@pytest.mark.parametrize("raw", [
    None, "x", [], [1, 2, 3], [1.0, 1, 1.5, 0, 0], [1.0, -1, 0.5, 0, 0], [1.0, 1, 0.5, 0.5, 0],
    [1.0, 1, float("nan"), 0, 0], [1.0, True, 0.5, 0, 0], [1.0, 0, 0.0, 0, 3], list(range(13)),
    {"time": 1.0}, {"time": 1.0, "engines": 1, "kv_cache_usage": 0.5, "waiting": 0, "running": 0, "x": 1},
    [1.0, 1, 0.5, 0, 0, 0, 0, -2.0],
])
def test_garbage_observations_raise_value_error(raw):
    with pytest.raises(ValueError):
        Observation.from_json(raw)


# ---------------------------------------------------------------- invariants on arbitrary inputs

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

observations = st.builds(
    lambda t, engines, kv, waiting, running, finished: Observation(
        t, engines, kv if engines else 0.0, waiting, running if engines else 0, finished=finished),
    st.floats(0, 600), st.integers(0, 12), st.floats(0, 1), st.integers(0, 400), st.integers(0, 400),
    st.sampled_from([0.0, 1.0, 10.0]))
states = st.builds(
    AutoscalerState,
    st.lists(st.tuples(st.floats(0, 600), st.integers(0, 30)), max_size=8).map(lambda l: tuple(sorted(set(l)))),
    st.one_of(st.none(), st.floats(0, 900)), st.one_of(st.none(), st.floats(0, 600)),
    st.one_of(st.none(), st.floats(0, 600)), st.one_of(st.none(), st.floats(0, 600)))
policies = st.builds(
    lambda lo, span, up, down, tw: policy(min_replicas=lo, max_replicas=max(1, lo + span), scale_up_stabilization_s=up,
                                          scale_down_stabilization_s=down, target_waiting_per_replica=tw),
    st.integers(0, 3), st.integers(0, 12), st.sampled_from([0, 30, 120]), st.sampled_from([0, 60, 300]),
    st.sampled_from([0, 5]))


@settings(max_examples=400, deadline=None)
@given(policies, st.lists(observations, max_size=10), st.integers(0, 20), states, st.floats(0, 600),
       st.booleans())
def test_decision_invariants(p, window, current, state, now, stale):
    d = decide(p, window, current, state, now, stale=stale)
    assert p.min_replicas <= d.desired <= p.max_replicas                 # the bounds always hold
    assert d == decide(p, window, current, state, now, stale=stale)      # deterministic
    assert AutoscalerState.from_json(json.loads(json.dumps(d.state.to_json()))) == d.state
    clamped = min(max(current, p.min_replicas), p.max_replicas)
    if stale or d.frozen:
        assert d.desired == clamped
    if current <= p.max_replicas and d.desired < current:
        assert not d.panic and d.desired >= current // 2                 # never below half, never in panic
    if p.min_replicas <= current and d.desired > current:
        assert d.desired <= max(2 * current, current + p.max_scale_up_pods)
    if d.desired != clamped:
        assert d.state.last_scale_time == now
    assert all(t <= now for t, _ in d.state.recommendations)
    assert len(d.state.recommendations) <= 2 * (max(r for _, r in d.state.recommendations or [(0, 0)]) + 2)
