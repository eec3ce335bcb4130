"""Router overhead against a minimal fast upstream (no model): added latency, max requests/s, and many
concurrent streaming connections held open through the router.

    python benchmarks/router_overhead.py [--requests 1000] [--concurrency 64] [--streams 2000] [--json out.json]

Starts the upstream and `pagedmodel router` as subprocesses on 127.0.0.1; a benchmark, not a test:
compare direct and routed numbers printed by one run.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support import free_port  # noqa: E402  (tests/support.py: shared with the tests)

COMPLETION = {"id": "cmpl-x", "object": "text_completion", "created": 0, "model": "fast",
              "choices": [{"index": 0, "text": " ok", "finish_reason": "stop", "logprobs": None}],
              "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


# ---- the upstream (run in its own process with --serve-upstream) -------------------------------
async def completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    if not body.get("stream"):
        return web.json_response(COMPLETION)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for _ in range(int(body.get("chunks", 10))):
        await asyncio.sleep(float(body.get("gap", 0.5)))
        await resp.write(b"data: " + json.dumps(COMPLETION).encode() + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def serve_upstream(port: int) -> None:
    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", lambda r: web.Response(text="ok"))
    app.router.add_get("/metrics", lambda r: web.Response(text=""))
    app.router.add_get("/v1/models", lambda r: web.json_response({"object": "list", "data": [{"id": "fast"}]}))
    web.run_app(app, host="127.0.0.1", port=port, print=None, backlog=4096)


# ---- the client --------------------------------------------------------------------------------
async def wait_ready(url: str) -> None:
    async with aiohttp.ClientSession() as s:
        for _ in range(300):
            try:
                async with s.get(url + "/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


async def latencies(url: str, n: int) -> list[float]:
    out = []
    async with aiohttp.ClientSession() as s:
        for _ in range(n):
            t = time.perf_counter()
            async with s.post(url + "/v1/completions", json={"prompt": "x"}) as r:
                await r.read()
                assert r.status == 200
            out.append(time.perf_counter() - t)
    return out


async def throughput(url: str, concurrency: int, seconds: float) -> tuple[float, int]:
    done = errors = 0
    end = time.perf_counter() + seconds

    async def worker(s: aiohttp.ClientSession) -> None:
        nonlocal done, errors
        while time.perf_counter() < end:
            try:
                async with s.post(url + "/v1/completions", json={"prompt": "x"}) as r:
                    await r.read()
                    done += r.status == 200
                    errors += r.status != 200
            except aiohttp.ClientError:
                errors += 1

    t = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as s:
        await asyncio.gather(*(worker(s) for _ in range(concurrency)))
    return done / (time.perf_counter() - t), errors


async def hold_streams(url: str, n: int, chunks: int, gap: float) -> tuple[int, int, float]:
    """n streaming requests open at once; returns (complete, failed, peak seconds all were open)."""
    ok = failed = 0
    opened = 0
    all_open = asyncio.Event()

    async def one(s: aiohttp.ClientSession) -> None:
        nonlocal ok, failed, opened
        try:
            async with s.post(url + "/v1/completions", json={"prompt": "x", "stream": True, "chunks": chunks,
                                                             "gap": gap}) as r:
                opened += 1
                if opened == n:
                    all_open.set()
                got = 0
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        got += 1
                    elif line.startswith(b"data: [DONE]"):
                        break
                ok += r.status == 200 and got == chunks
                failed += not (r.status == 200 and got == chunks)
        except (aiohttp.ClientError, asyncio.TimeoutError):
            failed += 1

    t = time.perf_counter()
    timeout = aiohttp.ClientTimeout(total=chunks * gap + 120)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as s:
        await asyncio.gather(*(one(s) for _ in range(n)))
    return ok, failed, (time.perf_counter() - t) if all_open.is_set() else 0.0


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def run(args: argparse.Namespace) -> dict:
    up_port, router_port = free_port(), free_port()
    up = subprocess.Popen([sys.executable, __file__, "--serve-upstream", str(up_port)])
    router = subprocess.Popen([sys.executable, "-m", "pagedmodel.cli", "router", "--upstream",
                               f"http://127.0.0.1:{up_port}", "--host", "127.0.0.1", "--port", str(router_port),
                               "--strategy", "least-load", "--log-level", "warning"])
    direct, routed = f"http://127.0.0.1:{up_port}", f"http://127.0.0.1:{router_port}"
    try:
        await wait_ready(direct)
        await wait_ready(routed)
        await latencies(routed, 50)   # warm-up
        res: dict = {}
        d = await latencies(direct, args.requests)
        r = await latencies(routed, args.requests)
        res["latency_ms"] = {k: {"p50": pct(v, 0.5) * 1e3, "p99": pct(v, 0.99) * 1e3} for k, v in
                             (("direct", d), ("router", r))}
        res["added_ms"] = {q: res["latency_ms"]["router"][q] - res["latency_ms"]["direct"][q] for q in ("p50", "p99")}
        print(f"latency over {args.requests} sequential requests: direct p50 {res['latency_ms']['direct']['p50']:.2f} ms "
              f"p99 {res['latency_ms']['direct']['p99']:.2f} ms; via router p50 {res['latency_ms']['router']['p50']:.2f} ms "
              f"p99 {res['latency_ms']['router']['p99']:.2f} ms; added p50 {res['added_ms']['p50']:.2f} ms, "
              f"p99 {res['added_ms']['p99']:.2f} ms")
        for name, url in (("direct", direct), ("router", routed)):
            rps, errors = await throughput(url, args.concurrency, args.seconds)
            res[f"rps_{name}"], res[f"errors_{name}"] = rps, errors
            print(f"max throughput {name}: {rps:.0f} req/s at concurrency {args.concurrency} ({errors} errors)")
        ok, failed, held = await hold_streams(routed, args.streams, args.chunks, args.gap)
        res["streams"] = {"opened": args.streams, "complete": ok, "failed": failed, "seconds": held}
        print(f"{args.streams} concurrent streams through the router ({args.chunks} chunks, {args.gap}s apart): "
              f"{ok} complete, {failed} failed, {held:.1f}s")
        return res
    finally:
        for p in (router, up):
            p.terminate()
            p.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--serve-upstream", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--streams", type=int, default=2000)
    ap.add_argument("--chunks", type=int, default=10)
    ap.add_argument("--gap", type=float, default=0.5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)   # children inherit: 2,000 streams need ~4,000 fds
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if args.serve_upstream is not None:
        serve_upstream(args.serve_upstream)
        return
    res = asyncio.run(run(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
