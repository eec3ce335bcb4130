"""Engine metrics for status, the autoscaler and the tuner: parse and aggregate (pure), scrape (I/O).

Every ready engine pod exports vLLM-named Prometheus metrics. The operator reads, per pod, the load
gauges (KV usage, waiting, running), its configuration (max_num_seqs, block_size) and the counters whose
increments tell the tuner about memory thrash and the request-length mix. Pods are scraped
concurrently with a per-pod timeout, so one stuck engine costs at most that timeout, never the loop.
"""
from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from pagedmodel import metrics_contract as mc

from .observation import Observation

KV_USAGE = mc.KV_CACHE_USAGE.name
WAITING = mc.NUM_REQUESTS_WAITING.name
RUNNING = mc.NUM_REQUESTS_RUNNING.name
REQUIRED = (KV_USAGE, WAITING, RUNNING)
# sample name -> EngineSample field, for what is optional (older engines or other servers lack them)
OPTIONAL = {
    mc.MAX_NUM_SEQS.name: "max_num_seqs",
    mc.BLOCK_SIZE.name: "block_size",
    mc.NUM_PREEMPTIONS.series()[0]: "preemptions_total",
    mc.NUM_SWAP_OUTS.series()[0]: "swap_outs_total",
    mc.REQUEST_PROMPT_TOKENS.name + "_count": "finished_total",
    mc.REQUEST_PROMPT_TOKENS.name + "_sum": "prompt_tokens_total",
    mc.REQUEST_GENERATION_TOKENS.name + "_sum": "generation_tokens_total",
}
COUNTERS = ("preemptions_total", "swap_outs_total", "finished_total", "prompt_tokens_total", "generation_tokens_total")
SCRAPE_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class EngineSample:
    kv_cache_usage: float      # 0-1
    waiting: int
    running: int
    max_num_seqs: int = 0
    block_size: int = 0
    # cumulative counters since the engine started
    preemptions_total: float = 0.0
    swap_outs_total: float = 0.0
    finished_total: float = 0.0
    prompt_tokens_total: float = 0.0
    generation_tokens_total: float = 0.0


@dataclass(frozen=True)
class PodScrape:
    """One pod's answer in a pass: a sample, or why there is none."""

    pod: str
    sample: Any            # EngineSample, or whatever `parse` returned (a router's queue length); None: failed
    error: str = ""


def parse_engine_metrics(text: str) -> EngineSample:
    """One engine's /metrics text (values summed over label sets); ValueError if a load gauge is absent."""
    values = mc.sums(text, [*REQUIRED, *OPTIONAL])
    missing = [n for n in REQUIRED if n not in values]
    if missing:
        raise ValueError(f"metrics lack {', '.join(missing)}")
    extra: dict[str, Any] = {field: values[name] for name, field in OPTIONAL.items() if name in values}
    for field in ("max_num_seqs", "block_size"):
        if field in extra:
            extra[field] = int(extra[field])
    return EngineSample(min(1.0, max(0.0, values[KV_USAGE])), int(values[WAITING]), int(values[RUNNING]), **extra)


ROUTER_QUEUE = mc.ROUTER_QUEUE_LENGTH.name
ROUTER_ARRIVALS = mc.ROUTER_ARRIVAL_REQUESTS.name


@dataclass(frozen=True)
class RouterSample:
    queue: int                     # requests held in its queue (waiting for an engine slot or any engine)
    arrival_rate: float | None     # requests/s it admits; None from a router that does not export it


def parse_router_metrics(text: str) -> RouterSample:
    """One router's /metrics: its queue length (required) and its arrival rate."""
    values = mc.sums(text, [ROUTER_QUEUE, ROUTER_ARRIVALS])
    if ROUTER_QUEUE not in values:
        raise ValueError(f"metrics lack {ROUTER_QUEUE}")
    arrivals = values.get(ROUTER_ARRIVALS)
    return RouterSample(int(values[ROUTER_QUEUE]), max(0.0, arrivals) if arrivals is not None else None)


def router_totals(scrapes: list[PodScrape]) -> tuple[int | None, float, int]:
    """(queue, arrival rate, routers) over the routers of one pass. The queue is None when no router answered;
    the arrival rate counts only when every router answered with one (a partial sum would read as a drop in
    load), else routers is 0: no arrival signal this pass."""
    answers = [s.sample for s in scrapes if s.sample is not None]
    if not answers:
        return None, 0.0, 0
    queue = sum(a.queue for a in answers)
    rates = [a.arrival_rate for a in answers if a.arrival_rate is not None]
    if len(rates) != len(scrapes):
        return queue, 0.0, 0
    return queue, round(sum(rates), 6), len(rates)


