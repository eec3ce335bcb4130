"""Test doubles shared by the router tests."""
from __future__ import annotations

import asyncio


def run(coro):
    """Run one async test body, bounded so a hang fails instead of stalling the suite."""
    return asyncio.run(asyncio.wait_for(coro, 60))


async def eventually(predicate, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


class FakeClock:
    """A monotonic clock the test advances by hand."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


import contextlib
import json
from collections.abc import AsyncIterator

from aiohttp import web

from pagedmodel.server.http_common.errors import UNSERVED_HEADER
from pagedmodel.server.router.app import RouterApp, RouterConfig, serve
from support import free_port


class FakeUpstream:
    """A minimal engine on 127.0.0.1: records what it served, reports chosen metrics, can be held or killed.

    `hold` (an asyncio.Event) delays every completion until set; `chunks` SSE events are sent for
    `stream: true` with `between` awaited between them; `break_after` aborts a stream mid-way.
    """

    def __init__(self, name: str, *, kv_usage: float = 0.0, waiting: float = 0.0,
                 max_num_seqs: int | None = None) -> None:
        self.name = name
        self.kv_usage = kv_usage
        self.waiting = waiting
        self.max_num_seqs = max_num_seqs     # exported as pagedmodel:max_num_seqs when set, as the engine does
        self.port = free_port()
        self.served: list[dict] = []
        self.hold: asyncio.Event | None = None
        self.between: asyncio.Event | None = None
        self.break_after: int | None = None
        self.status = 200
        self.unserved: str | None = None     # set: answer 503 + X-PagedModel-Unserved, as a draining engine does
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = web.Application()
        async def health(_r: web.Request) -> web.Response:
            return web.json_response({"status": "ok"} if self.unserved is None else {"status": self.unserved},
                                     status=200 if self.unserved is None else 503)

        async def models(_r: web.Request) -> web.Response:
            return web.json_response({"object": "list", "data": [{"id": "fake", "object": "model",
                                                                  "owned_by": self.name}]})
        app.router.add_get("/health", health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", models)
        app.router.add_post("/v1/completions", self._complete)
        # No grace on stop: it behaves like a replica that dies (open connections are cut).
        self._runner = web.AppRunner(app, shutdown_timeout=0.01)   # 0 would mean "wait forever" to aiohttp
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _metrics(self, _r: web.Request) -> web.Response:
        text = (f'vllm:kv_cache_usage_perc{{model_name="fake"}} {self.kv_usage}\n'
                f'vllm:num_requests_waiting{{model_name="fake"}} {self.waiting}\n')
        if self.max_num_seqs is not None:
            text += f'pagedmodel:max_num_seqs{{model_name="fake"}} {float(self.max_num_seqs)}\n'
        return web.Response(text=text)

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.served.append(body)
        if self.hold is not None:
            await self.hold.wait()
        if self.unserved is not None:
            return web.json_response({"error": {"message": "server is shutting down", "type": "X", "param": None,
                                                "code": self.unserved}},
                                     status=503, headers={UNSERVED_HEADER: self.unserved, "Retry-After": "5"})
        if self.status != 200:
            return web.json_response({"error": {"message": "boom", "type": "X", "param": None, "code": None}},
                                     status=self.status)
        if not body.get("stream"):
            return web.json_response({"upstream": self.name, "prompt": body.get("prompt"),
                                      "auth": request.headers.get("Authorization")})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(body.get("n_chunks", 3)):
            if self.break_after is not None and i == self.break_after:
                request.transport.close()   # dies mid-stream
                return resp
            chunk = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "fake",
                     "choices": [{"index": 0, "text": f"t{i} ", "finish_reason": None, "logprobs": None}]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            if self.between is not None:
                await self.between.wait()
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


@contextlib.asynccontextmanager
async def running_router(**cfg) -> AsyncIterator[tuple[RouterApp, str]]:
    """A router on an ephemeral 127.0.0.1 port; yields (app, base_url)."""
    cfg.setdefault("scrape_interval", 0.05)
    app = RouterApp(RouterConfig(**cfg))
    stop = asyncio.Event()
    port: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(serve(app, "127.0.0.1", 0, ready=port.set_result, stop=stop))
    try:
        yield app, f"http://127.0.0.1:{await asyncio.wait_for(port, 10)}"
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
