"""--api-key on `pagedmodel serve`: every route the OpenAPI document lists (and any other path) answers
401 with the OpenAI error body without the right bearer key, except --auth-exempt (default: /health,
/ping, /metrics, what probes and Prometheus call, and /version); with the key the request goes through."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from pagedmodel.server.api.api_key import APIKeyMiddleware
from pagedmodel.server.http_common.api_key import key_matches, parse_exempt
from .conftest import API_KEY, ServerProcess

BAD_AUTH = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}, {"Authorization": f"Basic {API_KEY}"},
            {"Authorization": f"Bearer {API_KEY}x"}]


def test_every_documented_route_needs_the_key(api_server: ServerProcess) -> None:
    assert httpx.get(api_server.base_url + "/openapi.json", timeout=10).status_code == 401
    doc = httpx.get(api_server.base_url + "/openapi.json", headers=api_server.headers, timeout=10).json()
    routes = [(m.upper(), p) for p, item in doc["paths"].items() for m in item]
    assert ("GET", "/v1/kv_events") in routes and ("POST", "/tokenize") in routes and len(routes) >= 10
    exempt = {"/health", "/ping", "/metrics", "/version"}
    for method, path in routes + [("GET", "/no/such/path"), ("DELETE", "/v1/models")]:
        if path in exempt:
            continue
        for bad in BAD_AUTH:
            r = httpx.request(method, api_server.base_url + path, headers=bad, json={}, timeout=10)
            assert r.status_code == 401, (method, path, bad, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
    for path in exempt:
        assert httpx.get(api_server.base_url + path, timeout=10).status_code == 200
    r = httpx.get(api_server.base_url + "/v1/models", headers=api_server.headers, timeout=10)
    assert r.status_code == 200 and r.json()["data"]


def test_key_comparison() -> None:
    assert key_matches("Bearer k1", "k1") and key_matches("bearer  k1 ", "k1")
    assert not key_matches(None, "k1") and not key_matches("Bearer k", "k1") and not key_matches("k1", "k1")
    assert parse_exempt("") == () and parse_exempt("/health, /metrics") == ("/health", "/metrics")
    with pytest.raises(ValueError):
        parse_exempt("health")


def test_an_empty_exempt_list_guards_the_probes_too() -> None:
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def call(path: str, headers: dict[str, str]) -> int:
        transport = httpx.ASGITransport(app=APIKeyMiddleware(app, "k1", exempt=()))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            r = await c.get(path, headers=headers)
            if r.status_code == 401:
                assert json.loads(r.content)["error"]["type"] == "AuthenticationError"
            return r.status_code
    assert asyncio.run(call("/health", {})) == 401
    assert asyncio.run(call("/metrics", {})) == 401
    assert asyncio.run(call("/health", {"Authorization": "Bearer k1"})) == 200


def test_auth_exempt_is_decided_in_one_place(server_model_dir, tmp_path) -> None:
    """An exempt model route answers without the key (a route's own second check once refused it anyway),
    and a route left out of the list still needs it."""
    srv = ServerProcess(server_model_dir, tmp_path / "server.log", "--max-model-len", "128",
                        "--kv-cache-memory", str(4 << 20), "--auth-exempt", "/health,/v1/models",
                        api_key=API_KEY).wait_ready()
    try:
        r = httpx.get(srv.base_url + "/v1/models", timeout=10)
        assert r.status_code == 200 and r.json()["data"], r.text
        assert httpx.get(srv.base_url + "/metrics", timeout=10).status_code == 401   # no longer exempt
        assert httpx.get(srv.base_url + "/load", timeout=10).status_code == 401
    finally:
        srv.stop()
