"""How long the block manager's allocations take: a cumulative histogram the metrics exporter reads.

Cumulative, never drained, because the engine's stats are read from more than one place (the engine
loop after each step, and again after requests drain): a "since the last read" list would lose samples.
"""
from __future__ import annotations

import bisect
import itertools

from pagedmodel.metrics_contract import ALLOCATION_BUCKETS


class AllocationTimer:
    def __init__(self, edges: tuple[float, ...] = ALLOCATION_BUCKETS):
        self.edges = edges
        self._counts = [0] * (len(edges) + 1)   # per bucket, the last one above every edge (+Inf)
        self.seconds_sum = 0.0

    def observe(self, seconds: float) -> None:
        # bisect_left: a value equal to an edge belongs to that edge's bucket, as Prometheus's `le` reads
        self._counts[bisect.bisect_left(self.edges, seconds)] += 1
        self.seconds_sum += seconds

    @property
    def count(self) -> int:
        return sum(self._counts)

    def cumulative_buckets(self) -> tuple[int, ...]:
        """Observations <= each edge, then the total (the +Inf bucket)."""
        return tuple(itertools.accumulate(self._counts))
