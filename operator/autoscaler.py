"""The replica autoscaler: a pure policy from a window of observations to a replica count and a reason.

No I/O and no clock reads: the operator passes the window, the replica count it asks for now
(the engine Deployment's spec.replicas), the state persisted from the previous pass and `now`.
The rule and why it looks like this are in docs/autoscaling.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Sequence

from . import capacity as cap
from .observation import Observation
from .validation import check_int, check_number, failer, finite, is_num


@dataclass(frozen=True)
class AutoscalingPolicy:
    """spec.autoscaling plus the constants the spec does not expose (documented in docs/autoscaling.md)."""

    min_replicas: int
    max_replicas: int
    target_kv_cache_usage: float
    target_waiting_per_replica: float   # 0 turns the queue signal off (KV usage alone decides)
    interval_s: float
    scale_up_stabilization_s: float
    scale_down_stabilization_s: float
    tolerance: float = 0.1              # |load ratio - 1| <= this: hold, so noise does not scale
    panic_threshold: float = 2.0        # load ratio over the panic window that starts a panic
    panic_scrapes: int = 2              # the panic window: this many newest scrapes
    stable_window_s: float | None = None  # averaging window; None: max(60 s, 3 intervals)
    panic_hold_s: float | None = None     # a panic lasts this long after the last trigger; None: stable window
    pending_grace_s: float = 900.0      # new pods this recent that do not answer yet block further scale-up
                                        # (the CRD's default startup budget, spec.probes.startupTimeoutSeconds)
    max_scale_up_factor: float = 2.0    # one step at most doubles ...
    max_scale_up_pods: int = 4          # ... or adds this many pods, whichever is more (HPA's default)
    capacity_fallback_rps: float | None = None  # req/s one engine serves at the KV target, until measured

    def __post_init__(self) -> None:
        bad = failer("autoscaling policy")
        for name in ("min_replicas", "max_replicas", "panic_scrapes", "max_scale_up_pods"):
            check_int(bad, name, getattr(self, name), 1 if name in ("panic_scrapes", "max_scale_up_pods") else 0)
        if self.max_replicas < 1:
            bad(f"max_replicas must be >= 1, not {self.max_replicas}")
        if self.min_replicas > self.max_replicas:
            bad(f"min_replicas ({self.min_replicas}) must not exceed max_replicas ({self.max_replicas})")
        for name, positive in (("target_kv_cache_usage", True), ("target_waiting_per_replica", False),
                               ("interval_s", True), ("scale_up_stabilization_s", False),
                               ("scale_down_stabilization_s", False), ("tolerance", False),
                               ("stable_window_s", True), ("panic_hold_s", False), ("pending_grace_s", False),
                               ("capacity_fallback_rps", True)):
            v = getattr(self, name)
            if v is None and name in ("stable_window_s", "panic_hold_s", "capacity_fallback_rps"):
                continue
            check_number(bad, name, v, positive=positive)
        if self.target_kv_cache_usage > 1:
            bad(f"target_kv_cache_usage must be <= 1, not {self.target_kv_cache_usage}")
        if not is_num(self.max_scale_up_factor) or not self.max_scale_up_factor > 1:
            bad(f"max_scale_up_factor must be > 1, not {self.max_scale_up_factor!r}")
        if self.tolerance >= 1:
            bad(f"tolerance must be < 1, not {self.tolerance}")
        if not is_num(self.panic_threshold) or not self.panic_threshold > 1 + self.tolerance:
            bad(f"panic_threshold must exceed 1 + tolerance, not {self.panic_threshold!r}")

    @classmethod
    def from_spec(cls, autoscaling: dict[str, Any], *, startup_timeout_s: float | None = None) -> "AutoscalingPolicy":
        """From spec.autoscaling with the CRD defaults filled (camelCase keys); ValueError names the field.

        `startup_timeout_s` (spec.probes.startupTimeoutSeconds) bounds how long missing new pods count as
        starting rather than failed (`pending_grace_s`).
        """
        if not isinstance(autoscaling, dict):
            raise ValueError(f"spec.autoscaling must be an object, not {type(autoscaling).__name__}")
        keys = {"minReplicas": "min_replicas", "maxReplicas": "max_replicas",
                "targetKVCacheUsage": "target_kv_cache_usage",
                "targetWaitingPerReplica": "target_waiting_per_replica", "intervalSeconds": "interval_s",
                "scaleUpStabilizationSeconds": "scale_up_stabilization_s",
                "scaleDownStabilizationSeconds": "scale_down_stabilization_s"}
        missing = [k for k in keys if k not in autoscaling]
        if missing:
            raise ValueError(f"spec.autoscaling lacks {', '.join(missing)} (fill the CRD defaults first)")
        extra: dict[str, Any] = {} if startup_timeout_s is None else {"pending_grace_s": startup_timeout_s}
        if autoscaling.get("stableWindowSeconds") is not None:     # optional; default max(60 s, 3 intervals)
            extra["stable_window_s"] = autoscaling["stableWindowSeconds"]
        if autoscaling.get("requestsPerSecondPerReplica") is not None:   # optional: measured when absent
            extra["capacity_fallback_rps"] = autoscaling["requestsPerSecondPerReplica"]
        return cls(**{attr: autoscaling[k] for k, attr in keys.items()}, **extra)

    @property
    def stable_window(self) -> float:
        return self.stable_window_s if self.stable_window_s is not None else max(60.0, 3 * self.interval_s)

    @property
    def panic_hold(self) -> float:
        return self.panic_hold_s if self.panic_hold_s is not None else self.stable_window

    @property
    def drain_horizon_s(self) -> float:
        """With the arrival signal, the backlog asks for what drains it within this long: capacity added for it
        stays up for the scale-down window anyway, so draining faster would only buy more replicas."""
        return max(self.stable_window, self.scale_down_stabilization_s)

    @property
    def history_gap_s(self) -> float:
        """A pause between passes longer than this breaks the history a scale-down needs. Not shorter than
        the stable window, so a busy operator that runs a few passes late does not stall scale-downs."""
        return max(3 * self.interval_s, self.stable_window)

    def window_s(self) -> float:
        """How far back observations are needed; older ones can be dropped from the persisted window."""
        return self.stable_window + self.interval_s

    def state_horizon_s(self) -> float:
        """How far back recommendations are kept in AutoscalerState."""
        return max(self.scale_up_stabilization_s, self.scale_down_stabilization_s) + self.interval_s


@dataclass(frozen=True)
class AutoscalerState:
    """What must survive between passes and operator restarts (persisted in status).

    `recommendations` is compacted: a recommendation that a later one dominates for every future
    window (a later one at least as high for the scale-down max, at most as low for the scale-up min)
    is dropped, so the list stays a few entries long even with a 1 s interval and a 24 h window.
    `history_since` is when the unbroken run of passes began (a gap longer than `history_gap_s`, such
    as an operator outage or stale metrics, restarts it): scale-down needs the whole window covered.
    """

    recommendations: tuple[tuple[float, int], ...] = ()   # (time, replicas) within the stabilization windows
    panic_until: float | None = None
    last_scale_time: float | None = None
    history_since: float | None = None
    last_scale_up_time: float | None = None   # pods asked for then may still be starting
    capacity_rps: float | None = None         # measured per-replica capacity (capacity.py), smoothed

    def to_json(self) -> dict[str, Any]:
        # Times unrounded: the state must round-trip exactly, or a restart could shift a window edge.
        out: dict[str, Any] = {"recommendations": [[t, n] for t, n in self.recommendations]}
        for key, value in (("panicUntil", self.panic_until), ("lastScaleTime", self.last_scale_time),
                           ("historySince", self.history_since), ("lastScaleUpTime", self.last_scale_up_time),
                           ("capacityRps", self.capacity_rps)):
            if value is not None:
                out[key] = value
        return out

    @classmethod
    def from_json(cls, raw: dict[str, Any] | None) -> "AutoscalerState":
        """Tolerant: garbage gives an empty state (the autoscaler then acts as after a fresh start)."""
        if not isinstance(raw, dict):
            return cls()
        recs: dict[float, int] = {}
        items = raw.get("recommendations")
        for item in items if isinstance(items, list) else []:
            if (isinstance(item, (list, tuple)) and len(item) == 2 and finite(item[0])
                    and isinstance(item[1], int) and not isinstance(item[1], bool) and item[1] >= 0):
                recs[float(item[0])] = item[1]

        def num(key: str) -> float | None:
            v = raw.get(key)
            return float(v) if finite(v) else None
        capacity = num("capacityRps")
        return cls(tuple(sorted(recs.items())), num("panicUntil"), num("lastScaleTime"), num("historySince"),
                   num("lastScaleUpTime"), capacity if capacity is not None and capacity > 0 else None)


@dataclass(frozen=True)
class ScaleDecision:
    """One pass's answer. Persist `state` (its JSON) whatever `desired` is."""

    desired: int
    reason: str          # words with the numbers
    limited: str | None  # set when the [min, max] clamp binds (or the load asks beyond it)
    panic: bool
    frozen: bool         # True: no decision (stale or no data), desired == current; False with no data
                         # only when `current` lies outside [min, max] and is clamped
    state: AutoscalerState
    load_ratio: float | None = None  # demand / answering engines over the stable window (None when frozen)
    cause: str = "steady"            # one of CAUSES: the reason as a metric label


