"""The metrics contract: every metric name the engine, the router and the operator export, its help
text, its labels and (for histograms) its bucket edges, and the one Prometheus-text parser.

Exporters build their collectors from these definitions and scrapers look samples up by these
names, so a rename happens here once. Engine names follow vLLM's (`vllm:*`) wherever vLLM has the
concept, so existing dashboards and alerts work; what vLLM lacks is `pagedmodel:*`. The chart's
alerts and dashboard are checked against `exported_series()` (tests/observability).

No torch and no server imports: the operator and the tests read this module alone.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families

Kind = Literal["gauge", "counter", "histogram"]
Program = Literal["engine", "router", "operator"]


@dataclass(frozen=True)
class MetricDef:
    """One exported metric. `name` is what prometheus_client is given: counters gain `_total`."""

    name: str
    kind: Kind
    help: str
    program: Program
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()

    def series(self) -> tuple[str, ...]:
        """The sample names this metric appears under in the exposition (what PromQL selects)."""
        if self.kind == "counter":
            return (self.name + "_total",)
        if self.kind == "histogram":
            return (self.name + "_bucket", self.name + "_sum", self.name + "_count")
        return (self.name,)


# Bucket edges (seconds) spanning a fast GPU decode step to a long CPU request.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.75, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 300.0)
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0)
# Token-count buckets: the tuner reads the request-length mix from these.
TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
# Block allocation is host bookkeeping (microseconds); 0.05 is an edge because the alert's threshold is 50 ms.
ALLOCATION_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
ROUTER_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# vLLM's edges for tokens per engine step, and for a request's n
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
MAX_TOKENS_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
RECONCILE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

_M = ("model_name",)


def _engine(name: str, kind: Kind, help: str, labels: tuple[str, ...] = _M,
            buckets: tuple[float, ...] = ()) -> MetricDef:
    return MetricDef(name, kind, help, "engine", labels, buckets)


# ---- engine (server/api/metrics.py exports these)
NUM_REQUESTS_RUNNING = _engine("vllm:num_requests_running", "gauge", "Requests in the running batch.")
NUM_REQUESTS_WAITING = _engine("vllm:num_requests_waiting", "gauge", "Requests waiting to be scheduled.")
NUM_REQUESTS_SWAPPED = _engine("vllm:num_requests_swapped", "gauge",
                               "Requests whose KV blocks are swapped out to CPU.")
KV_CACHE_USAGE = _engine("vllm:kv_cache_usage_perc", "gauge", "Share of KV cache blocks in use (0-1).")
GPU_CACHE_USAGE = _engine("vllm:gpu_cache_usage_perc", "gauge",
                          "Share of KV cache blocks in use (0-1); older name.")
CPU_CACHE_USAGE = _engine("vllm:cpu_cache_usage_perc", "gauge", "Share of CPU swap blocks in use (0-1).")
KV_BLOCKS_TOTAL = _engine("pagedmodel:kv_cache_blocks_total", "gauge", "KV cache blocks in the pool.")
KV_BLOCKS_FREE = _engine("pagedmodel:kv_cache_blocks_free", "gauge", "KV cache blocks not held by any request.")
KV_FRAGMENTATION = _engine("pagedmodel:kv_cache_fragmentation", "gauge",
                           "Share of allocated KV slots holding no token.")
MAX_NUM_SEQS = _engine("pagedmodel:max_num_seqs", "gauge", "The engine's --max-num-seqs (running-batch slots).")
BLOCK_SIZE = _engine("pagedmodel:block_size", "gauge", "The engine's --block-size (tokens per KV block).")
PROMPT_TOKENS = _engine("vllm:prompt_tokens", "counter", "Prompt tokens processed (prefilled).")
GENERATION_TOKENS = _engine("vllm:generation_tokens", "counter", "Tokens generated.")
PREFIX_CACHE_QUERIES = _engine("vllm:prefix_cache_queries", "counter",
                               "Prompt tokens looked up in the prefix cache.")
PREFIX_CACHE_HITS = _engine("vllm:prefix_cache_hits", "counter", "Prompt tokens found in the prefix cache.")
PROMPT_TOKENS_CACHED = _engine("vllm:prompt_tokens_cached", "counter",
                               "Prompt tokens served from the prefix cache (this engine has no external tier).")
NUM_PREEMPTIONS = _engine("vllm:num_preemptions", "counter", "Sequence preemptions (swap or recompute).")
NUM_SWAP_OUTS = _engine("pagedmodel:num_swap_outs", "counter",
                        "Sequences whose KV blocks were swapped out to CPU.")
REQUEST_SUCCESS = _engine("vllm:request_success", "counter",
                          "Finished requests, by finish reason (stop, length, abort).", _M + ("finished_reason",))
TTFT = _engine("vllm:time_to_first_token_seconds", "histogram", "Time from arrival to the first generated token.",
               buckets=TTFT_BUCKETS)
ITL = _engine("vllm:inter_token_latency_seconds", "histogram", "Time between consecutive tokens of a request.",
              buckets=ITL_BUCKETS)
E2E_LATENCY = _engine("vllm:e2e_request_latency_seconds", "histogram", "Time from arrival to the last token.",
                      buckets=REQUEST_BUCKETS)
QUEUE_TIME = _engine("vllm:request_queue_time_seconds", "histogram", "Time from arrival to first scheduling.",
                     buckets=REQUEST_BUCKETS)
REQUEST_PROMPT_TOKENS = _engine("vllm:request_prompt_tokens", "histogram",
                                "Prompt length of finished requests, in tokens.", buckets=TOKEN_BUCKETS)
REQUEST_GENERATION_TOKENS = _engine("vllm:request_generation_tokens", "histogram",
                                    "Tokens generated per finished request (all samples).", buckets=TOKEN_BUCKETS)
PREFILL_TIME = _engine("vllm:request_prefill_time_seconds", "histogram",
                        "Time from first scheduling to the first generated token (the prefill phase).",
                        buckets=REQUEST_BUCKETS)
DECODE_TIME = _engine("vllm:request_decode_time_seconds", "histogram",
                      "Time from the first generated token to the last (the decode phase).", buckets=REQUEST_BUCKETS)
INFERENCE_TIME = _engine("vllm:request_inference_time_seconds", "histogram",
                         "Time from first scheduling to the last token (prefill plus decode).",
                         buckets=REQUEST_BUCKETS)
REQUEST_TPOT = _engine("vllm:request_time_per_output_token_seconds", "histogram",
                       "Per finished request: its decode time over its generated tokens after the first.",
                       buckets=ITL_BUCKETS)
ITERATION_TOKENS = _engine("vllm:iteration_tokens_total", "histogram",
                           "Tokens processed (prefilled plus generated) per engine step.",
                           buckets=ITERATION_TOKEN_BUCKETS)
REQUEST_PARAMS_N = _engine("vllm:request_params_n", "histogram", "The n parameter of finished requests.",
                           buckets=PARAMS_N_BUCKETS)
REQUEST_PARAMS_MAX_TOKENS = _engine("vllm:request_params_max_tokens", "histogram",
                                    "The max_tokens parameter of finished requests.", buckets=MAX_TOKENS_BUCKETS)
# An info-style gauge (always 1): the Gateway API Inference Extension reads block_size from its labels.
CACHE_CONFIG_INFO = _engine("vllm:cache_config_info", "gauge", "Information of the KV cache configuration.",
                            ("block_size", "cache_dtype", "num_gpu_blocks", "num_cpu_blocks", "swap_space",
                             "enable_prefix_caching", "gpu_memory_utilization"))
# vLLM's LoRA info gauge (value: the time of the last update), exported with --enable-lora; the Gateway API
# Inference Extension reads the adapters resident on each replica from its labels (comma-separated names).
LORA_REQUESTS_INFO = _engine("vllm:lora_requests_info", "gauge", "Running stats on lora requests.",
                             ("max_lora", "waiting_lora_adapters", "running_lora_adapters"))
# vLLM has no block-allocation timing; the alert on slow allocation needs one.
KV_BLOCK_ALLOCATION = _engine("pagedmodel:kv_block_allocation_seconds", "histogram",
                              "Time the block manager took to allocate KV blocks for one sequence group.",
                              buckets=ALLOCATION_BUCKETS)
# prometheus_client's ProcessCollector: a change of start time within one pod is a container restart.
PROCESS_START_TIME = MetricDef("process_start_time_seconds", "gauge",
                               "Start time of the process since unix epoch in seconds.", "engine")


def _router(name: str, kind: Kind, help: str, labels: tuple[str, ...] = (),
            buckets: tuple[float, ...] = ()) -> MetricDef:
    return MetricDef(name, kind, help, "router", labels, buckets)


# ---- router (server/router/metrics.py exports these)
ROUTER_REQUESTS = _router("pagedmodel_router_requests", "counter", "Requests answered by the router, by HTTP status.",
                          ("code",))
ROUTER_QUEUE_LENGTH = _router("pagedmodel_router_queue_length", "gauge", "Requests waiting in the router queue.")
ROUTER_RATE_LIMITED = _router("pagedmodel_router_rate_limited", "counter", "Requests refused with 429.", ("scope",))
ROUTER_UPSTREAM_INFLIGHT = _router("pagedmodel_router_upstream_inflight", "gauge",
                                   "Requests open to each upstream.", ("upstream",))
ROUTER_UPSTREAM_PENDING_PREFILL = _router("pagedmodel_router_upstream_pending_prefill_tokens", "gauge",
                                          "Uncached prompt tokens of requests sent to each upstream that have not yet "
                                          "returned a token (prefix-cache strategy).", ("upstream",))
ROUTER_UPSTREAM_LATENCY = _router("pagedmodel_router_upstream_latency_seconds", "histogram",
                                  "Time from sending a request upstream to its last response byte.", ("upstream",),
                                  ROUTER_LATENCY_BUCKETS)
ROUTER_QUEUE_TIME = _router("pagedmodel_router_queue_time_seconds", "histogram", "Time requests waited in the queue.",
                            buckets=ROUTER_LATENCY_BUCKETS)
ROUTER_UPSTREAM_HEALTHY = _router("pagedmodel_router_upstream_healthy", "gauge",
                                  "1 when the upstream is in rotation, 0 ejected.", ("upstream",))
ROUTER_RETRIES = _router("pagedmodel_router_retries", "counter",
                         "Requests re-sent to another upstream after a connection failure.")
# adapter affinity (server/router/adapter_affinity.py): outcome hit, free_slot, no_slot, unverified, not_served
ROUTER_ADAPTER_ROUTING = _router("pagedmodel_router_adapter_routing", "counter",
                                 "Requests naming a LoRA adapter, by where the router sent them (hit: where it was "
                                 "resident; free_slot / no_slot: where it had to be loaded) or not_served (404).",
                                 ("outcome",))
# what a soak watches for leaks (benchmarks/soak.py): these must return to their idle level
ROUTER_CLIENT_CONNECTIONS = _router("pagedmodel_router_client_connections", "gauge",
                                    "Open client connections to the router.")
ROUTER_UPSTREAM_CONNECTIONS = _router("pagedmodel_router_upstream_connections", "gauge",
                                      "Connections from the router to upstreams, by state (in_use, idle: pooled "
                                      "keep-alive).", ("state",))
ROUTER_ASYNCIO_TASKS = _router("pagedmodel_router_asyncio_tasks", "gauge", "asyncio tasks alive in the router.")
# tenant limits and fair queueing (server/router/token_limits.py); the tenant label is capped (rest: "other")
ROUTER_TENANT_REQUESTS = _router("pagedmodel_router_tenant_requests", "counter",
                                 "Requests per tenant at the token limits, by outcome (admitted, rejected).",
                                 ("tenant", "outcome"))
ROUTER_TENANT_TOKENS = _router("pagedmodel_router_tenant_tokens", "counter",
                               "Tokens per tenant: reserved at admission (admitted, rejected), then used.",
                               ("tenant", "outcome"))
# arrival rates for the autoscaler (operator/scrape.py reads them), exponentially weighted over 10 s
ROUTER_ARRIVAL_REQUESTS = _router("pagedmodel_router_arrival_requests_per_second", "gauge",
                                  "Requests admitted per second (exponentially weighted, 10 s).")
ROUTER_ARRIVAL_TOKENS = _router("pagedmodel_router_arrival_tokens_per_second", "gauge",
                                "Tokens reserved by admitted requests per second (exponentially weighted, 10 s).")


def _operator(name: str, kind: Kind, help: str, labels: tuple[str, ...] = ("namespace", "pagedmodel"),
              buckets: tuple[float, ...] = ()) -> MetricDef:
    return MetricDef(name, kind, help, "operator", labels, buckets)


# ---- operator (operator/telemetry.py exports these); labels name the PagedModel, not the operator pod
RECONCILE_PASSES = _operator("pagedmodel_operator_reconcile_passes", "counter",
                             "Reconcile passes run, by outcome (ok, error).", ("namespace", "pagedmodel", "outcome"))
RECONCILE_DURATION = _operator("pagedmodel_operator_reconcile_duration_seconds", "histogram",
                               "Wall time of one reconcile pass.", buckets=RECONCILE_BUCKETS)
RECONCILE_ERRORS = _operator("pagedmodel_operator_errors", "counter",
                             "Reconcile passes that failed, by kind of error.", ("namespace", "pagedmodel", "kind"))
SCALE_DECISIONS = _operator("pagedmodel_operator_scale_decisions", "counter",
                            "Autoscaler decisions, by direction (up, down, hold) and reason.",
                            ("namespace", "pagedmodel", "direction", "reason"))
TUNER_EVENTS = _operator("pagedmodel_operator_tuner_events", "counter",
                         "Tuner proposals, applied changes and reverts, by action.",
                         ("namespace", "pagedmodel", "action"))
SCRAPE_FAILURES = _operator("pagedmodel_operator_scrape_failures", "counter",
                            "Engine or router pods whose /metrics could not be read in a pass.",
                            ("namespace", "pagedmodel", "pod"))
DESIRED_REPLICAS = _operator("pagedmodel_operator_desired_replicas", "gauge",
                             "Engine replicas the operator wants.")
READY_REPLICAS = _operator("pagedmodel_operator_ready_replicas", "gauge", "Engine replicas passing readiness.")
MAX_REPLICAS = _operator("pagedmodel_operator_max_replicas", "gauge",
                         "The autoscaler's maxReplicas (the replicas when autoscaling is off).")
SCALING_LIMITED = _operator("pagedmodel_operator_scaling_limited", "gauge",
                            "1 while the autoscaler wants more engines than maxReplicas allows.")

# Fixed label values: a metric's cardinality must not depend on free text.
ERROR_KINDS = ("invalid_spec", "kubernetes_api", "internal")
SCALE_DIRECTIONS = ("up", "down", "hold")
SCALE_REASONS = ("kv_cache", "waiting", "idle", "bounds", "stabilizing", "no_metrics", "steady", "arrival_rate")
TUNER_ACTIONS = ("proposed", "applied", "reverted")

ALL: tuple[MetricDef, ...] = tuple(v for v in globals().values() if isinstance(v, MetricDef))


def of(program: Program) -> tuple[MetricDef, ...]:
    return tuple(m for m in ALL if m.program == program)


def exported_series(programs: Iterable[Program] = ("engine", "router", "operator")) -> frozenset[str]:
    """Every sample name the given programs export (counters with `_total`, histograms' three series)."""
    wanted = set(programs)
    return frozenset(s for m in ALL if m.program in wanted for s in m.series())


def register(metric: MetricDef, registry: CollectorRegistry) -> Counter | Gauge | Histogram:
    """The prometheus_client collector for `metric`, registered in `registry`."""
    labels = list(metric.labels)
    if metric.kind == "counter":
        return Counter(metric.name, metric.help, labels, registry=registry)
    if metric.kind == "gauge":
        return Gauge(metric.name, metric.help, labels, registry=registry)
    return Histogram(metric.name, metric.help, labels, buckets=metric.buckets, registry=registry)


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def parse(text: str) -> list[Sample]:
    """Every sample of a Prometheus text exposition; ValueError (with the parser's reason) if malformed."""
    try:
        return [Sample(s.name, dict(s.labels), float(s.value))
                for family in text_string_to_metric_families(text) for s in family.samples]
    except ValueError as exc:
        raise ValueError(f"not Prometheus text: {exc}") from exc


def sums(text: str, names: Iterable[str]) -> dict[str, float]:
    """{sample name: value summed over its label sets} for the wanted names present in `text`.

    Summing is what every scraper here needs: an engine serves one model, so its `model_name` label
    sets are one series; a router's gauges carry no labels.
    """
    wanted = set(names)
    out: dict[str, float] = {}
    for s in parse(text):
        if s.name in wanted:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out
