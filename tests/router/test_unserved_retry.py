"""Scale-down and rollouts lose nothing: a 503 the engine marks as refused unstarted (draining after
SIGTERM) is retried on another replica, never relayed; a started stream is never retried."""
from __future__ import annotations

import asyncio

import aiohttp

from fakes import FakeUpstream, eventually, run, running_router


def test_draining_replicas_503_is_retried_elsewhere_and_takes_it_out_of_rotation():
    async def main():
        draining, live = FakeUpstream("draining"), FakeUpstream("live")
        draining.unserved = "shutting_down"
        for u in (draining, live):
            await u.start()
        async with running_router(upstreams=[draining.url, live.url], strategy="round-robin",
                                  eject_backoff=60) as (app, base), aiohttp.ClientSession() as s:
            for i in range(6):
                async with s.post(base + "/v1/completions", json={"prompt": str(i)}) as r:
                    assert r.status == 200 and (await r.json())["upstream"] == "live"
            async with s.post(base + "/v1/completions", json={"prompt": "s", "stream": True}) as r:
                assert r.status == 200 and (await r.text()).endswith("data: [DONE]\n\n")
            # one refusal was enough: it left rotation at once instead of being asked again and again
            assert len(draining.served) == 1 and app.pool.upstreams[draining.url].ejected
            assert len(live.served) == 7
            async with s.get(base + "/metrics") as r:
                assert "pagedmodel_router_retries_total 1.0" in await r.text()
        for u in (draining, live):
            await u.stop()
    run(main())


def test_a_plain_503_is_back_pressure_and_is_relayed_not_retried():
    async def main():
        busy, other = FakeUpstream("busy"), FakeUpstream("other")
        busy.status = 503
        for u in (busy, other):
            await u.start()
        async with running_router(upstreams=[busy.url], strategy="round-robin") as (app, base), \
                aiohttp.ClientSession() as s:
            async with s.post(base + "/v1/completions", json={"prompt": "x"}) as r:
                assert r.status == 503 and (await r.json())["error"]["message"] == "boom"
            assert not app.pool.upstreams[busy.url].ejected
        for u in (busy, other):
            await u.stop()
    run(main())


def test_with_every_replica_draining_the_request_waits_for_one_that_is_not():
    async def main():
        old = FakeUpstream("old")
        old.unserved = "shutting_down"
        await old.start()
        async with running_router(upstreams=[old.url], strategy="round-robin", eject_backoff=0.05,
                                  eject_max_backoff=0.1, queue_timeout=20) as (app, base), \
                aiohttp.ClientSession() as s:
            pending = asyncio.create_task(s.post(base + "/v1/completions", json={"prompt": "x"}))
            await eventually(lambda: app.pool.upstreams[old.url].ejected)
            await asyncio.sleep(0.3)        # probes of /health keep answering 503: it stays out
            assert app.pool.upstreams[old.url].ejected and not pending.done()
            old.unserved = None             # the replacement comes up on the same address
            r = await pending
            assert r.status == 200 and (await r.json())["upstream"] == "old"
            r.release()
        await old.stop()
    run(main())


def test_a_started_stream_is_never_retried():
    async def main():
        a, b = FakeUpstream("a"), FakeUpstream("b")
        a.break_after = b.break_after = 1
        for u in (a, b):
            await u.start()
        async with running_router(upstreams=[a.url, b.url], strategy="round-robin") as (app, base), \
                aiohttp.ClientSession() as s:
            async with s.post(base + "/v1/completions", json={"prompt": "s", "stream": True}) as r:
                events = [ln for ln in (await r.text()).split("\n\n") if ln]
            assert any('"upstream_failed"' in e for e in events), events
            assert len(a.served) + len(b.served) == 1   # the request reached exactly one replica
        for u in (a, b):
            await u.stop()
    run(main())
