"""schemathesis over the OpenAPI document of `pagedmodel serve` (GET /openapi.json, with the real request
schemas of openapi.py) against the engine and against `pagedmodel router` in front of it (the router
serves the engine's document: it proxies the same surface and adds nothing of its own).

Every operation gets schema-valid (positive) and schema-violating (negative) requests. Each answer must
be: never a 5xx; valid JSON (SSE: every event JSON or [DONE]; /metrics: Prometheus text); on 4xx the
OpenAI error body. Afterwards both servers are healthy, serve a completion, and hold no KV block.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable

from support import free_port, start_cli, stop_process, wait_healthy

schemathesis = pytest.importorskip("schemathesis")   # the test extra; absent only outside `.[test]` installs
from schemathesis import GenerationMode  # noqa: E402

KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "tiny-smol"
EXAMPLES = int(os.environ.get("PAGEDMODEL_FUZZ_EXAMPLES", "25"))   # per operation and mode
# An endless NDJSON subscription: its own tests drive it (tests/engine/test_kv_events.py, the router's).
SKIP = {("GET", "/v1/kv_events")}


@pytest.fixture(scope="module")
def servers(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    logs = tmp_path_factory.mktemp("fuzz")
    eport, rport = free_port(), free_port()
    urls = {"engine": f"http://127.0.0.1:{eport}", "router": f"http://127.0.0.1:{rport}"}
    engine = start_cli(["serve", "--model", str(tiny_llama_dir), "--device", "cpu", "--host", "127.0.0.1",
                     "--port", str(eport), "--max-model-len", "256", "--kv-cache-memory", str(8 << 20),
                     "--served-model-name", MODEL, "--api-key", KEY], logs / "engine.log")
    router = None
    try:
        wait_healthy(urls["engine"], engine, 180, logs / "engine.log")
        router = start_cli(["router", "--upstream", urls["engine"], "--host", "127.0.0.1", "--port", str(rport),
                         "--api-key", KEY], logs / "router.log")
        wait_healthy(urls["router"], router, 60, logs / "router.log")
        yield urls
    finally:
        if router is not None:
            stop_process(router)
        stop_process(engine)


def check_answer(status: int, ctype: str, content: bytes, label: str, cut_short: bool = False) -> None:
    """``cut_short``: schemathesis stopped reading an event stream after its first 20 events (it keeps only
    the complete ones), so that stream has no [DONE] to check."""
    assert status < 500, f"{label}: {status} {content[:500]!r}"
    if ctype.startswith("text/plain") and 200 <= status < 300:   # /metrics
        return
    if ctype.startswith("text/event-stream"):
        events = [e for e in content.decode().split("\n\n") if e.strip()]
        assert events and (cut_short or events[-1] == "data: [DONE]"), f"{label}: {content[-300:]!r}"
        for e in events[:-1] if events[-1] == "data: [DONE]" else events:
            assert e.startswith("data: "), f"{label}: {e!r}"
            json.loads(e[6:])
        return
    assert ctype.startswith("application/json"), f"{label}: {status} {ctype} {content[:300]!r}"
    body = json.loads(content)
    if status >= 400:
        assert isinstance(body, dict) and set(body.get("error", {})) == {"message", "type", "param", "code"}, \
            f"{label}: {status} {content[:300]!r}"


def fuzz(doc: dict, base_url: str) -> int:
    """Run every operation's positive and negative cases against base_url; returns the number of calls."""
    schema = schemathesis.openapi.from_dict(doc)
    calls = 0
    for result in schema.get_all_operations():
        op = result.ok()
        if (op.method.upper(), op.path) in SKIP:
            continue
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            label = f"{op.method.upper()} {op.path} ({mode.value})"

            @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode, headers=dict(AUTH)))
            def one(case) -> None:
                nonlocal calls
                resp = case.call(base_url=base_url, timeout=60)
                calls += 1
                ctype = (resp.headers.get("content-type") or [""])[0]
                check_answer(resp.status_code, ctype, resp.content, label, resp.stream_cut_short)
            try:
                one()
            except Unsatisfiable:
                assert mode is GenerationMode.NEGATIVE, label   # no parameters or body to violate (GET /health)
    return calls


def assert_still_serving(base_url: str, engine_url: str) -> None:
    assert httpx.get(base_url + "/health", timeout=10).status_code == 200
    r = httpx.post(base_url + "/v1/completions", headers=AUTH, timeout=60,
                   json={"model": MODEL, "prompt": "still alive", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    text = httpx.get(engine_url + "/metrics", timeout=10).text
    gauges = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(("pagedmodel:kv_cache_blocks_free", "pagedmodel:kv_cache_blocks_total",
                                  "vllm:num_requests_running"))}
    assert gauges["vllm:num_requests_running"] == 0
    assert gauges["pagedmodel:kv_cache_blocks_free"] == gauges["pagedmodel:kv_cache_blocks_total"] > 0


@pytest.fixture(scope="module")
def document(servers: dict[str, str]) -> dict:
    doc = httpx.get(servers["engine"] + "/openapi.json", headers=AUTH, timeout=10).json()
    ops = {(m.upper(), p) for p, item in doc["paths"].items() for m in item}
    # The document describes every route, with the real request schemas.
    assert {("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/tokenize"),
            ("POST", "/detokenize"), ("GET", "/v1/models"), ("GET", "/health"), ("GET", "/metrics")} <= ops
    body = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/CompletionRequest"}
    # prompt or prompt_embeds (vLLM's): neither is required alone, both are described
    assert {"prompt", "prompt_embeds"} <= set(doc["components"]["schemas"]["CompletionRequest"]["properties"])
    return doc


@pytest.mark.parametrize("target", ["engine", "router"])
def test_fuzzed_requests_get_json_answers_and_never_a_5xx(servers: dict[str, str], document: dict,
                                                           target: str) -> None:
    calls = fuzz(document, servers[target])
    assert calls >= EXAMPLES * 4   # the operations really ran
    assert_still_serving(servers[target], servers["engine"])


def test_router_serves_the_engines_document(servers: dict[str, str], document: dict) -> None:
    r = httpx.get(servers["router"] + "/openapi.json", headers=AUTH, timeout=10)
    assert r.status_code == 200 and r.json()["paths"].keys() == document["paths"].keys()
    assert httpx.get(servers["router"] + "/openapi.json", timeout=10).status_code == 401