def trim(window: Sequence[Observation], policy: AutoscalingPolicy, now: float) -> list[Observation]:
    """The observations still needed at `now`, oldest first."""
    horizon = now - policy.window_s()
    return sorted((o for o in window if o.time >= horizon), key=lambda o: o.time)


def _clamp(n: int, policy: AutoscalingPolicy) -> int:
    return min(max(n, policy.min_replicas), policy.max_replicas)


def _limited(wish: int, policy: AutoscalingPolicy) -> str | None:
    if wish > policy.max_replicas:
        return f"maxReplicas {policy.max_replicas} reached; load asks for {wish}"
    if wish < policy.min_replicas:
        return f"minReplicas {policy.min_replicas} holds; load asks for {wish}"
    return None


def _cmp(value: float, target: float) -> str:
    return ">" if value > target else "<="


@dataclass(frozen=True)
class _Load:
    """The window's load, in engine units: how many engines would run exactly at target."""

    demand: float            # max of the two signals' demands, mean over the stable window
    ratio: float             # demand / engines answering now
    engines: int             # engines answering in the newest scrape
    kv: float                # mean kv usage over the window
    waiting_per_engine: float
    scrapes: int
    idle: bool               # no request ran, waited or finished in the whole window
    kv_leads: bool = True    # the KV signal's demand is at least the queue's (or the arrival signal's)
    arrival_rate: float | None = None   # mean req/s over the window when the arrival signal is on
    capacity: float | None = None       # the per-replica capacity it is divided by
    drain: float = 0.0                  # engines' worth the backlog adds (drained over drain_horizon_s)


