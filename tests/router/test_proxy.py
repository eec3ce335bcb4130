"""The router over HTTP against fake upstreams on 127.0.0.1 (real sockets, short generous waits)."""
from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp import web

from pagedmodel.server.router import relay as router_relay

from fakes import FakeUpstream, eventually, run, running_router


async def started(*ups: FakeUpstream) -> None:
    for u in ups:
        await u.start()


def test_proxies_completions_models_health_and_metrics():
    async def main():
        up = FakeUpstream("a")
        await started(up)
        async with running_router(upstreams=[up.url]) as (_app, base), aiohttp.ClientSession() as s:
            async with s.post(base + "/v1/completions", json={"prompt": "hi"},
                              headers={"Authorization": "Bearer k1"}) as r:
                assert r.status == 200
                assert await r.json() == {"upstream": "a", "prompt": "hi", "auth": "Bearer k1"}
            async with s.get(base + "/v1/models") as r:
                assert r.status == 200 and (await r.json())["data"][0]["id"] == "fake"
            async with s.get(base + "/health") as r:
                assert r.status == 200 and (await r.json())["upstreams_ready"] == 1
            async with s.get(base + "/metrics") as r:
                text = await r.text()
            assert 'pagedmodel_router_requests_total{code="200"} 2.0' in text   # completion + models
            for name in ("pagedmodel_router_queue_length", "pagedmodel_router_rate_limited_total",
                         f'pagedmodel_router_upstream_inflight{{upstream="{up.url}"}}',
                         "pagedmodel_router_upstream_latency_seconds_bucket",
                         f'pagedmodel_router_upstream_healthy{{upstream="{up.url}"}} 1.0'):
                assert name in text
        await up.stop()
    run(main())


def test_bad_json_and_bad_priority_are_400_in_openai_format():
    async def main():
        up = FakeUpstream("a")
        await started(up)
        async with running_router(upstreams=[up.url]) as (_app, base), aiohttp.ClientSession() as s:
            async with s.post(base + "/v1/completions", data=b"{nope") as r:
                body = await r.json()
                assert r.status == 400 and body["error"]["type"] == "BadRequestError"
            async with s.post(base + "/v1/completions", json={"prompt": "x", "priority": "high"}) as r:
                assert r.status == 400 and (await r.json())["error"]["code"] == "invalid_priority"
        assert up.served == []
        await up.stop()
    run(main())


def test_streaming_is_passed_through_chunk_by_chunk():
    async def main():
        up = FakeUpstream("a")
        up.between = asyncio.Event()   # the upstream sends chunk 0, then waits
        await started(up)
        async with running_router(upstreams=[up.url]) as (_app, base), aiohttp.ClientSession() as s:
            async with s.post(base + "/v1/completions", json={"prompt": "x", "stream": True, "n_chunks": 2}) as r:
                assert r.headers["Content-Type"].startswith("text/event-stream")
                first = await asyncio.wait_for(r.content.readuntil(b"\n\n"), 10)
                assert b'"t0 "' in first   # arrived while the upstream still holds the rest
                up.between.set()
                rest = await r.read()
                assert b'"t1 "' in rest and rest.endswith(b"data: [DONE]\n\n")
        await up.stop()
    run(main())


def test_rate_limit_429_with_retry_after():
    async def main():
        up = FakeUpstream("a")
        await started(up)
        async with running_router(upstreams=[up.url], rate_limit=0.5, burst=2) as (_app, base), \
                aiohttp.ClientSession() as s:
            codes = []
            for _ in range(3):
                async with s.post(base + "/v1/completions", json={"prompt": "x"}) as r:
                    codes.append(r.status)
                    if r.status == 429:
                        body = await r.json()
                        assert r.headers["Retry-After"] == "2"   # 0.5 tokens/s -> next token within 2 s
                        assert body["error"]["type"] == "RateLimitError"
                        assert body["error"]["code"] == "rate_limit_exceeded"
            assert codes == [200, 200, 429]
            async with s.get(base + "/metrics") as r:
                assert 'pagedmodel_router_rate_limited_total{scope="global"} 1.0' in await r.text()
        await up.stop()
    run(main())


