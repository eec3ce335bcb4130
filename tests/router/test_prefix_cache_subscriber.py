"""KVSubscriptions against a scripted engine stream: resume after a drop, resync after a gap, the key
sent, an engine without prefix caching, and removal of an upstream."""
from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from pagedmodel.server.router.kv_subscriber import KVSubscriptions
from pagedmodel.server.router.prefix_index import PrefixIndex
from support import free_port

from fakes import eventually, run

H = [bytes([i]) * 32 for i in range(8)]


def snapshot(seq: int, instance: str, hashes: list[bytes]) -> dict:
    return {"type": "snapshot", "instance": instance, "seq": seq, "block_size": 16,
            "hash_scheme": "sha256-chain-v1", "block_hashes": [h.hex() for h in hashes]}


def batch(seq: int, stored: list[bytes] = (), removed: list[bytes] = ()) -> dict:
    events = []
    if stored:
        events.append({"type": "BlockStored", "block_hashes": [h.hex() for h in stored], "parent_block_hash": None,
                       "block_size": 16})
    if removed:
        events.append({"type": "BlockRemoved", "block_hashes": [h.hex() for h in removed]})
    return {"type": "batch", "seq": seq, "ts": 0.0, "events": events}


class ScriptedEngine:
    """Each connection gets the next script (lines, then `hold` or close); requests are recorded."""

    def __init__(self, scripts: list[list[dict]], status: int = 200) -> None:
        self.scripts = scripts
        self.status = status
        self.requests: list[tuple[dict, str | None]] = []
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.runner: web.AppRunner | None = None

    async def handler(self, request: web.Request) -> web.StreamResponse:
        self.requests.append((dict(request.query), request.headers.get("Authorization")))
        if self.status != 200:
            return web.json_response({"error": {"message": "off"}}, status=self.status)
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        script = self.scripts.pop(0) if self.scripts else [{"hold": True}]
        for line in script:
            if line.get("hold"):
                await asyncio.sleep(3600)
            await resp.write(json.dumps(line).encode() + b"\n")
        return resp

    async def __aenter__(self) -> "ScriptedEngine":
        app = web.Application()
        app.router.add_get("/v1/kv_events", self.handler)
        self.runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


async def follow(engine: ScriptedEngine, body, **kw) -> None:
    index = PrefixIndex()
    async with aiohttp.ClientSession() as session:
        subs = KVSubscriptions(index, session, retry=0.05, **kw)
        subs.sync([engine.url])
        try:
            await body(index, subs)
        finally:
            await subs.close()


def test_drop_resumes_then_gap_resyncs_from_a_snapshot():
    async def main() -> None:
        scripts = [
            [snapshot(5, "i1", [H[0]]), batch(6, stored=[H[1]])],              # then the connection drops
            [{"type": "resume", "instance": "i1", "seq": 6, "block_size": 16}, batch(8, stored=[H[2]])],  # 7 lost
            [snapshot(9, "i1", [H[1], H[3]]), {"hold": True}],
        ]
        async with ScriptedEngine(scripts) as engine:
            async def body(index: PrefixIndex, _subs: KVSubscriptions) -> None:
                await eventually(lambda: len(engine.requests) == 3 and index.get(engine.url).seq == 9)
                up = index.get(engine.url)
                assert set(up.hashes) == {H[1], H[3]} and up.usable
                assert [q for q, _ in engine.requests] == [{}, {"since": "6", "instance": "i1"}, {}]
                assert engine.requests[0][1] == "Bearer sk-router"
            await follow(engine, body, api_key="sk-router")
    run(main())


def test_restarted_engine_replaces_the_whole_state():
    async def main() -> None:
        scripts = [[snapshot(3, "old", [H[0], H[1]])],
                   [snapshot(1, "new", [H[4]]), {"hold": True}]]   # the resume attempt meets a new instance
        async with ScriptedEngine(scripts) as engine:
            async def body(index: PrefixIndex, _subs: KVSubscriptions) -> None:
                await eventually(lambda: index.get(engine.url).instance == "new")
                assert set(index.get(engine.url).hashes) == {H[4]}
                assert engine.requests[1][0] == {"since": "3", "instance": "old"}
            await follow(engine, body)
    run(main())


def test_removed_upstream_loses_its_task_and_entry_and_404_leaves_it_empty():
    async def main() -> None:
        async with ScriptedEngine([], status=404) as engine:
            async def body(index: PrefixIndex, subs: KVSubscriptions) -> None:
                await eventually(lambda: len(engine.requests) == 1)
                await asyncio.sleep(0.2)
                assert len(engine.requests) == 1                  # waits disabled_retry, not retry
                assert not index.get(engine.url).usable
                task = subs.tasks[engine.url]
                subs.sync([])
                await eventually(task.done)
                assert engine.url not in index.upstreams and not subs.tasks
            await follow(engine, body, disabled_retry=30.0)
    run(main())
