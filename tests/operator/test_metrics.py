"""metrics.py: engine gauges parsed from Prometheus text, aggregated across replicas, stale when none answer."""
from __future__ import annotations

import pytest

from pagedmodel.operator.metrics import EngineSample, aggregate, parse_engine_metrics, ready_pod_ips, scrape

TEXT = """# HELP vllm:kv_cache_usage_perc Share of KV cache blocks in use (0-1).
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="smollm2"} 0.25
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="smollm2"} 3.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="smollm2"} 2.0
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{model_name="smollm2"} 120.0
"""


def test_parse_reads_the_three_gauges():
    assert parse_engine_metrics(TEXT) == EngineSample(0.25, 3, 2)


def test_parse_rejects_text_without_them():
    with pytest.raises(ValueError, match="vllm:kv_cache_usage_perc"):
        parse_engine_metrics("# TYPE x gauge\nx 1\n")


def test_aggregate_means_usage_and_sums_queues():
    out = aggregate([EngineSample(0.5, 3, 4), EngineSample(0.8, 1, 2)], None, "T")
    assert out == {"kvCacheUsage": 0.65, "kvCachePercent": 65, "waiting": 4, "running": 6, "scrapedAt": "T",
                   "stale": False}


def test_aggregate_without_samples_keeps_last_numbers_marked_stale():
    last = aggregate([EngineSample(0.5, 0, 1)], None, "T0")
    assert aggregate([], last, "T1") == {**last, "stale": True}
    assert aggregate([], None, "T1") is None


def test_scrape_skips_engines_that_fail_and_only_asks_ready_pods():
    pods = [{"metadata": {"name": "a"}, "status": {"podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}},
            {"metadata": {"name": "b"}, "status": {"podIP": "10.0.0.2", "conditions": [{"type": "Ready", "status": "False"}]}},
            {"metadata": {"name": "c"}, "status": {"podIP": "10.0.0.3", "conditions": [{"type": "Ready", "status": "True"}]}}]
    ips = ready_pod_ips(pods)
    assert ips == ["10.0.0.1", "10.0.0.3"]
    asked = []

    def fetch(url: str) -> str:
        asked.append(url)
        if "10.0.0.3" in url:
            raise ConnectionError("refused")
        return TEXT

    assert scrape(ips, 8000, fetch) == [EngineSample(0.25, 3, 2)]
    assert asked == ["http://10.0.0.1:8000/metrics", "http://10.0.0.3:8000/metrics"]
