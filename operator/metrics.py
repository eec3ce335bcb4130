"""Engine metrics for status and the KV% / WAITING printer columns: parse, aggregate (pure), scrape (I/O).

The engines export vLLM-named Prometheus gauges; the operator reads three of them from each ready pod
and reports the mean KV-cache usage and the summed queue lengths. A scrape that fails for every pod
keeps the last numbers and marks them stale rather than blanking the columns.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

from prometheus_client.parser import text_string_to_metric_families

KV_USAGE = "vllm:kv_cache_usage_perc"
WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"


@dataclass(frozen=True)
class EngineSample:
    kv_cache_usage: float      # 0-1
    waiting: int
    running: int


def parse_engine_metrics(text: str) -> EngineSample:
    """The three gauges from one engine's /metrics text (summed over label sets); ValueError if absent."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in (KV_USAGE, WAITING, RUNNING):
                values[sample.name] = values.get(sample.name, 0.0) + float(sample.value)
    missing = [n for n in (KV_USAGE, WAITING, RUNNING) if n not in values]
    if missing:
        raise ValueError(f"metrics lack {', '.join(missing)}")
    return EngineSample(min(1.0, max(0.0, values[KV_USAGE])), int(values[WAITING]), int(values[RUNNING]))


def aggregate(samples: list[EngineSample], previous: dict[str, Any] | None, now: str) -> dict[str, Any] | None:
    """status.metrics from this pass's samples; the previous block marked stale when none answered."""
    if not samples:
        if not previous:
            return None
        return {**previous, "stale": True}
    usage = sum(s.kv_cache_usage for s in samples) / len(samples)
    return {"kvCacheUsage": round(usage, 4), "kvCachePercent": int(round(usage * 100)),
            "waiting": sum(s.waiting for s in samples), "running": sum(s.running for s in samples),
            "scrapedAt": now, "stale": False}


def ready_pod_ips(pods: Iterable[dict[str, Any]]) -> list[str]:
    out = []
    for pod in pods:
        st = pod.get("status") or {}
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in st.get("conditions") or [])
        if ready and st.get("podIP") and not (pod.get("metadata") or {}).get("deletionTimestamp"):
            out.append(st["podIP"])
    return out


Fetch = Callable[[str], str]     # URL -> response text; raises on failure


def scrape(ips: list[str], port: int, fetch: Fetch) -> list[EngineSample]:
    """One sample per engine that answered with parseable metrics; the others are skipped."""
    samples = []
    for ip in ips:
        try:
            samples.append(parse_engine_metrics(fetch(f"http://{ip}:{port}/metrics")))
        except Exception:       # an engine restarting or overloaded must not fail the whole pass
            continue
    return samples


def http_fetch(url: str, timeout_s: float = 2.0) -> str:
    import httpx

    response = httpx.get(url, timeout=timeout_s)
    response.raise_for_status()
    return response.text