def _load(obs: Sequence[Observation], policy: AutoscalingPolicy, *, count_waiting: bool = True,
          capacity: float | None = None) -> _Load:
    n = len(obs)
    # Demand is summed over engines (usage x engines), so it is independent of how many engines
    # share the load: a pass that sees a new engine come up does not change it (no double scaling).
    kv_demand = sum(o.kv_cache_usage * o.engines for o in obs) / n / policy.target_kv_cache_usage
    waiting = sum(o.waiting for o in obs) / n if count_waiting else 0.0
    arrival = capacity is not None and all(o.routers > 0 for o in obs)
    if arrival:
        # The flow decides how many engines the load needs; the stock (the backlog) only what drains it.
        # The newest rate, not the window's mean: the router's gauge is smoothed already, and a second
        # average would only delay a burst (the scale-down window keeps the count stable on the way down).
        assert capacity is not None
        rate = obs[-1].arrival_rate
        drain = waiting / (capacity * policy.drain_horizon_s)
        queue_demand = rate / capacity + drain
    else:
        rate, drain = None, 0.0
        queue_demand = waiting / policy.target_waiting_per_replica if policy.target_waiting_per_replica > 0 else 0.0
    demand = max(kv_demand, queue_demand)
    engines = obs[-1].engines
    return _Load(demand=demand, ratio=demand / engines, engines=engines,
                 kv=sum(o.kv_cache_usage for o in obs) / n,
                 waiting_per_engine=sum(o.waiting_per_engine for o in obs) / n, scrapes=n,
                 idle=all(o.running == 0 and o.waiting == 0 and o.finished == 0 for o in obs),
                 kv_leads=kv_demand >= queue_demand, arrival_rate=rate, capacity=capacity if arrival else None,
                 drain=drain)