def test_queue_full_and_queue_timeout_are_503_with_retry_after():
    async def main():
        up = FakeUpstream("a")
        up.hold = asyncio.Event()
        await started(up)
        async with running_router(upstreams=[up.url], max_inflight_per_upstream=1, max_queue_len=1,
                                  queue_timeout=1.0) as (app, base), aiohttp.ClientSession() as s:
            first = asyncio.create_task(s.post(base + "/v1/completions", json={"prompt": "1"}))
            await eventually(lambda: len(up.served) == 1)
            second = asyncio.create_task(s.post(base + "/v1/completions", json={"prompt": "2"}))
            await eventually(lambda: len(app.queue) == 1)
            async with s.post(base + "/v1/completions", json={"prompt": "3"}) as r:
                assert r.status == 503 and r.headers["Retry-After"] == "1"
                assert (await r.json())["error"]["code"] == "queue_full"
            r2 = await asyncio.wait_for(second, 10)   # the queued one times out after 1 s
            assert r2.status == 503 and r2.headers["Retry-After"] == "1"
            assert (await r2.json())["error"]["code"] == "queue_timeout"
            up.hold.set()
            r1 = await asyncio.wait_for(first, 10)
            assert r1.status == 200
            assert [b["prompt"] for b in up.served] == ["1"]
        await up.stop()
    run(main())


def test_queued_requests_leave_by_priority_then_arrival():
    async def main():
        up = FakeUpstream("a")
        up.hold = asyncio.Event()
        await started(up)
        async with running_router(upstreams=[up.url], max_inflight_per_upstream=1) as (app, base), \
                aiohttp.ClientSession() as s:
            tasks = [asyncio.create_task(s.post(base + "/v1/completions", json={"prompt": "busy"}))]
            await eventually(lambda: len(up.served) == 1)
            for prompt, prio in [("late-a", 5), ("normal-a", 0), ("urgent", -1), ("normal-b", 0), ("late-b", 5)]:
                tasks.append(asyncio.create_task(s.post(base + "/v1/completions",
                                                        json={"prompt": prompt, "priority": prio})))
                await eventually(lambda n=len(tasks) - 1: len(app.queue) == n)
            up.hold.set()
            for t in tasks:
                assert (await asyncio.wait_for(t, 10)).status == 200
        assert [b["prompt"] for b in up.served] == ["busy", "urgent", "normal-a", "normal-b", "late-a", "late-b"]
        await up.stop()
    run(main())


def test_client_disconnect_while_queued_leaves_the_queue():
    async def main():
        up = FakeUpstream("a")
        up.hold = asyncio.Event()
        await started(up)
        async with running_router(upstreams=[up.url], max_inflight_per_upstream=1) as (app, base), \
                aiohttp.ClientSession() as s:
            busy = asyncio.create_task(s.post(base + "/v1/completions", json={"prompt": "busy"}))
            await eventually(lambda: len(up.served) == 1)
            async with aiohttp.ClientSession() as other:
                queued = asyncio.create_task(other.post(base + "/v1/completions", json={"prompt": "gone"}))
                await eventually(lambda: len(app.queue) == 1)
                queued.cancel()
            await eventually(lambda: len(app.queue) == 0)
            up.hold.set()
            assert (await busy).status == 200
            await asyncio.sleep(0.1)
        assert [b["prompt"] for b in up.served] == ["busy"]
        await up.stop()
    run(main())


def test_kv_aware_routes_to_the_replica_with_most_headroom():
    async def main():
        full, roomy = FakeUpstream("full", kv_usage=0.95, waiting=4), FakeUpstream("roomy", kv_usage=0.1)
        await started(full, roomy)
        async with running_router(upstreams=[full.url, roomy.url]) as (app, base), aiohttp.ClientSession() as s:
            await eventually(lambda: all(u.kv_usage is not None for u in app.pool.upstreams.values()))
            for i in range(5):
                async with s.post(base + "/v1/completions", json={"prompt": str(i)}) as r:
                    assert (await r.json())["upstream"] == "roomy"
        assert full.served == []
        await full.stop()
        await roomy.stop()
    run(main())


def test_connection_failure_retries_elsewhere_and_ejects_the_dead_upstream():
    async def main():
        live, dead = FakeUpstream("live"), FakeUpstream("dead")
        await started(live)   # `dead` never listens: connection refused
        async with running_router(upstreams=[dead.url, live.url], strategy="round-robin",
                                  eject_backoff=60) as (app, base), aiohttp.ClientSession() as s:
            for i in range(8):
                async with s.post(base + "/v1/completions", json={"prompt": str(i)}) as r:
                    assert r.status == 200 and (await r.json())["upstream"] == "live"
            assert app.pool.upstreams[dead.url].ejected
            assert len(live.served) == 8
        await live.stop()
    run(main())


