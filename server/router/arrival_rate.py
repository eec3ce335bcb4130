"""Arrival rates the router exports for the autoscaler: requests and tokens per second.

An exponentially weighted rate: each arrival adds weight/tau and the sum decays with exp(-dt/tau), so
under a steady rate r the estimate converges to r, and a spike shows within seconds rather than after a
window has filled. O(1) memory; reading it never mutates state. Pure, with an injectable clock.
"""
from __future__ import annotations

import math
import time

from .admission import Clock


class ArrivalRate:
    def __init__(self, tau_s: float = 10.0, clock: Clock = time.monotonic) -> None:
        if not (tau_s > 0 and math.isfinite(tau_s)):
            raise ValueError(f"tau_s must be a positive number of seconds, got {tau_s!r}")
        self.tau = float(tau_s)
        self._clock = clock
        self._value = 0.0      # the rate at time _last
        self._last = clock()

    def _decayed(self, now: float) -> float:
        return self._value * math.exp(-max(0.0, now - self._last) / self.tau)

    def add(self, weight: float = 1.0) -> None:
        now = self._clock()
        self._value = self._decayed(now) + weight / self.tau
        self._last = max(self._last, now)

    def rate(self) -> float:
        """Per second, as of now."""
        return self._decayed(self._clock())