def aggregate(samples: list[EngineSample], previous: dict[str, Any] | None, now: str) -> dict[str, Any] | None:
    """status.metrics from this pass's samples; the previous block marked stale when none answered."""
    if not samples:
        if not previous:
            return None
        return {**previous, "stale": True}
    usage = sum(s.kv_cache_usage for s in samples) / len(samples)
    return {"kvCacheUsage": round(usage, 4), "kvCachePercent": int(round(usage * 100)),
            "waiting": sum(s.waiting for s in samples), "running": sum(s.running for s in samples),
            "engines": len(samples), "scrapedAt": now, "stale": False}


def observe(scrapes: list[PodScrape], baselines: dict[str, EngineSample], now: float,
            router_queue: int | None = None, arrival_rate: float = 0.0,
            routers: int = 0) -> tuple[Observation | None, dict[str, EngineSample]]:
    """This pass as one Observation, and the counter baselines for the next pass.

    Counter increments are per pod against that pod's previous sample: a pod seen for the first time, or
    one whose counter went down (the engine restarted), contributes nothing this pass rather than its
    whole history. `router_queue` (requests held by the routers, None when no router answered) counts
    as waiting: the router caps each engine at its max_num_seqs and queues the rest itself, so under
    overload the engines' own queues stay short. With no engine answering, the router's queue alone
    is an observation of zero engines (what scaling up from zero reads). `arrival_rate` and `routers`
    (router_totals) pass through for the autoscaler's arrival signal.
    """
    samples = [(s.pod, s.sample) for s in scrapes if s.sample is not None]
    if not samples:
        if router_queue is None:
            return None, {}
        return Observation(time=now, engines=0, kv_cache_usage=0.0, waiting=router_queue, running=0,
                           arrival_rate=arrival_rate, routers=routers), {}
    increments = dict.fromkeys(COUNTERS, 0.0)
    for pod, sample in samples:
        before = baselines.get(pod)
        if before is None:
            continue
        for name in COUNTERS:
            delta = getattr(sample, name) - getattr(before, name)
            if delta > 0:
                increments[name] += delta
    engines = [s for _, s in samples]
    configured = [s.max_num_seqs for s in engines if s.max_num_seqs]
    blocks = [s.block_size for s in engines if s.block_size]
    obs = Observation(
        time=now, engines=len(engines),
        kv_cache_usage=round(sum(s.kv_cache_usage for s in engines) / len(engines), 4),
        waiting=sum(s.waiting for s in engines) + (router_queue or 0), running=sum(s.running for s in engines),
        # mid-rollout engines may differ: the smallest is what binds
        max_num_seqs=min(configured) if configured else 0, block_size=min(blocks) if blocks else 0,
        preemptions=increments["preemptions_total"], swap_outs=increments["swap_outs_total"],
        finished=increments["finished_total"], prompt_tokens=increments["prompt_tokens_total"],
        generation_tokens=increments["generation_tokens_total"], arrival_rate=arrival_rate, routers=routers)
    return obs, {pod: sample for pod, sample in samples}


def ready_pods(pods: Iterable[dict[str, Any]]) -> list[tuple[str, str]]:
    """(name, IP) of engine pods that pass readiness and are not being deleted."""
    out = []
    for pod in pods:
        st, meta = pod.get("status") or {}, pod.get("metadata") or {}
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in st.get("conditions") or [])
        if ready and st.get("podIP") and not meta.get("deletionTimestamp"):
            out.append((meta.get("name", st["podIP"]), st["podIP"]))
    return out


Fetch = Callable[[str], str]     # URL -> response text; raises on failure


def scrape(pods: list[tuple[str, str]], port: int, fetch: Fetch, timeout_s: float = SCRAPE_TIMEOUT_S,
           max_workers: int = 16, parse: Callable[[str], Any] = parse_engine_metrics) -> list[PodScrape]:
    """Every (name, IP) scraped concurrently; a pod that errs or outlasts timeout_s gets an error entry.

    `fetch` should enforce its own timeout too (http_fetch does); the deadline here bounds the pass even
    when it does not.
    """
    if not pods:
        return []

    def one(ip: str) -> Any:
        return parse(fetch(f"http://{ip}:{port}/metrics"))

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=min(max_workers, len(pods)),
                                                 thread_name_prefix="scrape")
    try:
        futures = {name: pool.submit(one, ip) for name, ip in pods}
        concurrent.futures.wait(futures.values(), timeout=timeout_s + 0.5)
        out = []
        for name, future in futures.items():
            if not future.done():
                out.append(PodScrape(name, None, f"no answer within {timeout_s:g} s"))
            elif future.exception() is not None:
                exc = future.exception()
                out.append(PodScrape(name, None, f"{type(exc).__name__}: {exc}"[:200]))
            else:
                out.append(PodScrape(name, future.result()))
        return out
    finally:
        pool.shutdown(wait=False, cancel_futures=True)   # a stuck fetch must not hold the pass


def http_fetch(url: str, timeout_s: float = SCRAPE_TIMEOUT_S) -> str:
    import httpx

    response = httpx.get(url, timeout=timeout_s)
    response.raise_for_status()
    return response.text