def test_a_retry_waits_for_a_busy_replica_instead_of_returning_to_the_one_that_failed_it():
    """An engine dies while its peer is full: a request that failed on the dead one must wait for a slot
    on the live one. Sending it back to the dead one, free but not yet ejected, would spend every attempt
    there and answer 502 (the e2e OOM scenario met exactly that)."""
    async def main():
        live, dead = FakeUpstream("live"), FakeUpstream("dead")
        live.hold = asyncio.Event()
        await started(live)   # `dead` never listens: connection refused
        async with running_router(upstreams=[live.url, dead.url], strategy="round-robin",
                                  max_inflight_per_upstream=1, failures_to_eject=10, scrape_interval=60,
                                  queue_timeout=20) as (app, base), aiohttp.ClientSession() as s:
            first = asyncio.create_task(s.post(base + "/v1/completions", json={"prompt": "first"}))
            await eventually(lambda: len(live.served) == 1)          # the live replica is now full
            second = asyncio.create_task(s.post(base + "/v1/completions", json={"prompt": "second"}))
            await eventually(lambda: len(app.queue) == 1)             # failed on `dead`, waiting for `live`
            assert not app.pool.upstreams[dead.url].ejected
            live.hold.set()
            for reply in await asyncio.wait_for(asyncio.gather(first, second), 10):
                assert reply.status == 200 and (await reply.json())["upstream"] == "live"
                reply.release()
        await live.stop()
    run(main())


def test_kill_one_of_three_midrun_then_readmit():
    async def main():
        ups = [FakeUpstream(n) for n in "abc"]
        await started(*ups)
        async with running_router(upstreams=[u.url for u in ups], strategy="round-robin", eject_backoff=0.1,
                                  eject_max_backoff=0.2) as (app, base), aiohttp.ClientSession() as s:
            async def burst(n: int) -> list[int]:
                async def one(i: int) -> int:
                    async with s.post(base + "/v1/completions", json={"prompt": str(i)}) as r:
                        return r.status
                return await asyncio.gather(*(one(i) for i in range(n)))

            assert set(await burst(30)) == {200}
            # kill b while a steady load runs and b holds requests it received but has not answered:
            # those die with b before any response byte, so they are retried elsewhere too
            ups[1].hold = asyncio.Event()
            load = asyncio.create_task(burst(60))
            await eventually(lambda: len(ups[1].served) >= 15)
            await ups[1].stop()
            ups[1].hold = None
            assert set(await load) == {200}
            assert set(await burst(30)) == {200}
            await eventually(lambda: app.pool.upstreams[ups[1].url].ejected)
            before = len(ups[1].served)
            await ups[1].start()                           # same port: it comes back
            await eventually(lambda: not app.pool.upstreams[ups[1].url].ejected)
            assert set(await burst(30)) == {200}
            assert len(ups[1].served) > before
        for u in ups:
            await u.stop()
    run(main())


def test_midstream_failure_surfaces_as_openai_api_error():
    async def main():
        up = FakeUpstream("a")
        up.break_after = 1
        await started(up)
        async with running_router(upstreams=[up.url]) as (_app, base):
            from openai import APIError, AsyncOpenAI
            client = AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
            stream = await client.completions.create(model="fake", prompt="x", stream=True, max_tokens=3)
            texts = []
            with pytest.raises(APIError, match="mid-stream"):
                async for chunk in stream:
                    texts.append(chunk.choices[0].text)
            assert texts == ["t0 "]
            await client.close()
        await up.stop()
    run(main())


