"""Prometheus metrics of one served model, under vLLM's names so existing dashboards and alerts work.

Scheduler gauges and the engine's cumulative token/cache/preemption counters are read from the last
`engine.stats()` snapshot at scrape time (a custom collector: the engine keeps the authoritative
totals, we never double count). Per-request latencies are observed on the engine loop thread as
outputs arrive: TTFT and queue time from RequestOutput.metrics, inter-token latency from the time
between steps that gave a request new tokens, end-to-end latency and the finish reason on completion.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedmodel.server.engine.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Bucket edges (seconds) spanning a fast GPU decode step to a long CPU request.
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.75, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 300.0)
_ITL_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0)
# Token-count buckets: the tuner reads the request-length mix from these.
_TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
_REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)

# (metric name, EngineStats attribute, help)
_GAUGES = (
    ("vllm:num_requests_running", "num_running", "Requests in the running batch."),
    ("vllm:num_requests_waiting", "num_waiting", "Requests waiting to be scheduled."),
    ("vllm:num_requests_swapped", "num_swapped", "Requests whose KV blocks are swapped out to CPU."),
    ("vllm:kv_cache_usage_perc", "kv_cache_usage", "Share of KV cache blocks in use (0-1)."),
    ("vllm:gpu_cache_usage_perc", "kv_cache_usage", "Share of KV cache blocks in use (0-1); older name."),
    ("vllm:cpu_cache_usage_perc", "cpu_cache_usage", "Share of CPU swap blocks in use (0-1)."),
    ("pagedmodel:kv_cache_blocks_total", "num_blocks_total", "KV cache blocks in the pool."),
    ("pagedmodel:kv_cache_blocks_free", "num_blocks_free", "KV cache blocks not held by any request."),
    ("pagedmodel:kv_cache_fragmentation", "fragmentation", "Share of allocated KV slots holding no token."),
    ("pagedmodel:max_num_seqs", "max_num_seqs", "The engine's --max-num-seqs (running-batch slots)."),
    ("pagedmodel:block_size", "block_size", "The engine's --block-size (tokens per KV block)."),
)
# Names without the _total suffix: prometheus-client appends it to counters.
_COUNTERS = (
    ("vllm:prompt_tokens", "prompt_tokens_total", "Prompt tokens processed (prefilled)."),
    ("vllm:generation_tokens", "generation_tokens_total", "Tokens generated."),
    ("vllm:prefix_cache_queries", "prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache."),
    ("vllm:prefix_cache_hits", "prefix_cache_hits_total", "Prompt tokens found in the prefix cache."),
    ("vllm:num_preemptions", "num_preemptions_total", "Sequence preemptions (swap or recompute)."),
    ("pagedmodel:num_swap_outs", "num_swap_outs_total", "Sequences whose KV blocks were swapped out to CPU."),
)


class _EngineStatsCollector(Collector):
    def __init__(self, model_name: str, get_stats: Callable[[], Any]):
        self.model_name = model_name
        self.get_stats = get_stats

    def collect(self) -> Iterable[Metric]:
        stats = self.get_stats()
        for name, attr, doc in _GAUGES:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([self.model_name], float(getattr(stats, attr, 0) or 0) if stats is not None else 0.0)
            yield g
        for name, attr, doc in _COUNTERS:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([self.model_name], float(getattr(stats, attr, 0) or 0) if stats is not None else 0.0)
            yield c


class ServerMetrics:
    """The metrics of one model server, in their own registry (tests run several servers per process)."""

    def __init__(self, model_name: str, get_stats: Callable[[], Any], registry: CollectorRegistry | None = None):
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry()
        self.registry.register(_EngineStatsCollector(model_name, get_stats))
        labels = ["model_name"]
        self.request_success = Counter(
            "vllm:request_success", "Finished requests, by finish reason (stop, length, abort).",
            labels + ["finished_reason"], registry=self.registry)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time from arrival to the first generated token.",
                              labels, buckets=_TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between consecutive tokens of a request.",
                             labels, buckets=_ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Time from arrival to the last token.",
                             labels, buckets=_REQUEST_BUCKETS, registry=self.registry)
        self.queue_time = Histogram("vllm:request_queue_time_seconds", "Time from arrival to first scheduling.",
                                    labels, buckets=_REQUEST_BUCKETS, registry=self.registry)
        self.prompt_tokens = Histogram("vllm:request_prompt_tokens", "Prompt length of finished requests, in tokens.",
                                       labels, buckets=_TOKEN_BUCKETS, registry=self.registry)
        self.generation_tokens = Histogram(
            "vllm:request_generation_tokens", "Tokens generated per finished request (all samples).",
            labels, buckets=_TOKEN_BUCKETS, registry=self.registry)
        # request id -> time of its last token; ITL needs it. Only the engine loop thread touches it,
        # except on_abort which the loop thread also calls; the lock covers test-side reads.
        self._last_token_time: dict[str, float] = {}
        self._lock = threading.Lock()

    # ---- StepObserver (called on the engine loop thread)
    def on_step(self, outputs: list[RequestOutput], stats: Any, now: float) -> None:
        m = self.model_name
        with self._lock:
            for out in outputs:
                got_tokens = any(out.new_token_counts) if out.new_token_counts else any(o.token_ids for o in out.outputs)
                prev = self._last_token_time.get(out.request_id)
                if got_tokens:
                    if prev is None:
                        ttft = out.metrics.time_to_first_token
                        self.ttft.labels(m).observe(max(0.0, ttft if ttft is not None else now - out.metrics.arrival_time))
                    else:
                        self.itl.labels(m).observe(max(0.0, now - prev))
                    self._last_token_time[out.request_id] = now
                if out.finished:
                    self._last_token_time.pop(out.request_id, None)
                    e2e = out.metrics.e2e_latency
                    self.e2e.labels(m).observe(max(0.0, e2e if e2e is not None else now - out.metrics.arrival_time))
                    q = out.metrics.queue_time
                    if q is not None:
                        self.queue_time.labels(m).observe(max(0.0, q))
                    self.prompt_tokens.labels(m).observe(len(out.prompt_token_ids or ()))
                    self.generation_tokens.labels(m).observe(sum(len(o.token_ids) for o in out.outputs))
                    # One count per request, as vLLM does; n samples of one request share its reason.
                    reason = (out.outputs[0].finish_reason if out.outputs else None) or "stop"
                    self.request_success.labels(m, reason).inc()

    def on_abort(self, request_id: str) -> None:
        with self._lock:
            self._last_token_time.pop(request_id, None)
        self.request_success.labels(self.model_name, "abort").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