def _describe(load: _Load, policy: AutoscalingPolicy) -> str:
    kv = f"kv cache usage {load.kv:.2f} {_cmp(load.kv, policy.target_kv_cache_usage)} " \
         f"target {policy.target_kv_cache_usage:.2f}"
    tw = policy.target_waiting_per_replica
    if load.arrival_rate is not None and load.capacity is not None:
        flow = (f"arrivals {load.arrival_rate:.2f} req/s / {load.capacity:.2f} per replica = "
                f"{load.arrival_rate / load.capacity:.2f} engines + {load.drain:.2f} to drain "
                f"{load.waiting_per_engine * load.engines:.0f} waiting")
        signals = f"{kv}, {flow}" if load.kv_leads else f"{flow}, {kv}"
    elif tw > 0:
        wait = f"{load.waiting_per_engine:.1f} waiting per engine {_cmp(load.waiting_per_engine, tw)} target {tw:g}"
        kv_leads = load.kv / policy.target_kv_cache_usage >= load.waiting_per_engine / tw
        signals = f"{kv}, {wait}" if kv_leads else f"{wait}, {kv}"
    else:
        signals = f"{kv} (queue signal off: targetWaitingPerReplica 0)"
    return (f"{signals} (mean of {load.scrapes} scrape{'s' if load.scrapes != 1 else ''} over "
            f"{policy.stable_window:g} s): load ratio {load.ratio:.2f} on {load.engines} "
            f"engine{'s' if load.engines != 1 else ''}")


def _compact(recs: list[tuple[float, int]], now: float, policy: AutoscalingPolicy) -> tuple[tuple[float, int], ...]:
    """Drop recommendations no future stabilization window can need (see AutoscalerState)."""
    up_from = now - policy.scale_up_stabilization_s - policy.interval_s
    kept: list[tuple[float, int]] = []
    later_max, later_min = -1, math.inf
    for t, r in sorted(recs, reverse=True):
        if r > later_max or (t >= up_from and r < later_min):
            kept.append((t, r))
        later_max, later_min = max(later_max, r), min(later_min, r)
    return tuple(reversed(kept))


def _ceil(x: float) -> int:
    # 3.0000000001 from float sums is 3 engines, not 4.
    return math.ceil(x - 1e-9)


# Why a pass decided what it did, as a label value from a fixed set (the operator's metrics count these).
CAUSES = ("kv_cache", "waiting", "idle", "bounds", "stabilizing", "no_metrics", "steady", "arrival_rate")


@dataclass(frozen=True)
class _Carried:
    """The persisted state that is still valid at `now`."""

    recs: list[tuple[float, int]]
    panic_until: float | None
    last_scale: float | None


@dataclass(frozen=True)
class _Signals:
    """Which observations count, and whether the queue is one of the signals this pass."""

    usable: list[Observation]
    count_waiting: bool
    note: str | None


@dataclass(frozen=True)
class _Panic:
    newest: _Load            # the panic window's load
    until: float | None      # panic end; None: not panicking
    note: str | None


@dataclass(frozen=True)
class _Recommendation:
    wish: int                # what the load asks for, in replicas, before stabilization and bounds
    rec: int                 # what this pass records (the wish, unless pods asked for are still starting)
    note: str | None


@dataclass(frozen=True)
class _Step:
    """The recommendation after the stabilization windows and the per-step limits."""

    desired: int
    recs: list[tuple[float, int]]
    since: float
    note: str | None


def _carry(policy: AutoscalingPolicy, state: AutoscalerState, now: float) -> _Carried:
    # State from the future (a clock stepped back, a restore) cannot be trusted to be in any window.
    horizon = now - policy.state_horizon_s()
    # One recommendation per time (the last wins), as from_json would read it back.
    recs = sorted({t: r for t, r in state.recommendations if horizon <= t <= now}.items())
    panic_until = state.panic_until if state.panic_until is not None and state.panic_until > now else None
    if panic_until is not None:
        panic_until = min(panic_until, now + policy.panic_hold)
    return _Carried(recs, panic_until, state.last_scale_time)


