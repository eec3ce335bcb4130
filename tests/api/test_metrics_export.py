"""ServerMetrics renders what the metrics contract names, from the engine's stats snapshot (no server needed)."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from pagedmodel import metrics_contract as mc
from pagedmodel.server.api.metrics import ServerMetrics


@dataclass
class FakeStats:
    num_running: int = 2
    kv_cache_usage: float = 0.25
    prompt_tokens_total: int = 40
    block_allocation_buckets: tuple[int, ...] = ()
    block_allocation_seconds_sum: float = 0.0


def samples(metrics: ServerMetrics, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {tuple(sorted(s.labels.items())): s.value for s in mc.parse(metrics.render().decode()) if s.name == name}


def test_every_engine_metric_of_the_contract_is_exported() -> None:
    text = ServerMetrics("m", lambda: FakeStats()).render().decode()
    exported = {s.name for s in mc.parse(text)}
    # per-request histograms and the finish-reason counter only get samples once a request finishes
    assert {m.series()[0] for m in mc.of("engine") if m.kind != "histogram" and m.labels == ("model_name",)} <= exported
    assert mc.KV_BLOCK_ALLOCATION.name + "_bucket" in exported
    assert mc.PROCESS_START_TIME.name in exported


def test_gauges_and_counters_come_from_the_stats_snapshot() -> None:
    m = ServerMetrics("m", lambda: FakeStats())
    assert samples(m, mc.NUM_REQUESTS_RUNNING.name) == {(("model_name", "m"),): 2.0}
    assert samples(m, mc.KV_CACHE_USAGE.name) == samples(m, mc.GPU_CACHE_USAGE.name) == {(("model_name", "m"),): 0.25}
    assert samples(m, mc.PROMPT_TOKENS.series()[0]) == {(("model_name", "m"),): 40.0}


def test_block_allocation_histogram_renders_the_engine_cumulative_counts() -> None:
    edges = len(mc.ALLOCATION_BUCKETS)
    counts = tuple(range(1, edges + 2))    # cumulative per edge, then +Inf
    m = ServerMetrics("m", lambda: FakeStats(block_allocation_buckets=counts, block_allocation_seconds_sum=0.5))
    buckets = {dict(k)["le"]: v for k, v in samples(m, mc.KV_BLOCK_ALLOCATION.name + "_bucket").items()}
    assert buckets["+Inf"] == edges + 1
    assert buckets["0.05"] == counts[mc.ALLOCATION_BUCKETS.index(0.05)]
    assert len(buckets) == edges + 1
    assert samples(m, mc.KV_BLOCK_ALLOCATION.name + "_sum") == {(("model_name", "m"),): 0.5}
    assert samples(m, mc.KV_BLOCK_ALLOCATION.name + "_count") == {(("model_name", "m"),): edges + 1}


def test_block_allocation_histogram_exists_all_zero_before_any_allocation() -> None:
    for stats in (FakeStats(), None):   # None: the engine has not stepped yet
        m = ServerMetrics("m", lambda s=stats: s)
        buckets = samples(m, mc.KV_BLOCK_ALLOCATION.name + "_bucket")
        assert len(buckets) == len(mc.ALLOCATION_BUCKETS) + 1 and set(buckets.values()) == {0.0}


def test_block_allocation_bucket_count_that_disagrees_with_the_contract_is_an_error() -> None:
    m = ServerMetrics("m", lambda: FakeStats(block_allocation_buckets=(1, 2, 3)))
    with pytest.raises(ValueError, match="3 bucket counts"):
        m.render()
