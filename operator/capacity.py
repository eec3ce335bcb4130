"""Per-replica capacity: the requests per second one engine finishes when it runs at the KV target.

What scaling on arrival rate divides by (docs/autoscaling.md). Measured from the engines' own counters:
between two scrapes with the same engines answering, finished requests / seconds / engines is the
per-engine throughput; only a steady pass whose mean KV usage lies within `NEAR` of the target counts,
scaled linearly to the target (close to it, throughput is close to proportional to KV usage; far below it, a
lightly loaded engine's step time would make the projection optimistic). Measurements are smoothed
(`ALPHA`) and persisted with the autoscaler's state; before the first one, the configured fallback
(spec.autoscaling.requestsPerSecondPerReplica) applies, and without either the arrival signal is off.

Pure: no I/O, no clock.
"""
from __future__ import annotations

from collections.abc import Sequence

from .observation import Observation

NEAR = 0.1          # |KV usage - target| within which a pass measures capacity
ALPHA = 0.3         # weight of a new measurement in the smoothed estimate
MIN_FINISHED = 5    # fewer finished requests in a pass are too few to measure on
STEADY = 0.05       # KV usage may move at most this much between the two scrapes of a measurement


def measure(window: Sequence[Observation], target_kv: float) -> float | None:
    """The newest pass's per-engine capacity at the target, or None when it cannot be measured."""
    if len(window) < 2:
        return None
    a, b = window[-2], window[-1]
    dt = b.time - a.time
    if dt <= 0 or b.engines == 0 or a.engines != b.engines or b.finished < MIN_FINISHED:
        return None
    kv = (a.kv_cache_usage + b.kv_cache_usage) / 2
    # Steady passes only: while KV usage climbs, admitted requests hold blocks they have not finished in yet,
    # so throughput lags the usage and the projection would read low (and the other way round as it falls).
    if abs(kv - target_kv) > NEAR or abs(b.kv_cache_usage - a.kv_cache_usage) > STEADY:
        return None
    return b.finished / dt / b.engines * target_kv / kv


def smoothed(previous: float | None, measured: float | None) -> float | None:
    """The estimate after this pass: the previous one moved towards a new measurement."""
    if measured is None:
        return previous
    if previous is None:
        return measured
    return (1 - ALPHA) * previous + ALPHA * measured