def _no_decision(why: str, cause: str, policy: AutoscalingPolicy, current: int, carried: _Carried,
                 state: AutoscalerState, now: float) -> ScaleDecision:
    kept = AutoscalerState(tuple(sorted(carried.recs)), carried.panic_until, carried.last_scale,
                           state.history_since, state.last_scale_up_time, state.capacity_rps)
    bounded = _clamp(current, policy)
    if bounded != current:
        # The spec's bounds need no metrics: a raised minReplicas must bring the model up.
        bound = "minReplicas" if bounded > current else "maxReplicas"
        return ScaleDecision(bounded, f"{bound} {bounded} ({why}): {current} -> {bounded}", None,
                             panic=False, frozen=False, cause="bounds", state=replace(
                                 kept, last_scale_time=now,
                                 last_scale_up_time=now if bounded > current else kept.last_scale_up_time))
    return ScaleDecision(current, f"{why}; keeping {current} replica{'s' if current != 1 else ''}", None,
                         panic=carried.panic_until is not None, frozen=True, cause=cause, state=kept)


def _gate(policy: AutoscalingPolicy, window: Sequence[Observation], current: int, carried: _Carried,
          state: AutoscalerState, now: float, stale: bool) -> ScaleDecision | list[Observation]:
    """The observations to decide on, or the decision when there are none fit to decide on."""
    def no(why: str, cause: str = "no_metrics") -> ScaleDecision:
        return _no_decision(why, cause, policy, current, carried, state, now)

    if stale:
        return no("metrics stale: no scaling on stale data")
    if current == 0:
        # No engine exists to report load; the router holds requests in its queue meanwhile (it waits for
        # an upstream instead of failing), and that queue is the one signal there is.
        newest = max(window, key=lambda o: o.time, default=None)
        if newest is not None and newest.engines == 0 and newest.waiting > 0 and now - newest.time <= 2 * policy.interval_s:
            target = _clamp(max(1, policy.min_replicas), policy)
            reason = (f"{newest.waiting} request{'s' if newest.waiting != 1 else ''} queued at the router with no "
                      f"engine: 0 -> {target}")
            return ScaleDecision(target, reason, None, panic=False, frozen=False, cause="waiting", state=AutoscalerState(
                tuple(sorted(carried.recs)), carried.panic_until, now, state.history_since, now, state.capacity_rps))
        return no("scaled to zero: no engine and no request queued at the router", "idle")
    in_window = sorted((o for o in window if now - policy.stable_window < o.time <= now), key=lambda o: o.time)
    usable = [o for o in in_window if o.engines > 0]
    if not usable:
        if in_window:
            return no(f"no engine answered in the last {policy.stable_window:g} s")
        return no(f"no metrics in the last {policy.stable_window:g} s")
    age = now - usable[-1].time
    if age > 2 * policy.interval_s:
        return no(f"newest metrics are {age:.0f} s old (interval {policy.interval_s:g} s)")
    return usable


def _signals(usable: list[Observation], policy: AutoscalingPolicy) -> _Signals:
    # A queue is a stock, not a flow: the backlog left by pods that took minutes to start drains once
    # they serve. A queue shrinking fast enough to be gone within the stable window asks for nothing.
    if len(usable) >= 2 and policy.target_waiting_per_replica > 0:
        a, b = usable[-2], usable[-1]
        if b.engines > a.engines and b.waiting >= a.waiting:
            # New engines answer for the first time: the router has barely started sending them work,
            # so this scrape's queue does not show their capacity yet. Read it again next scrape.
            return _Signals(usable, False, f"{b.engines - a.engines} new engine{'s' if b.engines - a.engines > 1 else ''} "
                                           f"just answered: the queue ({b.waiting} waiting) is read again next scrape")
        if b.waiting < a.waiting:
            eta = b.waiting * (b.time - a.time) / (a.waiting - b.waiting)
            if eta <= policy.stable_window:
                return _Signals(usable, False, f"queue draining ({a.waiting} -> {b.waiting} waiting, empty in "
                                               f"~{eta:.0f} s): not counted")
    return _Signals(usable, True, None)


