"""The replica autoscaler: a pure policy from a window of observations to a replica count and a reason.

No I/O and no clock reads: the operator passes the window, the replica count it asks for now
(the engine Deployment's spec.replicas), the state persisted from the previous pass and `now`.
The rule and why it looks like this are in docs/autoscaling.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

from .observation import Observation


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
    panic_threshold: float = 2.0        # load ratio of the newest scrape that starts a panic
    stable_window_s: float | None = None  # averaging window; None: max(60 s, 3 intervals)
    panic_hold_s: float | None = None     # a panic lasts this long after the last trigger; None: stable window

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(f"autoscaling policy: {msg}")
        for name in ("min_replicas", "max_replicas"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                bad(f"{name} must be an integer >= 0, not {v!r}")
        if self.max_replicas < 1:
            bad(f"max_replicas must be >= 1, not {self.max_replicas}")
        if self.min_replicas > self.max_replicas:
            bad(f"min_replicas ({self.min_replicas}) must not exceed max_replicas ({self.max_replicas})")
        for name, lo_open in (("target_kv_cache_usage", True), ("target_waiting_per_replica", False),
                              ("interval_s", True), ("scale_up_stabilization_s", False),
                              ("scale_down_stabilization_s", False), ("tolerance", False),
                              ("stable_window_s", True), ("panic_hold_s", False)):
            v = getattr(self, name)
            if v is None and name in ("stable_window_s", "panic_hold_s"):
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or v < 0 or (lo_open and v == 0):
                bad(f"{name} must be a number {'> 0' if lo_open else '>= 0'}, not {v!r}")
        if self.target_kv_cache_usage > 1:
            bad(f"target_kv_cache_usage must be <= 1, not {self.target_kv_cache_usage}")
        if self.tolerance >= 1:
            bad(f"tolerance must be < 1, not {self.tolerance}")
        if isinstance(self.panic_threshold, bool) or not isinstance(self.panic_threshold, (int, float)) \
                or not self.panic_threshold > 1 + self.tolerance:
            bad(f"panic_threshold must exceed 1 + tolerance, not {self.panic_threshold!r}")

    @classmethod
    def from_spec(cls, autoscaling: dict[str, Any]) -> "AutoscalingPolicy":
        """From spec.autoscaling with the CRD defaults filled (camelCase keys); ValueError names the field."""
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
        return cls(**{attr: autoscaling[k] for k, attr in keys.items()})

    @property
    def stable_window(self) -> float:
        return self.stable_window_s if self.stable_window_s is not None else max(60.0, 3 * self.interval_s)

    @property
    def panic_hold(self) -> float:
        return self.panic_hold_s if self.panic_hold_s is not None else self.stable_window

    def window_s(self) -> float:
        """How far back observations are needed; older ones can be dropped from the persisted window."""
        return self.stable_window + self.interval_s

    def state_horizon_s(self) -> float:
        """How far back recommendations are kept in AutoscalerState."""
        return max(self.scale_up_stabilization_s, self.scale_down_stabilization_s) + self.interval_s


@dataclass(frozen=True)
class AutoscalerState:
    """What must survive between passes and operator restarts (persisted in status)."""

    recommendations: tuple[tuple[float, int], ...] = ()   # (time, replicas) within the stabilization windows
    panic_until: float | None = None
    last_scale_time: float | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"recommendations": [[round(t, 3), n] for t, n in self.recommendations]}
        if self.panic_until is not None:
            out["panicUntil"] = round(self.panic_until, 3)
        if self.last_scale_time is not None:
            out["lastScaleTime"] = round(self.last_scale_time, 3)
        return out

    @classmethod
    def from_json(cls, raw: dict[str, Any] | None) -> "AutoscalerState":
        """Tolerant: garbage gives an empty state (the autoscaler then acts as after a fresh start)."""
        if not isinstance(raw, dict):
            return cls()
        recs: list[tuple[float, int]] = []
        items = raw.get("recommendations")
        for item in items if isinstance(items, list) else []:
            if (isinstance(item, (list, tuple)) and len(item) == 2 and _finite(item[0])
                    and isinstance(item[1], int) and not isinstance(item[1], bool) and item[1] >= 0):
                recs.append((float(item[0]), item[1]))
        recs.sort()
        panic = raw.get("panicUntil")
        last = raw.get("lastScaleTime")
        return cls(tuple(recs), float(panic) if _finite(panic) else None, float(last) if _finite(last) else None)


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(frozen=True)
class ScaleDecision:
    desired: int
    reason: str          # words with the numbers
    limited: str | None  # set when the [min, max] clamp binds
    panic: bool
    frozen: bool         # True: no decision (stale or no data), desired == current
    state: AutoscalerState
    load_ratio: float | None = None  # demand / answering engines over the stable window (None when frozen)


def trim(window: Sequence[Observation], policy: AutoscalingPolicy, now: float) -> list[Observation]:
    """The observations still needed at `now`, oldest first."""
    horizon = now - policy.window_s()
    return sorted((o for o in window if o.time >= horizon), key=lambda o: o.time)


def decide(policy: AutoscalingPolicy, window: Sequence[Observation], current: int, state: AutoscalerState,
           now: float, *, stale: bool = False) -> ScaleDecision:
    """Desired replicas from the window; see docs/autoscaling.md for the rule."""
    raise NotImplementedError
