"""Per-tenant request and token limits: the pure limiter on a fake clock, then the router over HTTP."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from fakes import FakeClock, FakeUpstream, running_router
from pagedmodel.server.router.app import add_arguments, config_from_args
from pagedmodel.server.router.arrival_rate import ArrivalRate
from pagedmodel.server.router.metrics import RouterMetrics, TenantLabels
from pagedmodel.server.router.queue import AdmissionQueue
from pagedmodel.server.router.tenancy import Admission, Tenancy
from pagedmodel.server.router.token_limits import (
    ANONYMOUS, Limits, TenantLimiter, completion_budget, estimate_prompt_tokens, go_duration, parse_tenant_limit,
    reservation)
from pagedmodel.server.router.usage import UsageMeter


# ---- pure logic

def test_openai_duration_format():
    assert [go_duration(s) for s in (0, 0.012, 0.9996, 1, 1.5, 60, 360, 3723.5)] == [
        "0s", "12ms", "1s", "1s", "1.5s", "1m0s", "6m0s", "1h2m3.5s"]


def test_prompt_estimate_and_reservation():
    assert estimate_prompt_tokens({"prompt": [1, 2, 3]}) == 3                       # token ids: exact
    assert estimate_prompt_tokens({"prompt": "x" * 40}) == 10                       # characters / 4
    chat = {"messages": [{"role": "user", "content": "y" * 8},
                         {"role": "user", "content": [{"type": "text", "text": "z" * 8}]}]}
    assert estimate_prompt_tokens(chat) == 4 + 2 * 4                                # + template per message
    assert completion_budget({"max_tokens": 50, "n": 2}, 256) == 100
    assert completion_budget({"max_completion_tokens": 7, "max_tokens": 50}, 256) == 7
    assert completion_budget({}, 256) == 256
    assert completion_budget({"prompt": ["a", "b", "c"], "max_tokens": 10}, 256) == 30     # a batch of prompts
    assert estimate_prompt_tokens({"prompt": [[1, 2], [3]]}) == 3
    assert reservation({"prompt": "x" * 40, "max_tokens": 5}, 256) == 15


def test_token_bucket_refuses_then_refills_and_settles_by_usage():
    clock = FakeClock()
    lim = TenantLimiter(Limits(tokens_per_minute=600), clock=clock)
    assert lim.admit("a", 500).allowed
    refused = lim.admit("a", 200)
    assert not refused.allowed and refused.scope == "tokens"
    assert refused.retry_after == 10        # 100 missing at 10 tokens/s
    assert refused.headers["x-ratelimit-remaining-tokens"] == "100"
    assert refused.headers["x-ratelimit-limit-tokens"] == "600"
    assert refused.headers["x-ratelimit-reset-tokens"] == "50s"
    lim.settle("a", 500, 100)               # used far less than reserved: refunded at once
    assert lim.admit("a", 200).allowed
    other = lim.admit("b", 600)             # tenants are independent
    assert other.allowed and other.headers["x-ratelimit-remaining-tokens"] == "0"
    clock.advance(60)
    assert lim.admit("b", 600).allowed


def test_usage_over_the_reservation_becomes_debt():
    clock = FakeClock()
    lim = TenantLimiter(Limits(tokens_per_minute=600), clock=clock)
    assert lim.admit("a", 100).allowed
    lim.settle("a", 100, 700)               # level 600 - 700 = -100
    assert lim.admit("a", 100).retry_after == 20
    clock.advance(20)
    assert lim.admit("a", 100).allowed


def test_request_limit_and_oversized_request():
    clock = FakeClock()
    lim = TenantLimiter(Limits(requests_per_minute=2, tokens_per_minute=1000), clock=clock)
    assert lim.admit("a", 10).allowed and lim.admit("a", 10).allowed
    refused = lim.admit("a", 10)
    assert (refused.allowed, refused.scope, refused.retry_after) == (False, "requests", 30)
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    huge = lim.admit("b", 5000)
    assert not huge.allowed and huge.param == "max_tokens" and "5000" in huge.message
    lim.cancel("a", 10)                     # a request the queue refused gives its request back
    assert lim.admit("a", 10).allowed


def test_overrides_tenant_naming_and_bounded_tracking():
    clock = FakeClock()
    lim = TenantLimiter(Limits(requests_per_minute=1), overrides={"vip": Limits(requests_per_minute=100)},
                        header="X-Tenant", max_tenants=2, clock=clock)
    assert lim.tenant({"x-tenant": "vip"}) == "vip"
    key = lim.tenant({"Authorization": "Bearer sk-secret"})
    assert key.startswith("key-") and "secret" not in key      # API keys never become label values
    assert lim.tenant({}) == ANONYMOUS
    assert all(lim.admit("vip", 1).allowed for _ in range(50))
    for name in ("t1", "t2", "t3"):
        lim.admit(name, 1)
    assert lim.tracked_tenants == 2


def test_parse_tenant_limit():
    assert parse_tenant_limit("acme:requests=60,tokens=1000") == ("acme", Limits(60, 1000))
    assert parse_tenant_limit("a:b:tokens=5") == ("a:b", Limits(None, 5))
    for bad in ("acme", "acme:tokens=x", "acme:tpm=5", ":tokens=5", "acme:tokens=-1"):
        with pytest.raises(ValueError):
            parse_tenant_limit(bad)


def test_usage_meter_reads_stated_usage_or_counts_stream_events():
    body = json.dumps({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}})
    m = UsageMeter(streamed=False)
    for i in range(0, len(body), 5):
        m.feed(body[i:i + 5].encode())
    m.finish()
    assert m.used(100) == 7
    events = [{"choices": [{"delta": {"content": "a"}}]}, {"choices": [{"delta": {"content": "b"}}]},
              {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}]
    sse = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    m = UsageMeter(streamed=True)
    m.feed(sse[:17])
    m.feed(sse[17:])
    m.finish()
    assert m.used(100) == 5 and m.text_events == 2
    m = UsageMeter(streamed=True)
    m.feed(sse.split(b"data: {\"choices\": [], \"usage")[0])   # no usage chunk: prompt estimate + events
    assert m.used(100) == 102
    assert UsageMeter(streamed=False).used(100) is None


def test_arrival_rate_converges_and_decays():
    clock = FakeClock(0.0)
    rate = ArrivalRate(tau_s=10.0, clock=clock)
    for _ in range(600):
        clock.advance(0.1)
        rate.add(1.0)
    assert rate.rate() == pytest.approx(10.0, rel=0.05)
    clock.advance(10.0)
    assert rate.rate() == pytest.approx(10.0 / 2.718281828, rel=0.05)


def test_tenant_label_cardinality_is_capped():
    labels = TenantLabels(cap=2)
    assert [labels(t) for t in ("a", "b", "c", "a", "other")] == ["a", "b", "other", "a", "other"]


def test_cli_flags_become_config():
    import argparse
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--upstream", "http://x:1", "--tenant-header", "X-Tenant",
                              "--tenant-tokens-per-minute", "5000", "--tenant-limit", "vip:tokens=90000",
                              "--default-max-tokens", "64"])
    cfg = config_from_args(args)
    assert (cfg.tenant_header, cfg.tenant_tokens_per_minute, cfg.default_max_tokens) == ("X-Tenant", 5000, 64)
    assert cfg.tenant_overrides == {"vip": Limits(None, 90000)}
    with pytest.raises(SystemExit):
        parser.parse_args(["--upstream", "http://x:1", "--tenant-limit", "vip:tokens=zero"])


def test_requests_that_generate_nothing_take_a_request_and_no_tokens():
    clock = FakeClock()
    metrics = RouterMetrics()
    queue = AdmissionQueue(8, 30.0, clock=clock)
    tenancy = Tenancy(TenantLimiter(Limits(requests_per_minute=10, tokens_per_minute=100), clock=clock), queue,
                      metrics, clock=clock)
    tok = tenancy.admit({}, {"prompt": "x" * 4000}, generates=False)     # e.g. /v1/tokenize: no 429 on tokens
    assert isinstance(tok, Admission) and tok.reserved == 0
    tok.relayed, tok.status = True, 200
    tenancy.finish(tok)
    assert tenancy.request_rate.rate() == 0                              # not an arrival the engines serve
    gen = tenancy.admit({}, {"prompt": "hi", "max_tokens": 50})
    assert isinstance(gen, Admission) and gen.reserved == 51 and tenancy.request_rate.rate() > 0
    tenancy.dispatched(gen, queued=False)
    gen.relayed, gen.status = True, 200                                  # no usage in the answer: reservation kept
    tenancy.finish(gen)
    assert queue.counters["anonymous"] == 51
    assert tenancy.limiter.headers("anonymous")["x-ratelimit-remaining-requests"] == "8"


# ---- through the router

class UsageUpstream(FakeUpstream):
    """An engine double answering with usage: prompt 5 tokens, completion = max_tokens. One at a time."""

    def __init__(self) -> None:
        super().__init__("usage")
        self.tokens: list[tuple[str, int]] = []    # (tenant header, total tokens) in serve order
        self.lock = asyncio.Lock()

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        async with self.lock:
            await asyncio.sleep(0.002)
            total = 5 + body["max_tokens"]
            self.tokens.append((request.headers.get("X-Tenant", ""), total))
        usage = {"prompt_tokens": 5, "completion_tokens": body["max_tokens"], "total_tokens": total}
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": "x"}], "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"text": "x"}]}\n\n')
        if (body.get("stream_options") or {}).get("include_usage"):
            await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_over_the_token_limit_is_429_with_openai_headers_and_success_carries_them_too():
    async def main():
        up = UsageUpstream()
        await up.start()
        try:
            async with running_router(upstreams=[up.url], tenant_header="X-Tenant",
                                      tenant_tokens_per_minute=600, tenant_requests_per_minute=100) as (app, base):
                async with aiohttp.ClientSession() as s:
                    async def post(max_tokens: int, tenant: str = "acme", **extra):
                        async with s.post(f"{base}/v1/completions", headers={"X-Tenant": tenant},
                                          json={"prompt": "hi", "max_tokens": max_tokens, **extra}) as r:
                            return r.status, dict(r.headers), await r.read()
                    status, headers, _ = await post(400)
                    assert status == 200
                    # 400 + 1 reserved; the answer's usage (405) settles it: 600 - 405 = 195 left after the request
                    assert headers["x-ratelimit-limit-tokens"] == "600"
                    assert headers["x-ratelimit-limit-requests"] == "100"
                    assert int(headers["x-ratelimit-remaining-tokens"]) == 600 - 401
                    status, headers, body = await post(300)
                    assert status == 429
                    err = json.loads(body)["error"]
                    assert err["type"] == "tokens" and err["code"] == "rate_limit_exceeded"
                    assert int(headers["Retry-After"]) >= 1
                    for name in ("limit", "remaining", "reset"):
                        assert f"x-ratelimit-{name}-tokens" in headers and f"x-ratelimit-{name}-requests" in headers
                    # 195 plus what refilled meanwhile (10 tokens/s)
                    assert int(headers["x-ratelimit-remaining-tokens"]) in range(195, 260)
                    status, _, _ = await post(300, tenant="other")          # another tenant is untouched
                    assert status == 200
                    # streamed with include_usage: the final usage chunk settles the reservation
                    status, _, _ = await post(50, tenant="s", stream=True, stream_options={"include_usage": True})
                    assert status == 200
                    async with s.get(f"{base}/metrics") as r:
                        text = await r.text()
                    assert 'pagedmodel_router_tenant_requests_total{outcome="rejected",tenant="acme"} 1.0' in text
                    assert 'pagedmodel_router_tenant_tokens_total{outcome="used",tenant="s"} 55.0' in text
                    assert 'pagedmodel_router_rate_limited_total{scope="tenant"} 1.0' in text
                    assert "pagedmodel_router_arrival_requests_per_second" in text
                    assert app.tenancy.request_rate.rate() > 0
        finally:
            await up.stop()
    run(main())


def test_two_tenants_saturating_one_upstream_share_tokens_evenly():
    # "small" asks for 10-token completions, "big" for 40; each keeps 4 requests open against an upstream
    # that serves one at a time. FIFO would give big four times the tokens; the fair queue evens them out.
    async def main():
        up = UsageUpstream()
        await up.start()
        try:
            async with running_router(upstreams=[up.url], tenant_header="X-Tenant", max_inflight_per_upstream=1,
                                      strategy="least-load") as (_app, base):
                async with aiohttp.ClientSession() as s:
                    stop = asyncio.Event()

                    async def client(tenant: str, max_tokens: int) -> None:
                        while not stop.is_set():
                            async with s.post(f"{base}/v1/completions", headers={"X-Tenant": tenant},
                                              json={"prompt": "p", "max_tokens": max_tokens}) as r:
                                assert r.status == 200
                                await r.read()
                    tasks = [asyncio.create_task(client(t, n)) for t, n in [("small", 10), ("big", 40)] * 4]
                    while sum(n for _, n in up.tokens) < 6000:
                        await asyncio.sleep(0.05)
                    stop.set()
                    await asyncio.gather(*tasks)
        finally:
            await up.stop()
        window = up.tokens[20:]                       # past the start, when both tenants queue
        small = sum(n for t, n in window if t == "small")
        big = sum(n for t, n in window if t == "big")
        print(f"tokens served: small {small}, big {big}")
        assert abs(small / big - 1) <= 0.2, (small, big)
    run(main())