def test_a_client_leaving_mid_stream_is_not_held_against_the_engine(caplog, monkeypatch):
    """The client's connection closes while the router relays a stream, and the next write to it fails
    (aiohttp's ClientConnectionResetError, a ConnectionResetError: the race the handler's cancellation does
    not always win). That is the client's doing: the engine keeps a clean record (no failure counted, not
    ejected, a failures_to_eject of 1 would show it), the router closes its upstream request so the engine
    aborts, and nothing is logged as an upstream failure or an error (no traceback from write_eof)."""
    class ClientGoneAfterFirstEvent(web.StreamResponse):
        async def write(self, data: bytes) -> None:
            if getattr(self, "_wrote", False):
                raise aiohttp.ClientConnectionResetError("Cannot write to closing transport")
            self._wrote = True
            await super().write(data)

    patched_web = SimpleNamespace(**{**vars(web), "StreamResponse": ClientGoneAfterFirstEvent})
    monkeypatch.setattr(router_relay, "web", patched_web)   # the relay builds the response

    async def main():
        up = FakeUpstream("a")
        up.between = asyncio.Event()                   # the engine holds its second event until the first is read
        await started(up)
        async with running_router(upstreams=[up.url], failures_to_eject=1) as (app, base):
            async with aiohttp.ClientSession() as s:
                async with s.post(base + "/v1/completions", json={"prompt": "x", "stream": True, "n_chunks": 50}) as r:
                    body = await r.content.readline()
                    up.between.set()
                    body += await r.read()
            assert body.count(b"data: ") == 1          # the first event only: the rest had nowhere to go
            upstream = app.pool.upstreams[up.url]
            assert upstream.consecutive_failures == 0 and not upstream.ejected
            async with aiohttp.ClientSession() as s, s.post(base + "/v1/completions", json={"prompt": "y"}) as r:
                assert r.status == 200 and (await r.json())["upstream"] == "a"
        await up.stop()
        assert "client left mid-response" in caplog.text
        assert "failed mid-response" not in caplog.text and "Traceback" not in caplog.text
        assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
    caplog.set_level(logging.INFO)
    run(main())


def test_no_upstream_ready_waits_in_queue_until_one_returns():
    async def main():
        up = FakeUpstream("a")
        async with running_router(upstreams=[up.url], eject_backoff=0.05, eject_max_backoff=0.1,
                                  failures_to_eject=1, queue_timeout=20) as (app, base), \
                aiohttp.ClientSession() as s:
            req = asyncio.create_task(s.post(base + "/v1/completions", json={"prompt": "x"}))
            # the first attempt is refused, ejects the only upstream, and the request waits in the queue
            await eventually(lambda: app.pool.upstreams[up.url].ejected and len(app.queue) == 1)
            await asyncio.sleep(0.3)
            assert not req.done()
            await up.start()
            r = await asyncio.wait_for(req, 15)
            assert r.status == 200 and (await r.json())["upstream"] == "a"
        await up.stop()
    run(main())


