"""Issue #8 on the e2e harness: a PagedModel with two engine replicas and `spec.router.rateLimit`, driven
over its public Service (which selects the router).

The operator runs as a real `pagedmodel operator --router enabled`; the router pod is a real `pagedmodel
router --discover ...` that finds the engine pods through the API with its service account's credentials;
the engines are real `pagedmodel serve` processes (SmolLM2-135M on CPU, as in examples/cpu-tiny.yaml).
An open-loop client offers OFFERED_RPS, well above the limit, for LOAD_S seconds with the `openai` SDK
(no retries). Expected: the global token bucket admits BURST at once and then RATE per second; every
other request is a 429 with Retry-After and an OpenAI error body; every admitted request completes in
full; both engines served some of them.
"""
from __future__ import annotations

import asyncio
import contextlib
import copy
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest
import yaml

from pagedmodel import metrics_contract as mc

from .helpers import wait_until
from .test_operator_pagedmodel import operator, pagedmodel_crd  # noqa: F401  (pagedmodel_crd: fixture)



REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "cpu-tiny.yaml"
NAME = "ratelimited"
ENGINES = 2
ENGINE_PORT = 8000          # the engine container's port named `http` (operator/names.py)

# Small enough for two CPU engines sharing two busy cores to keep up: each admitted request generates
# MAX_TOKENS tokens, so the engines see RATE requests/s while the router refuses the rest cheaply.
RATE = 2.0                  # spec.router.rateLimit.requestsPerSecond
BURST = 3                   # spec.router.rateLimit.burst (the bucket's size)
OFFERED_RPS = 10.0          # 5x the limit
LOAD_S = 10.0
MAX_TOKENS = 6
PROMPT = "The capital of France is"
# How far the router's view of the load window may differ from the client's: the first and the last
# request may each be delayed by scheduling on two shared cores (router event loop, client, kernel).
# One second of delay is generous next to the ~10 ms a request takes to reach the router when idle.
SCHEDULING_SLACK_S = 1.0


def manifest() -> str:
    """examples/cpu-tiny.yaml with two engines and a rate-limited router whose queue never refuses here."""
    pm = copy.deepcopy(yaml.safe_load(EXAMPLE.read_text()))
    pm["metadata"]["name"] = NAME
    pm["spec"]["replicas"] = ENGINES
    pm["spec"]["router"] = {"replicas": 1, "rateLimit": {"requestsPerSecond": RATE, "burst": BURST},
                            # Admitted requests must all complete: the queue holds every one the bucket can
                            # admit in the window, for longer than the slowest CPU generation takes.
                            "maxQueueLength": 64, "queueTimeoutSeconds": 120}
    return yaml.safe_dump(pm)


@contextlib.contextmanager
def pod_url(cluster, namespace: str, pod: dict[str, Any]) -> Iterator[str]:
    """Base URL of one engine pod through `kubectl port-forward` (the kubelet's streaming API)."""
    name = pod["metadata"]["name"]
    with cluster.kubectl_stream("port-forward", f"pod/{name}", f":{ENGINE_PORT}", namespace=namespace) as proc:
        assert proc.stdout is not None
        line = proc.stdout.readline()   # "Forwarding from 127.0.0.1:NNNNN -> 8000"
        yield f"http://127.0.0.1:{line.split('->')[0].strip().rsplit(':', 1)[-1]}"


def samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Every sample of one metric, keyed by its sorted labels."""
    return {tuple(sorted(s.labels.items())): s.value for s in mc.parse(text) if s.name == name}


def engine_pods(cluster, namespace: str) -> list[dict[str, Any]]:
    return cluster.kubectl_json("get", "pods", "-l", f"pagedmodel.io/name={NAME},app.kubernetes.io/component=engine",
                                namespace=namespace)["items"]


def engine_successes(cluster, namespace: str) -> dict[str, dict[str, float]]:
    """Finished requests per engine pod, by finish reason, from each engine's own /metrics."""
    out = {}
    for pod in engine_pods(cluster, namespace):
        with pod_url(cluster, namespace, pod) as url:
            text = httpx.get(f"{url}/metrics", timeout=30).text
        out[pod["metadata"]["name"]] = {dict(k)["finished_reason"]: v
                                        for k, v in samples(text, "vllm:request_success_total").items()}
    return out


@dataclass
class Outcome:
    sent_at: float                                  # monotonic time the request was sent
    completion: Any = None                          # the openai Completion when admitted (200)
    refusal: openai.RateLimitError | None = None    # when refused with 429
    error: BaseException | None = None              # anything else: a failure the test reports


@dataclass
class LoadResult:
    outcomes: list[Outcome] = field(default_factory=list)      # in send order

    @property
    def admitted(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.completion is not None]

    @property
    def refused(self) -> list[openai.RateLimitError]:
        return [o.refusal for o in self.outcomes if o.refusal is not None]

    @property
    def errors(self) -> list[BaseException]:
        return [o.error for o in self.outcomes if o.error is not None]


async def offer_load(base_url: str) -> LoadResult:
    """Open loop: one request every 1/OFFERED_RPS s for LOAD_S s, each its own task, whatever the replies."""
    result = LoadResult()
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0,
                                  timeout=180) as client:
        async def one() -> None:
            outcome = Outcome(time.monotonic())
            result.outcomes.append(outcome)
            try:
                outcome.completion = await client.completions.create(
                    model="smollm2", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                    extra_body={"ignore_eos": True})
            except openai.RateLimitError as exc:
                outcome.refusal = exc
            except Exception as exc:
                outcome.error = exc

        start = time.monotonic()
        tasks = []
        for i in range(int(OFFERED_RPS * LOAD_S)):
            await asyncio.sleep(max(0.0, start + i / OFFERED_RPS - time.monotonic()))
            tasks.append(asyncio.create_task(one()))
        await asyncio.gather(*tasks)
    return result


