"""scrape.py: engine gauges parsed from Prometheus text, aggregated across replicas, stale when none answer."""
from __future__ import annotations

import threading
import time

import pytest

from pagedmodel.operator.scrape import (EngineSample, PodScrape, aggregate, observe, parse_engine_metrics,
                                         ready_pods, scrape)

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
    assert out == {"kvCacheUsage": 0.65, "kvCachePercent": 65, "waiting": 4, "running": 6, "engines": 2,
                   "scrapedAt": "T", "stale": False}


def test_aggregate_without_samples_keeps_last_numbers_marked_stale():
    last = aggregate([EngineSample(0.5, 0, 1)], None, "T0")
    assert aggregate([], last, "T1") == {**last, "stale": True}
    assert aggregate([], None, "T1") is None


def test_parse_reads_configuration_and_counters_when_present():
    text = TEXT + """# TYPE pagedmodel:max_num_seqs gauge
pagedmodel:max_num_seqs{model_name="smollm2"} 64.0
# TYPE pagedmodel:block_size gauge
pagedmodel:block_size{model_name="smollm2"} 16.0
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{model_name="smollm2"} 7.0
# TYPE pagedmodel:num_swap_outs_total counter
pagedmodel:num_swap_outs_total{model_name="smollm2"} 2.0
# TYPE vllm:request_prompt_tokens histogram
vllm:request_prompt_tokens_bucket{le="16.0",model_name="smollm2"} 1.0
vllm:request_prompt_tokens_bucket{le="+Inf",model_name="smollm2"} 3.0
vllm:request_prompt_tokens_count{model_name="smollm2"} 3.0
vllm:request_prompt_tokens_sum{model_name="smollm2"} 300.0
# TYPE vllm:request_generation_tokens histogram
vllm:request_generation_tokens_bucket{le="+Inf",model_name="smollm2"} 3.0
vllm:request_generation_tokens_count{model_name="smollm2"} 3.0
vllm:request_generation_tokens_sum{model_name="smollm2"} 90.0
"""
    assert parse_engine_metrics(text) == EngineSample(0.25, 3, 2, max_num_seqs=64, block_size=16, preemptions_total=7,
                                                      swap_outs_total=2, finished_total=3, prompt_tokens_total=300,
                                                      generation_tokens_total=90)


POD_A = {"metadata": {"name": "a"}, "status": {"podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}}
POD_B = {"metadata": {"name": "b"}, "status": {"podIP": "10.0.0.2", "conditions": [{"type": "Ready", "status": "False"}]}}
POD_C = {"metadata": {"name": "c"}, "status": {"podIP": "10.0.0.3", "conditions": [{"type": "Ready", "status": "True"}]}}


def test_scrape_reports_engines_that_fail_and_only_asks_ready_pods():
    ready = ready_pods([POD_A, POD_B, POD_C])
    assert ready == [("a", "10.0.0.1"), ("c", "10.0.0.3")]
    asked = []

    def fetch(url: str) -> str:
        asked.append(url)
        if "10.0.0.3" in url:
            raise ConnectionError("refused")
        return TEXT

    out = scrape(ready, 8000, fetch)
    assert out[0] == PodScrape("a", EngineSample(0.25, 3, 2))
    assert out[1].pod == "c" and out[1].sample is None and "ConnectionError: refused" in out[1].error
    assert sorted(asked) == ["http://10.0.0.1:8000/metrics", "http://10.0.0.3:8000/metrics"]


def test_one_stuck_pod_costs_the_timeout_not_the_pass():
    release = threading.Event()

    def fetch(url: str) -> str:
        if "10.0.0.3" in url:
            release.wait(30)          # hangs far longer than the scrape timeout
        return TEXT

    t0 = time.monotonic()
    out = scrape([("a", "10.0.0.1"), ("c", "10.0.0.3")] + [(f"p{i}", f"10.0.1.{i}") for i in range(20)], 8000, fetch,
                 timeout_s=0.3)
    took = time.monotonic() - t0
    release.set()
    assert took < 5, took
    by_pod = {s.pod: s for s in out}
    assert by_pod["c"].sample is None and "no answer within 0.3 s" in by_pod["c"].error
    assert all(by_pod[f"p{i}"].sample is not None for i in range(20)) and by_pod["a"].sample is not None


def test_observe_means_usage_sums_queues_and_takes_counter_increments_per_pod():
    s1 = EngineSample(0.5, 3, 4, max_num_seqs=8, block_size=16, preemptions_total=10, finished_total=100,
                      prompt_tokens_total=1000, generation_tokens_total=500)
    s2 = EngineSample(0.7, 1, 2, max_num_seqs=8, block_size=16, preemptions_total=5, finished_total=50)
    first, base = observe([PodScrape("a", s1), PodScrape("b", s2), PodScrape("c", None, "down")], {}, now=100.0)
    assert (first.engines, first.kv_cache_usage, first.waiting, first.running) == (2, 0.6, 4, 6)
    assert (first.max_num_seqs, first.block_size) == (8, 16)
    assert (first.preemptions, first.finished) == (0, 0)     # first sight of a pod: no history counted
    a2 = EngineSample(0.5, 0, 4, 8, 16, preemptions_total=12, finished_total=110, prompt_tokens_total=1300,
                      generation_tokens_total=600)
    b2 = EngineSample(0.1, 0, 0, 8, 16, preemptions_total=1, finished_total=3)   # restarted: counters went down
    d2 = EngineSample(0.2, 0, 0, 8, 16, preemptions_total=50, finished_total=500)  # new pod
    second, base2 = observe([PodScrape("a", a2), PodScrape("b", b2), PodScrape("d", d2)], base, now=115.0)
    assert second.time == 115.0 and second.engines == 3
    assert (second.preemptions, second.finished, second.prompt_tokens, second.generation_tokens) == (2, 10, 300, 100)
    assert set(base2) == {"a", "b", "d"}
    assert observe([PodScrape("a", None, "down")], base2, now=130.0) == (None, {})
