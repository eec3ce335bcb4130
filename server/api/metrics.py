"""Prometheus metrics of one served model, under vLLM's names so existing dashboards and alerts work.

Names, help, labels and buckets come from pagedmodel/metrics_contract.py (shared with the router's
scraper, the operator and the chart); this module only decides where each value comes from.

Scheduler gauges and the engine's cumulative token/cache/preemption counters are read from the last
`engine.stats()` snapshot at scrape time (a custom collector: the engine keeps the authoritative
totals, we never double count). Per-request latencies are observed on the engine loop thread from each
step's progress records (engine.step_progress: every request with news, whether or not an output was due,
so a non-streamed request's tokens count as they come): TTFT and queue time from their RequestMetrics,
inter-token latency from the time
between steps that gave a request new tokens, end-to-end latency, prefill and decode time and the finish
reason on completion. Tokens per step are the difference of the engine's cumulative token counters
between two steps (the engine counts; nothing is counted twice). A request's `n` and `max_tokens` are
observed when the engine accepts it (the parameters are fixed from then on).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from pagedmodel import metrics_contract as mc
from pagedmodel.server.engine.outputs import RequestProgress

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (contract metric, EngineStats attribute): read from the last stats snapshot at scrape time.
_GAUGES = (
    (mc.NUM_REQUESTS_RUNNING, "num_running"),
    (mc.NUM_REQUESTS_WAITING, "num_waiting"),
    (mc.NUM_REQUESTS_SWAPPED, "num_swapped"),
    (mc.KV_CACHE_USAGE, "kv_cache_usage"),
    (mc.GPU_CACHE_USAGE, "kv_cache_usage"),
    (mc.CPU_CACHE_USAGE, "cpu_cache_usage"),
    (mc.KV_BLOCKS_TOTAL, "num_blocks_total"),
    (mc.KV_BLOCKS_FREE, "num_blocks_free"),
    (mc.KV_FRAGMENTATION, "fragmentation"),
    (mc.MAX_NUM_SEQS, "max_num_seqs"),
    (mc.BLOCK_SIZE, "block_size"),
)
_COUNTERS = (
    (mc.PROMPT_TOKENS, "prompt_tokens_total"),
    (mc.GENERATION_TOKENS, "generation_tokens_total"),
    (mc.PREFIX_CACHE_QUERIES, "prefix_cache_queries_total"),
    (mc.PREFIX_CACHE_HITS, "prefix_cache_hits_total"),
    (mc.PROMPT_TOKENS_CACHED, "prefix_cache_hits_total"),   # vLLM's sum over cache tiers; we have one
    (mc.NUM_PREEMPTIONS, "num_preemptions_total"),
    (mc.NUM_SWAP_OUTS, "num_swap_outs_total"),
)


class _EngineStatsCollector(Collector):
    def __init__(self, model_name: str, get_stats: Callable[[], Any]):
        self.model_name = model_name
        self.get_stats = get_stats

    def collect(self) -> Iterable[Metric]:
        stats = self.get_stats()
        for defn, attr in _GAUGES:
            g = GaugeMetricFamily(defn.name, defn.help, labels=list(defn.labels))
            g.add_metric([self.model_name], float(getattr(stats, attr, 0) or 0) if stats is not None else 0.0)
            yield g
        for defn, attr in _COUNTERS:
            c = CounterMetricFamily(defn.name, defn.help, labels=list(defn.labels))
            c.add_metric([self.model_name], float(getattr(stats, attr, 0) or 0) if stats is not None else 0.0)
            yield c
        yield self._allocation_histogram(stats)
        if stats is not None and getattr(stats, "max_lora", 0):
            yield _lora_info(stats)

    def _allocation_histogram(self, stats: Any) -> Metric:
        """pagedmodel:kv_block_allocation_seconds from the engine's cumulative bucket counts.

        The engine counts (cumulatively, per edge of mc.ALLOCATION_BUCKETS, then +Inf) and this only
        renders, like the counters above: one owner of the totals. Before the first allocation the
        series is still there, all zero, so alerts and dashboards see it from the start.
        """
        defn = mc.KV_BLOCK_ALLOCATION
        counts = tuple(getattr(stats, "block_allocation_buckets", ()) or ()) if stats is not None else ()
        if not counts:
            counts = (0,) * (len(defn.buckets) + 1)
        if len(counts) != len(defn.buckets) + 1:
            raise ValueError(f"{defn.name}: the engine reported {len(counts)} bucket counts, the contract has "
                             f"{len(defn.buckets)} edges plus +Inf")
        total = float(getattr(stats, "block_allocation_seconds_sum", 0.0) or 0.0) if stats is not None else 0.0
        h = HistogramMetricFamily(defn.name, defn.help, labels=list(defn.labels))
        edges = [floatToGoString(e) for e in defn.buckets] + ["+Inf"]
        h.add_metric([self.model_name], list(zip(edges, (float(c) for c in counts))), sum_value=total)
        return h


def _lora_info(stats: Any) -> Metric:
    """vllm:lora_requests_info as vLLM exports it: one sample whose labels carry the adapters."""
    defn = mc.LORA_REQUESTS_INFO
    g = GaugeMetricFamily(defn.name, defn.help, labels=list(defn.labels))
    g.add_metric([str(stats.max_lora), ",".join(stats.waiting_lora_adapters), ",".join(stats.running_lora_adapters)],
                 time.time())
    return g


class ServerMetrics:
    """The metrics of one model server, in their own registry (tests run several servers per process)."""

    def __init__(self, model_name: str, get_stats: Callable[[], Any], registry: CollectorRegistry | None = None,
                 cache_config: dict[str, str] | None = None):
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry()
        self.registry.register(_EngineStatsCollector(model_name, get_stats))
        if cache_config is not None:
            info = mc.register(mc.CACHE_CONFIG_INFO, self.registry)
            info.labels(**{k: cache_config.get(k, "") for k in mc.CACHE_CONFIG_INFO.labels}).set(1)
        # process_start_time_seconds & co.: a new start time within one pod is a restart (an alert reads it)
        ProcessCollector(registry=self.registry)
        self.request_success = mc.register(mc.REQUEST_SUCCESS, self.registry)
        self.ttft = mc.register(mc.TTFT, self.registry)
        self.itl = mc.register(mc.ITL, self.registry)
        self.e2e = mc.register(mc.E2E_LATENCY, self.registry)
        self.queue_time = mc.register(mc.QUEUE_TIME, self.registry)
        self.prompt_tokens = mc.register(mc.REQUEST_PROMPT_TOKENS, self.registry)
        self.generation_tokens = mc.register(mc.REQUEST_GENERATION_TOKENS, self.registry)
        self.prefill_time = mc.register(mc.PREFILL_TIME, self.registry)
        self.decode_time = mc.register(mc.DECODE_TIME, self.registry)
        self.inference_time = mc.register(mc.INFERENCE_TIME, self.registry)
        self.request_tpot = mc.register(mc.REQUEST_TPOT, self.registry)
        self.iteration_tokens = mc.register(mc.ITERATION_TOKENS, self.registry)
        self.params_n = mc.register(mc.REQUEST_PARAMS_N, self.registry)
        self.params_max_tokens = mc.register(mc.REQUEST_PARAMS_MAX_TOKENS, self.registry)
        self._tokens_seen = 0.0   # the engine's prompt + generation total at the last step (0 at start)
        # request id -> time of its last token; ITL needs it. Only the engine loop thread touches it,
        # except on_abort which the loop thread also calls; the lock covers test-side reads.
        self._last_token_time: dict[str, float] = {}
        self._lock = threading.Lock()

    # ---- StepObserver (called on the engine loop thread)
    def on_submit(self, n: int, max_tokens: int) -> None:
        """An engine request the engine accepted, with its n and its (effective) max_tokens."""
        self.params_n.labels(self.model_name).observe(n)
        self.params_max_tokens.labels(self.model_name).observe(max_tokens)

    def _observe_iteration(self, stats: Any) -> None:
        if stats is None:
            return
        total = float(getattr(stats, "prompt_tokens_total", 0) or 0) + float(
            getattr(stats, "generation_tokens_total", 0) or 0)
        if total > self._tokens_seen:
            self.iteration_tokens.labels(self.model_name).observe(total - self._tokens_seen)
        self._tokens_seen = total

    def _observe_phases(self, metrics: Any, generated: int) -> None:
        """Prefill, decode and their sum; the per-request time per output token (of the longest sample)."""
        m = self.model_name
        first, sched, last = metrics.first_token_time, metrics.first_scheduled_time, metrics.last_token_time
        if first is not None and sched is not None:
            self.prefill_time.labels(m).observe(max(0.0, first - sched))
        if first is not None and last is not None:
            self.decode_time.labels(m).observe(max(0.0, last - first))
            if generated > 1:
                self.request_tpot.labels(m).observe(max(0.0, last - first) / (generated - 1))
        if sched is not None and last is not None:
            self.inference_time.labels(m).observe(max(0.0, last - sched))

    def on_step(self, progress: list[RequestProgress], stats: Any, now: float) -> None:
        m = self.model_name
        with self._lock:
            self._observe_iteration(stats)
            for out in progress:
                got_tokens = out.new_tokens > 0
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
                    self.prompt_tokens.labels(m).observe(out.num_prompt_tokens)
                    self.generation_tokens.labels(m).observe(sum(out.output_lengths))
                    self._observe_phases(out.metrics, max(out.output_lengths, default=0))
                    # One count per request, as vLLM does; n samples of one request share its reason.
                    reason = out.finish_reason or "stop"
                    self.request_success.labels(m, reason).inc()

    def on_abort(self, request_id: str) -> None:
        with self._lock:
            self._last_token_time.pop(request_id, None)
        self.request_success.labels(self.model_name, "abort").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