def router_metrics(url: str) -> str:
    return httpx.get(f"{url}/metrics", timeout=30).text


@pytest.mark.slow
def test_rate_limited_router_in_front_of_two_engines(cluster, namespace, pagedmodel_crd, tmp_path):
    log = tmp_path / "operator.log"
    with operator(cluster, namespace, log, router="enabled"):
        cluster.kubectl("apply", "-f", "-", stdin=manifest(), namespace=namespace)

        # Both engines Ready (the operator's phase), then the router Ready behind the public Service.

        def ready():
            st = cluster.kubectl_json("get", "pm", NAME, namespace=namespace).get("status") or {}
            return st if st.get("phase") == "Ready" and st.get("readyReplicas") == ENGINES else None
        wait_until(ready, timeout=300, interval=1, what=f"PagedModel {NAME} Ready with {ENGINES} engines")

        def router_ready():
            deployment = cluster.kubectl_json("get", "deployment", f"{NAME}-router", namespace=namespace)
            return deployment if (deployment.get("status") or {}).get("readyReplicas") == 1 else None
        router = wait_until(router_ready, timeout=120, interval=1, what="router Deployment ready")
        args = router["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--rate-limit") + 1] in ("2", "2.0") and args[args.index("--burst") + 1] == "3", args

        with cluster.service_url(namespace, NAME, 80) as url:
            # The router found both engines through the API (discovery from inside its pod).
            health = wait_until(lambda: (lambda h: h if h.get("upstreams_ready") == ENGINES else None)(
                httpx.get(f"{url}/health", timeout=10).json()), timeout=60, what="router discovered both engines")
            assert health["upstreams"] == ENGINES
            healthy = samples(router_metrics(url), "pagedmodel_router_upstream_healthy")
            assert len(healthy) == ENGINES and set(healthy.values()) == {1.0}, healthy
            pod_ips = sorted(p["status"]["podIP"] for p in engine_pods(cluster, namespace))
            assert sorted(dict(k)["upstream"].split("//")[1].rsplit(":", 1)[0] for k in healthy) == pod_ips

            # One request end to end first, then let the bucket refill to BURST before the measured load.
            with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
                first = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=MAX_TOKENS,
                                                  temperature=0, extra_body={"ignore_eos": True})
            assert first.choices[0].text.strip().startswith("Paris"), first
            time.sleep(BURST / RATE + 1.0)

            result = asyncio.run(offer_load(url))
            after = router_metrics(url)

        # Nothing but 200s and 429s.
        assert not result.errors, [repr(e) for e in result.errors[:5]]
        offered = int(OFFERED_RPS * LOAD_S)
        assert len(result.admitted) + len(result.refused) == offered

        # Admitted ≈ the bucket's burst plus its refill over the window the router saw.
        sent = [o.sent_at for o in result.outcomes]
        span = max(sent) - min(sent)
        expected = BURST + RATE * span
        tolerance = 1 + RATE * SCHEDULING_SLACK_S   # rounding to whole requests + both ends' scheduling delay
        print(f"offered {offered} in {span:.2f}s: admitted {len(result.admitted)} (expected {expected:.1f} "
              f"+- {tolerance:.0f}), refused {len(result.refused)}")
        assert abs(len(result.admitted) - expected) <= tolerance, (len(result.admitted), expected, span)
        # The burst passes at once: the first BURST requests (0.1 s apart) all find a full bucket.
        assert all(o.completion is not None for o in result.outcomes[:BURST]), result.outcomes[:BURST]
        # ...and after it the rate holds: the second half of the window admits RATE per second.
        middle = min(sent) + span / 2
        late = sum(1 for o in result.admitted if o.sent_at >= middle)
        assert abs(late - RATE * span / 2) <= tolerance, (late, RATE * span / 2)

        # Every refusal: 429, Retry-After in whole seconds (a token comes within 1/RATE s), OpenAI error body.
        for exc in result.refused:
            assert exc.status_code == 429
            retry_after = int(exc.response.headers["retry-after"])
            assert 1 <= retry_after <= math.ceil(1 / RATE), retry_after
            body = exc.response.json()["error"]
            assert set(body) >= {"message", "type", "param", "code"}, body
            assert body["code"] == "rate_limit_exceeded" and "rate limit" in body["message"]

        # Every admitted request completed in full.
        for completion in (o.completion for o in result.admitted):
            choice = completion.choices[0]
            assert choice.finish_reason == "length" and completion.usage.completion_tokens == MAX_TOKENS, completion
            assert choice.text.strip().startswith("Paris"), choice.text

        # The router counted exactly what the client saw (its one replica took all of it).
        codes = {dict(k)["code"]: v for k, v in samples(after, "pagedmodel_router_requests_total").items()}
        assert codes.get("429") == len(result.refused) and codes.get("200") == len(result.admitted) + 1, codes
        limited = {dict(k)["scope"]: v for k, v in samples(after, "pagedmodel_router_rate_limited_total").items()}
        assert limited == {"global": float(len(result.refused))}, limited

        # Both engines served traffic, and together exactly what the router admitted (+ the warm-up).
        served = engine_successes(cluster, namespace)
        assert len(served) == ENGINES
        for pod, reasons in served.items():
            assert sum(reasons.values()) > 0, (pod, served)
            assert reasons.get("abort", 0) == 0, (pod, served)
        assert sum(sum(r.values()) for r in served.values()) == len(result.admitted) + 1, served
    assert "Traceback" not in log.read_text(errors="replace"), log.read_text(errors="replace")[-4000:]