def _panic(signals: _Signals, policy: AutoscalingPolicy, panic_until: float | None, now: float,
           capacity: float | None) -> _Panic:
    # The panic window: the newest two scrapes. One would be quicker by an interval for moderate bursts,
    # but a single scrape of a queue is noisy; a burst of 4x target or more still panics on its first.
    newest = _load(signals.usable[-policy.panic_scrapes:], policy, count_waiting=signals.count_waiting,
                   capacity=capacity)
    if newest.ratio < policy.panic_threshold:
        return _Panic(newest, panic_until, None)
    scrapes = f"{newest.scrapes} scrape{'s' if newest.scrapes > 1 else ''}"
    return _Panic(newest, now + policy.panic_hold, f"panic: newest {scrapes} at {newest.ratio:.2f}x target "
                                                   f"(>= {policy.panic_threshold:g}x) on {newest.engines} engines")


def _recommend(load: _Load, panic: _Panic, policy: AutoscalingPolicy, current: int, state: AutoscalerState,
               now: float) -> _Recommendation:
    if load.idle:
        rec = 0
    elif abs(load.ratio - 1) <= policy.tolerance:
        rec = current
    elif load.ratio > 1:
        rec = _ceil(load.demand)
    else:
        # Fewer engines each run bigger batches, slower per sequence, so they hold KV longer than a
        # linear projection says: leave them at the bottom of the band, not at the target.
        rec = max(1, _ceil(load.demand / (1 - policy.tolerance)))
    if panic.until is not None:
        rec = max(rec, _ceil(panic.newest.demand), current)
    # Pods asked for recently that do not answer yet: their capacity is on its way. Waiting requests
    # pile up meanwhile, and scaling on them again would cascade (llm-d blocks it the same way).
    pending = (load.engines < current and state.last_scale_up_time is not None
               and now - state.last_scale_up_time < policy.pending_grace_s)
    if pending and rec > current and load.arrival_rate is not None and load.capacity is not None:
        # The arrival rate is a flow, not a backlog that starting pods will drain: more than the pods
        # asked for can serve is needed whether they have started or not. Only the drain term waits.
        flow = _ceil(load.arrival_rate / load.capacity)
        if flow > current:
            return _Recommendation(rec, flow, None)
    if pending and rec > current:
        return _Recommendation(rec, current, f"{load.engines} of {current} engines answering: no further scale-up "
                                             f"(to {rec}) until the pods asked for "
                                             f"{now - state.last_scale_up_time:.0f} s ago answer")
    return _Recommendation(rec, rec, None)