@pytest.mark.parametrize("argv, message", [
    ([], "at least one --upstream"),
    (["--upstream", "ftp://x"], "bad upstream URL"),
    (["--upstream", "http://x:1", "--burst", "3"], "--burst needs --rate-limit"),
])
def test_cli_refuses_with_exit_2(argv, message):
    proc = subprocess.run([sys.executable, "-m", "pagedmodel.cli", "router", *argv],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and message in proc.stdout + proc.stderr


def test_discover_without_kubernetes_credentials_exits_2(tmp_path):
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST")}
    env.update(HOME=str(tmp_path), KUBECONFIG=str(tmp_path / "none"))
    proc = subprocess.run([sys.executable, "-m", "pagedmodel.cli", "router", "--discover", "app=x"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2 and "kube" in (proc.stdout + proc.stderr).lower()


def test_cli_argument_validation():
    proc = subprocess.run([sys.executable, "-m", "pagedmodel.cli", "router", "--upstream", "http://x:1",
                           "--rate-limit", "-1"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "must be a positive number" in proc.stderr


def test_cli_serves_and_exits_0_on_sigterm(tmp_path):
    import signal
    import time

    import httpx

    from support import free_port
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pagedmodel.cli", "router", "--upstream",
                             "http://127.0.0.1:9", "--host", "127.0.0.1", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "router did not come up"
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        assert r.status_code == 200 and r.json()["upstreams"] == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.mark.parametrize("body, key", [
    ({"prompt": "abc"}, "abc"),
    ({"prompt": ["first", "second"]}, "first"),
    ({"prompt": [1, 2, 3]}, "1,2,3"),
    ({"prompt": [[4, 5], [6]]}, "4,5"),
    ({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]}, "system:S\nuser:U"),
    ({}, ""),
])
def test_prefix_key_of_request_bodies(body, key):
    from pagedmodel.server.router.request import prompt_key
    assert prompt_key(body) == key


def test_per_client_limit_by_header_over_http():
    async def main():
        up = FakeUpstream("a")
        await started(up)
        async with running_router(upstreams=[up.url], client_rate_limit=0.1, client_burst=1,
                                  client_header="X-Tenant") as (_app, base), aiohttp.ClientSession() as s:
            async def status(tenant: str) -> int:
                async with s.post(base + "/v1/completions", json={"prompt": "x"},
                                  headers={"X-Tenant": tenant}) as r:
                    if r.status == 429:
                        assert r.headers["Retry-After"] == "10"
                    return r.status
            assert [await status("a"), await status("a"), await status("b"), await status("b")] == [200, 429, 200, 429]
        await up.stop()
    run(main())


def test_discovered_replicas_take_queued_requests_and_removed_ones_drain():
    async def main():
        a, b = FakeUpstream("a"), FakeUpstream("b")
        a.hold = asyncio.Event()
        await started(a, b)
        async with running_router(upstreams=[], queue_timeout=20) as (app, base), aiohttp.ClientSession() as s:
            req = asyncio.create_task(s.post(base + "/v1/completions", json={"prompt": "x"}))
            await eventually(lambda: len(app.queue) == 1)     # no replica yet (scale from zero): it waits
            app.set_upstreams([a.url])
            await eventually(lambda: len(a.served) == 1)
            app.set_upstreams([b.url])                         # a is removed while busy: drained, not cut
            assert app.pool.upstreams[a.url].draining
            async with s.post(base + "/v1/completions", json={"prompt": "y"}) as r:
                assert (await r.json())["upstream"] == "b"
            a.hold.set()
            r = await asyncio.wait_for(req, 10)
            assert r.status == 200 and (await r.json())["upstream"] == "a"
            await eventually(lambda: a.url not in app.pool.upstreams)
            async with s.get(base + "/metrics") as r:
                text = await r.text()
            assert f'upstream="{b.url}"' in text and f'upstream="{a.url}"' not in text   # no stale series
        await a.stop()
        await b.stop()
    run(main())


@pytest.mark.parametrize("status, ejected", [(500, False), (503, False), (502, True)])
def test_which_upstream_errors_count_towards_ejection(status, ejected):
    async def main():
        up = FakeUpstream("a")
        up.status = status
        await started(up)
        async with running_router(upstreams=[up.url], failures_to_eject=2, eject_backoff=60) as (app, base), \
                aiohttp.ClientSession() as s:
            for _ in range(2):
                async with s.post(base + "/v1/completions", json={"prompt": "x"}) as r:
                    assert r.status == status   # passed through unchanged, OpenAI body and all
                    assert (await r.json())["error"]["message"] == "boom"
            assert app.pool.upstreams[up.url].ejected is ejected
        await up.stop()
    run(main())


def test_discovered_upstream_is_capped_at_its_scraped_max_num_seqs():
    """An engine discovery adds, exporting pagedmodel:max_num_seqs, never holds more requests than that from
    the router: the rest wait in the router's queue. An engine that does not export it is not capped."""
    async def main():
        capped, uncapped = FakeUpstream("capped", max_num_seqs=2), FakeUpstream("uncapped")
        capped.hold, uncapped.hold = asyncio.Event(), asyncio.Event()
        await started(capped, uncapped)
        for up in (capped, uncapped):
            async with running_router(upstreams=[], queue_timeout=20) as (app, base), \
                    aiohttp.ClientSession() as s:
                app.set_upstreams([up.url])                       # as discovery hands it over
                await eventually(lambda: app.pool.upstreams[up.url].scraped_at is not None)
                reqs = [asyncio.create_task(s.post(base + "/v1/completions", json={"prompt": str(i)}))
                        for i in range(3)]
                if up is capped:
                    await eventually(lambda: len(up.served) == 2 and len(app.queue) == 1)
                    assert app.pool.upstreams[up.url].max_inflight == 2
                    async with s.get(base + "/metrics") as r:
                        text = await r.text()
                    assert f'pagedmodel_router_upstream_inflight{{upstream="{up.url}"}} 2.0' in text
                    assert "pagedmodel_router_queue_length 1.0" in text
                else:
                    await eventually(lambda: len(up.served) == 3)
                    assert app.pool.upstreams[up.url].max_inflight is None and len(app.queue) == 0
                up.hold.set()                                     # the queued one goes once a slot frees
                for r in await asyncio.wait_for(asyncio.gather(*reqs), 10):
                    assert r.status == 200
                    r.release()
                assert sorted(b["prompt"] for b in up.served) == ["0", "1", "2"]
        await capped.stop()
        await uncapped.stop()
    run(main())
