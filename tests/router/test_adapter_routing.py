"""Adapter affinity through the router app over real sockets, against fake engines that list LoRA
adapters in /v1/models and report resident ones in vllm:lora_requests_info."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from fakes import eventually, run, running_router
from support import assert_openai_error, free_port

from pagedmodel.server.router.strategies import STRATEGIES


class AdapterEngine:
    """A fake engine serving `base` plus `adapters`; records the `model` of every completion it serves."""

    def __init__(self, name: str, adapters: set[str], *, running: set[str] = frozenset(), max_lora: int = 4,
                 api_key: str | None = None) -> None:
        self.name, self.adapters, self.running, self.max_lora = name, set(adapters), set(running), max_lora
        self.api_key = api_key
        self.port = free_port()
        self.served: list[str | None] = []
        self.models_asked = 0
        self.hold: asyncio.Event | None = None
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._complete)
        self._runner = web.AppRunner(app, shutdown_timeout=0.01)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _health(self, _r: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _models(self, request: web.Request) -> web.Response:
        self.models_asked += 1
        if self.api_key is not None and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return web.json_response({"error": {"message": "no", "type": "x", "param": None, "code": None}},
                                     status=401)
        cards = [{"id": "base", "object": "model", "parent": None, "owned_by": self.name}]
        cards += [{"id": a, "object": "model", "parent": "base", "root": f"/adapters/{a}"}
                  for a in sorted(self.adapters)]
        return web.json_response({"object": "list", "data": cards})

    async def _metrics(self, _r: web.Request) -> web.Response:
        return web.Response(text=f'vllm:lora_requests_info{{max_lora="{self.max_lora}",running_lora_adapters='
                                 f'"{",".join(sorted(self.running))}",waiting_lora_adapters=""}} 1.0\n'
                                 'pagedmodel:max_num_seqs{model_name="base"} 4.0\n')

    async def _complete(self, request: web.Request) -> web.Response:
        body = await request.json()
        model = body.get("model")
        if model not in (None, "base", *self.adapters):
            return web.json_response({"error": {"message": "unknown", "type": "NotFoundError", "param": "model",
                                                "code": "model_not_found"}}, status=404)
        self.served.append(model)
        if self.hold is not None:
            await self.hold.wait()
        return web.json_response({"upstream": self.name, "model": model})


async def _engines(*engines: AdapterEngine) -> None:
    for e in engines:
        await e.start()


async def _until_known(app, n: int) -> None:
    await eventually(lambda: sum(u.served_models is not None for u in app.pool.upstreams.values()) == n)


async def _complete(s: aiohttp.ClientSession, base: str, model: str) -> tuple[int, dict]:
    async with s.post(base + "/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 1}) as r:
        return r.status, await r.json()


@pytest.mark.parametrize("strategy", [s for s in STRATEGIES if s != "prefix-cache"])
def test_adapter_requests_go_only_where_it_is_served(strategy):
    async def main():
        e1, e2 = AdapterEngine("e1", {"sql"}), AdapterEngine("e2", {"chat"})
        await _engines(e1, e2)
        async with running_router(upstreams=[e1.url, e2.url], strategy=strategy) as (app, base), \
                aiohttp.ClientSession() as s:
            await _until_known(app, 2)
            for _ in range(4):   # two in a row: round-robin alone would send one of them to e2
                for _ in range(2):
                    assert await _complete(s, base, "sql") == (200, {"upstream": "e1", "model": "sql"})
                assert await _complete(s, base, "chat") == (200, {"upstream": "e2", "model": "chat"})
            assert e1.served.count("sql") == 8 and "sql" not in e2.served
            for _ in range(4):
                assert (await _complete(s, base, "base"))[0] == 200
            assert e1.served.count("base") + e2.served.count("base") == 4
        for e in (e1, e2):
            await e.stop()
    run(main())


def test_unknown_model_is_404_listing_what_is_served_and_reaches_no_engine():
    async def main():
        e1, e2 = AdapterEngine("e1", {"sql"}), AdapterEngine("e2", {"chat"})
        await _engines(e1, e2)
        async with running_router(upstreams=[e1.url, e2.url]) as (app, base), aiohttp.ClientSession() as s:
            await _until_known(app, 2)
            async with s.post(base + "/v1/completions", json={"model": "nope", "prompt": "hi"}) as r:
                err = assert_openai_error(r.status, await r.read(), 404, param="model")
            assert err["code"] == "model_not_found"
            assert all(f"`{n}`" in err["message"] for n in ("base", "chat", "sql"))
            async with s.post(base + "/v1/chat/completions",
                              json={"model": "nope", "messages": [{"role": "user", "content": "x"}]}) as r:
                assert_openai_error(r.status, await r.read(), 404, param="model")
            assert e1.served == [] and e2.served == []
            async with s.get(base + "/metrics") as r:
                text = await r.text()
            assert 'pagedmodel_router_adapter_routing_total{outcome="not_served"} 2.0' in text
            assert 'pagedmodel_router_requests_total{code="404"} 2.0' in text
        for e in (e1, e2):
            await e.stop()
    run(main())


def test_an_adapter_loaded_a_moment_ago_is_found_by_refreshing_before_the_404():
    async def main():
        e1, e2 = AdapterEngine("e1", set()), AdapterEngine("e2", set())
        await _engines(e1, e2)
        # A scrape cycle far longer than the test: only the refresh on a miss can learn of the new adapter.
        async with running_router(upstreams=[e1.url, e2.url], scrape_interval=600) as (app, base), \
                aiohttp.ClientSession() as s:
            await _until_known(app, 2)
            asked = e1.models_asked
            e2.adapters.add("fresh")   # as POST /v1/load_lora_adapter on e2 would
            assert await _complete(s, base, "fresh") == (200, {"upstream": "e2", "model": "fresh"})
            assert e1.models_asked == asked + 1   # one refresh round, not one per retry
            # concurrent misses share refresh rounds: 20 unknown names cost far fewer than 20 rounds
            asked = e1.models_asked
            results = await asyncio.gather(*(_complete(s, base, f"missing-{i}") for i in range(20)))
            assert {status for status, _ in results} == {404}
            assert e1.models_asked - asked <= 3
        for e in (e1, e2):
            await e.stop()
    run(main())


def test_resident_replica_is_preferred_and_models_lists_the_union():
    async def main():
        e1, e2 = AdapterEngine("e1", {"sql"}), AdapterEngine("e2", {"sql", "chat"}, running={"sql"})
        await _engines(e1, e2)
        async with running_router(upstreams=[e1.url, e2.url], strategy="least-load") as (app, base), \
                aiohttp.ClientSession() as s:
            await _until_known(app, 2)
            await eventually(lambda: app.pool.upstreams[e2.url].lora_running == frozenset({"sql"}))
            for _ in range(6):   # one at a time: never above the bounded-load share, so always the resident one
                assert (await _complete(s, base, "sql"))[1]["upstream"] == "e2"
            async with s.get(base + "/v1/models") as r:
                body = await r.json()
            assert r.status == 200 and [c["id"] for c in body["data"]] == ["base", "chat", "sql"]
            assert {c["id"]: c.get("parent") for c in body["data"]} == {"base": None, "chat": "base", "sql": "base"}
            async with s.get(base + "/metrics") as r:
                text = await r.text()
            assert 'pagedmodel_router_adapter_routing_total{outcome="hit"} 6.0' in text
        for e in (e1, e2):
            await e.stop()
    run(main())


def test_a_request_waits_for_its_adapters_replica_instead_of_going_elsewhere():
    async def main():
        e1, e2 = AdapterEngine("e1", {"sql"}), AdapterEngine("e2", set())
        await _engines(e1, e2)
        e1.hold = asyncio.Event()
        async with running_router(upstreams=[e1.url, e2.url], max_inflight_per_upstream=1) as (app, base), \
                aiohttp.ClientSession() as s:
            await _until_known(app, 2)
            first = asyncio.create_task(_complete(s, base, "sql"))
            await eventually(lambda: len(e1.served) == 1)
            second = asyncio.create_task(_complete(s, base, "sql"))
            await eventually(lambda: len(app.queue) == 1)
            assert e2.served == []
            e1.hold.set()
            assert (await first)[1]["upstream"] == "e1" and (await second)[1]["upstream"] == "e1"
            assert e2.served == []
        for e in (e1, e2):
            await e.stop()
    run(main())


def test_without_readable_model_lists_the_router_passes_requests_through():
    async def main():
        # The engine wants a key the router was not given: it cannot know what is served, so it neither
        # filters nor refuses, and the engine's own answer decides (as before adapter affinity).
        e1 = AdapterEngine("e1", {"sql"}, api_key="secret")
        await _engines(e1)
        async with running_router(upstreams=[e1.url]) as (app, base), aiohttp.ClientSession() as s:
            await eventually(lambda: e1.models_asked >= 2)
            assert await _complete(s, base, "sql") == (200, {"upstream": "e1", "model": "sql"})
            assert (await _complete(s, base, "nope"))[0] == 404   # the engine's 404, relayed
            assert e1.served == ["sql"]
        async with running_router(upstreams=[e1.url], upstream_api_key="secret") as (app, base), \
                aiohttp.ClientSession() as s:
            await _until_known(app, 1)
            status, body = await _complete(s, base, "nope")
            assert status == 404 and "`sql`" in body["error"]["message"]   # the router's own 404
            assert e1.served == ["sql"]
        await e1.stop()
    run(main())


def test_models_list_with_no_upstream_answering_falls_back_to_forwarding():
    # nothing known: /v1/models is forwarded as before (queued, then an OpenAI-style 502/503), not an empty list
    async def main():
        async with running_router(upstreams=[f"http://127.0.0.1:{free_port()}"], queue_timeout=0.5) as (_app, base), \
                aiohttp.ClientSession() as s:
            async with s.get(base + "/v1/models") as r:
                assert r.status in (502, 503)
                json.loads(await r.read())
    run(main())


def test_a_request_for_a_free_model_is_not_held_behind_one_whose_replica_is_full():
    async def main():
        e1, e2 = AdapterEngine("e1", {"sql"}), AdapterEngine("e2", set())
        await _engines(e1, e2)
        e1.hold = asyncio.Event()
        async with running_router(upstreams=[e1.url, e2.url], max_inflight_per_upstream=1) as (app, base), \
                aiohttp.ClientSession() as s:
            await _until_known(app, 2)
            first = asyncio.create_task(_complete(s, base, "sql"))
            await eventually(lambda: len(e1.served) == 1)
            blocked = asyncio.create_task(_complete(s, base, "sql"))   # e1 is full: it queues
            await eventually(lambda: len(app.queue) == 1)
            # the base model behind it: e2 is free, so it is served now, while sql still waits for e1
            assert await asyncio.wait_for(_complete(s, base, "base"), 10) == (200, {"upstream": "e2", "model": "base"})
            assert len(app.queue) == 1 and not blocked.done()
            e1.hold.set()
            assert (await first)[1]["upstream"] == "e1" and (await blocked)[1]["upstream"] == "e1"
        for e in (e1, e2):
            await e.stop()
    run(main())


def test_queue_grants_a_ticket_out_of_turn_and_lists_the_waiting_in_order():
    from pagedmodel.server.router.queue import AdmissionQueue

    async def main():
        q = AdmissionQueue(8, 30.0)
        a, b, c = q.enqueue(0, with_future=True), q.enqueue(0, with_future=True), q.enqueue(-1, with_future=True)
        assert q.waiting_in_order() == [c, a, b]
        q.grant(b)
        assert b.state == "granted" and b.future.done() and len(q) == 2
        assert q.waiting_in_order() == [c, a] and q.grant_next() is c and q.grant_next() is a
        with pytest.raises(ValueError):
            q.grant(b)
    run(main())