def _stabilize(rec: int, load: _Load, policy: AutoscalingPolicy, current: int, carried: _Carried,
               panic_until: float | None, state: AutoscalerState, now: float) -> _Step:
    previous = [t for t, _ in carried.recs if t < now]
    since = state.history_since
    if since is None or not previous or now - max(previous) > policy.history_gap_s or since > now:
        since = now
    recs = [(t, r) for t, r in carried.recs if t != now] + [(now, rec)]
    up_limit = rec if panic_until is not None else min(r for t, r in recs if t >= now - policy.scale_up_stabilization_s)
    slack = policy.interval_s / 2   # scrapes jitter around the interval
    down_limit = max(r for t, r in recs if t >= now - policy.scale_down_stabilization_s - slack)

    def step(desired: int, note: str | None = None) -> _Step:
        return _Step(desired, recs, since, note)

    if up_limit > current:
        desired = min(up_limit, max(_ceil(current * policy.max_scale_up_factor), current + policy.max_scale_up_pods))
        return step(desired, None if desired == up_limit else f"at most x{policy.max_scale_up_factor:g} or "
                    f"+{policy.max_scale_up_pods} per step (load asks for {up_limit})")
    if rec > current:
        return step(current, f"scale-up to {rec} waits for scaleUpStabilizationSeconds "
                             f"{policy.scale_up_stabilization_s:g} (lowest recommendation in it: {up_limit})")
    if down_limit < current:
        last_scale = carried.last_scale
        if panic_until is not None:
            return step(current, f"no scale-down while panicking (until {panic_until - now:.0f} s from now)")
        if load.engines < current:
            return step(current, f"{load.engines} of {current} engines answering: "
                                 "no scale-down while a scale-up is still starting")
        if last_scale is not None and now - last_scale < policy.stable_window:
            # Each step down is measured before the next: demand read off fewer, busier engines is
            # more accurate than an extrapolation from many idle ones.
            return step(current, f"measuring the last scale ({now - last_scale:.0f} s ago) for a full "
                                 f"{policy.stable_window:g} s window before scaling down again")
        if now - since + slack < policy.scale_down_stabilization_s:
            return step(current, f"recommendations below {current} for {now - since:.0f} s of the "
                                 f"{policy.scale_down_stabilization_s:g} s scale-down window")
        desired = max(down_limit, current // 2 if down_limit == 0 else _ceil(current / 2))
        return step(desired, f"at most halving per step (load asks for {down_limit})" if desired > down_limit else None)
    if rec < current:
        return step(current, f"a recommendation of {down_limit} within the last "
                             f"{policy.scale_down_stabilization_s:g} s holds the scale-down")
    return step(current)


def _cause(load: _Load, current: int, recommendation: _Recommendation, desired: int, bounded: int,
           policy: AutoscalingPolicy) -> str:
    if bounded != current:      # a move: the signal that asked for it, unless the clamp alone moved
        if desired == current:
            return "bounds"
        if load.idle or load.kv_leads:
            return "idle" if load.idle else "kv_cache"
        return "arrival_rate" if load.arrival_rate is not None else "waiting"
    wish = recommendation.wish
    if (wish > current and current == policy.max_replicas) or (wish < current and current == policy.min_replicas):
        return "bounds"
    return "steady" if wish == current else "stabilizing"     # held: stabilization windows, pods starting


def _render(load: _Load, policy: AutoscalingPolicy, notes: list[str], wish: int, current: int, bounded: int,
            limited: str | None, panicking: bool) -> str:
    """The decision's message: the signals, the verdict, every stage's note, the move, the clamp."""
    if load.idle:
        verdict = "idle (nothing ran, waited or finished)"
    elif abs(load.ratio - 1) <= policy.tolerance and not panicking:
        verdict = f"within tolerance {policy.tolerance:g}"
    else:
        verdict = f"asks for {wish}"
    move = f"{current} -> {bounded}" if bounded != current else f"keeping {current}"
    reason = "; ".join([f"{_describe(load, policy)}, {verdict}", *notes, move])
    return reason + f" ({limited})" if limited else reason


def decide(policy: AutoscalingPolicy, window: Sequence[Observation], current: int, state: AutoscalerState,
           now: float, *, stale: bool = False) -> ScaleDecision:
    """Desired replicas from the window; the rule and its reasons are in docs/autoscaling.md.

    `current` is the replica count the operator asks for now; `window` the recent observations
    (any order; ones outside the stable window are ignored); `state` what the previous pass returned.
    Deterministic: the same inputs give the same decision, so a restarted operator that re-runs a pass
    with the persisted state does not scale twice. The stages run in order, each returning a record;
    the message is rendered once from their notes.
    """
    if isinstance(current, bool) or not isinstance(current, int) or current < 0:
        raise ValueError(f"current replicas must be an integer >= 0, not {current!r}")
    if not finite(now):
        raise ValueError(f"now must be a finite number, not {now!r}")
    carried = _carry(policy, state, now)
    usable = _gate(policy, window, current, carried, state, now, stale)
    if isinstance(usable, ScaleDecision):
        return usable
    signals = _signals(usable, policy)
    measured = cap.smoothed(state.capacity_rps, cap.measure(usable, policy.target_kv_cache_usage))
    capacity = measured if measured is not None else policy.capacity_fallback_rps
    load = _load(usable, policy, count_waiting=signals.count_waiting, capacity=capacity)
    panic = _panic(signals, policy, carried.panic_until, now, capacity)
    panicking = panic.until is not None
    recommendation = _recommend(load, panic, policy, current, state, now)
    step = _stabilize(recommendation.rec, load, policy, current, carried, panic.until, state, now)
    bounded = _clamp(step.desired, policy)
    limited = _limited(recommendation.wish, policy) or _limited(step.desired, policy)
    notes = [n for n in (signals.note, panic.note, recommendation.note, step.note) if n]
    new_state = AutoscalerState(_compact(step.recs, now, policy), panic.until,
                                now if bounded != current else carried.last_scale, step.since,
                                now if bounded > current else state.last_scale_up_time, measured)
    return ScaleDecision(bounded, _render(load, policy, notes, recommendation.wish, current, bounded, limited,
                                          panicking), limited, panic=panicking, frozen=False,
                         cause=_cause(load, current, recommendation, step.desired, bounded, policy),
                         state=new_state, load_ratio=round(load.ratio, 4))
