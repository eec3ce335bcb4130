"""The metrics contract: its names are unique and well formed, and its one parser reads what the
exporters write and refuses what they would never write."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pagedmodel import metrics_contract as mc


def test_names_unique_and_valid() -> None:
    names = [m.name for m in mc.ALL]
    assert len(names) == len(set(names))
    for m in mc.ALL:
        assert re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", m.name), m.name
        assert m.help and m.kind in ("gauge", "counter", "histogram")
        if m.kind == "counter":
            assert not m.name.endswith("_total"), f"{m.name}: prometheus_client appends _total itself"
        assert bool(m.buckets) == (m.kind == "histogram"), m.name
        assert list(m.buckets) == sorted(m.buckets), m.name


def test_series_names_per_kind() -> None:
    assert mc.PROMPT_TOKENS.series() == ("vllm:prompt_tokens_total",)
    assert mc.KV_BLOCK_ALLOCATION.series() == tuple(
        "pagedmodel:kv_block_allocation_seconds" + s for s in ("_bucket", "_sum", "_count"))
    assert mc.KV_CACHE_USAGE.series() == ("vllm:kv_cache_usage_perc",)
    assert "pagedmodel_router_requests_total" in mc.exported_series(["router"])
    assert "pagedmodel_router_requests_total" not in mc.exported_series(["engine"])


def test_alert_thresholds_are_bucket_edges() -> None:
    # histogram_quantile interpolates inside a bucket: an alert threshold that is an edge is exact
    assert 0.05 in mc.KV_BLOCK_ALLOCATION.buckets


def _exposition() -> str:
    r = CollectorRegistry()
    g = Gauge(mc.KV_CACHE_USAGE.name, mc.KV_CACHE_USAGE.help, list(mc.KV_CACHE_USAGE.labels), registry=r)
    g.labels("a").set(0.25)
    g.labels("b").set(0.5)
    c = Counter(mc.ROUTER_REQUESTS.name, mc.ROUTER_REQUESTS.help, list(mc.ROUTER_REQUESTS.labels), registry=r)
    c.labels("200").inc(3)
    h = Histogram(mc.KV_BLOCK_ALLOCATION.name, mc.KV_BLOCK_ALLOCATION.help, list(mc.KV_BLOCK_ALLOCATION.labels),
                  buckets=mc.KV_BLOCK_ALLOCATION.buckets, registry=r)
    h.labels("a").observe(0.001)
    return generate_latest(r).decode()


def test_parse_reads_labels_and_values() -> None:
    samples = mc.parse(_exposition())
    usage = {s.labels["model_name"]: s.value for s in samples if s.name == "vllm:kv_cache_usage_perc"}
    assert usage == {"a": 0.25, "b": 0.5}
    assert [s.value for s in samples if s.name == "pagedmodel_router_requests_total"] == [3.0]
    buckets = {s.labels["le"]: s.value for s in samples if s.name == "pagedmodel:kv_block_allocation_seconds_bucket"}
    assert buckets["0.0005"] == 0.0 and buckets["0.001"] == 1.0 and buckets["+Inf"] == 1.0


def test_sums_over_label_sets_and_only_wanted() -> None:
    text = _exposition()
    got = mc.sums(text, ["vllm:kv_cache_usage_perc", "pagedmodel_router_requests_total", "absent"])
    assert got == {"vllm:kv_cache_usage_perc": 0.75, "pagedmodel_router_requests_total": 3.0}


@pytest.mark.parametrize("text", ["garbage here", 'a{b="c" 1', "metric notanumber"])
def test_parse_refuses_malformed(text: str) -> None:
    with pytest.raises(ValueError, match="not Prometheus text"):
        mc.parse(text)


def test_importable_without_torch() -> None:
    code = "import sys; import pagedmodel.metrics_contract; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_register_builds_each_kind_from_its_definition() -> None:
    r = CollectorRegistry()
    mc.register(mc.TTFT, r).labels("m").observe(0.007)
    mc.register(mc.ROUTER_RETRIES, r).inc()
    mc.register(mc.ROUTER_QUEUE_LENGTH, r).set(4)
    got = {s.name: s for s in mc.parse(generate_latest(r).decode())}
    assert got["vllm:time_to_first_token_seconds_count"].value == 1.0
    assert got["pagedmodel_router_retries_total"].value == 1.0
    assert got["pagedmodel_router_queue_length"].value == 4.0
    les = {s.labels["le"] for s in mc.parse(generate_latest(r).decode())
           if s.name == "vllm:time_to_first_token_seconds_bucket"}
    assert les == {repr(float(b)) for b in mc.TTFT_BUCKETS} | {"+Inf"}
