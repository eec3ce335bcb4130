"""Every limit of docs/limits.md on `pagedmodel router`, and --api-key on each of its routes: a hostile
request is refused by the router itself (the upstream never sees it) with the OpenAI error body and
the status the engine would give (400/401/408/413/431/503), and the router serves normally after."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from pagedmodel.server.http_common.http_limits import HTTPLimits
from raw_http import connect, post_head, send_raw, trickle
from support import assert_openai_error
from fakes import FakeUpstream, run, running_router

LIMITS = HTTPLimits(max_body_bytes=128 << 10, max_header_bytes=4096, request_read_timeout=1.0, keep_alive_timeout=1.0,
                    max_connections=6, stream_idle_timeout=0.3, max_prompt_tokens=32, max_n=2, max_best_of=3,
                    max_logprobs=2, max_stop_strings=2, max_stop_string_len=8)
KEY = "router-key"


def port_of(base: str) -> int:
    return int(base.rsplit(":", 1)[1])


async def limited_router(up: FakeUpstream, **cfg):
    await up.start()
    return running_router(upstreams=[up.url], limits=LIMITS, **cfg)


FIELDS = [
    ({"n": 3}, "n"), ({"best_of": 4}, "best_of"), ({"logprobs": 3}, "logprobs"), ({"top_logprobs": 3}, "top_logprobs"),
    ({"stop": ["a", "b", "c"]}, "stop"), ({"stop": [f"s{i}" for i in range(10_000)]}, "stop"),
    ({"stop": "123456789"}, "stop"), ({"stop_token_ids": [1, 2, 3]}, "stop_token_ids"),
    ({"prompt": [7] * 33}, "prompt"), ({"prompt": [[7] * 2, [7] * 33]}, "prompt"),
]


def test_field_limits_and_hostile_bodies_are_refused_before_the_upstream() -> None:
    async def main() -> None:
        up = FakeUpstream("a")
        async with await limited_router(up) as (_app, base), aiohttp.ClientSession() as s:
            for fields, param in FIELDS:
                async with s.post(base + "/v1/completions", json={"prompt": "x", **fields}) as r:
                    assert_openai_error(r.status, await r.read(), 400, param)
            hostile = [(b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", 400),   # deeply nested
                       (b'{"prompt": "\xff\xfe"}', 400),                                   # invalid UTF-8
                       (b'{"prompt": "' + b"a" * (10 << 20) + b'"}', 413)]                 # 10 MB
            for body, status in hostile:
                async with s.post(base + "/v1/completions", data=body,
                                  headers={"Content-Type": "application/json"}) as r:
                    assert_openai_error(r.status, await r.read(), status)

            async def chunks():
                yield b'{"prompt": "'
                for _ in range(10):
                    yield b"a" * (1 << 20)
            async with s.post(base + "/v1/completions", data=chunks()) as r:   # no Content-Length
                assert_openai_error(r.status, await r.read(), 413)
            assert up.served == []
            async with s.post(base + "/v1/completions", json={"prompt": [7] * 32, "n": 2, "stop": ["12345678"]}) as r:
                assert r.status == 200 and len(up.served) == 1
        await up.stop()
    run(main())


def test_slow_clients_and_big_heads_get_bounded_answers() -> None:
    async def main() -> None:
        up = FakeUpstream("a")
        async with await limited_router(up) as (_app, base):
            port = port_of(base)
            heads = "".join(f"X-H{i}: {'a' * 60}\r\n" for i in range(80))   # 80 short lines, ~5.5 kB
            r = await asyncio.to_thread(send_raw, port, post_head("/v1/completions", 2, heads) + b"{}")
            assert assert_openai_error(r.status or 0, r.body, 431)["code"] == "headers_too_large"
            # one line over the limit: aiohttp's parser refuses it; the answer is still the JSON 431, then close
            r = await asyncio.to_thread(send_raw, port, post_head("/v1/completions", 2, f"X-Long: {'a' * 5000}\r\n"))
            assert assert_openai_error(r.status or 0, r.body, 431)["code"] == "headers_too_large"
            r = await asyncio.to_thread(send_raw, port, b"GET /v1/models HTTP/1.1\r\nBad Header\r\n\r\n")
            assert assert_openai_error(r.status or 0, r.body, 400)["code"] == "invalid_http_request"
            body = json.dumps({"prompt": "x"}).encode()
            r = await asyncio.to_thread(trickle, port, post_head("/v1/completions", len(body) + 50), body + b" " * 50,
                                        0.2, 15)
            assert_openai_error(r.status or 0, r.body, 408)
            assert r.elapsed < LIMITS.request_read_timeout + 3
            # headers trickled: the JSON 408 once --request-read-timeout has passed since the head's first byte
            r = await asyncio.to_thread(trickle, port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n",
                                        b"X-Slow: aaaa", 0.2, 15)
            assert assert_openai_error(r.status or 0, r.body, 408)["code"] == "request_timeout"
            assert r.elapsed < LIMITS.request_read_timeout + 3
            assert up.served == []
        await up.stop()
    run(main())


def test_a_head_gets_the_read_timeout_not_the_shorter_keep_alive_and_idle_connections_still_close() -> None:
    """A trickled head is answered 408 at --request-read-timeout even when --keep-alive-timeout is
    shorter (aiohttp alone would close it then, unanswered); a connection that sends nothing, or
    nothing after a served request, is still closed silently at the keep-alive timeout."""
    limits = HTTPLimits(request_read_timeout=2.5, keep_alive_timeout=0.5)

    async def main() -> None:
        up = FakeUpstream("a")
        await up.start()
        async with running_router(upstreams=[up.url], limits=limits) as (_app, base):
            port = port_of(base)
            r = await asyncio.to_thread(trickle, port, b"GET /v1/models HTTP/1.1\r\n", b"X-Slow: aaaaaaaa", 0.2, 15)
            assert_openai_error(r.status or 0, r.body, 408)
            assert limits.request_read_timeout - 0.5 < r.elapsed < limits.request_read_timeout + 3
            sock = await asyncio.to_thread(connect, port)
            try:
                await asyncio.sleep(1.5)   # nothing sent: closed at the keep-alive timeout, no 408 written
                assert await asyncio.to_thread(sock.recv, 4096) == b""
            finally:
                sock.close()
            sock = await asyncio.to_thread(connect, port)
            try:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                sock.settimeout(10)
                first = await asyncio.to_thread(sock.recv, 65536)
                assert first.startswith(b"HTTP/1.1 200")
                await asyncio.sleep(1.5)   # idle after a served request: closed, no 408
                assert await asyncio.to_thread(sock.recv, 4096) == b""
            finally:
                sock.close()
            assert up.served == []
        await up.stop()
    run(main())


def test_connections_past_the_limit_get_503_and_recover() -> None:
    async def main() -> None:
        up = FakeUpstream("a")
        async with await limited_router(up) as (_app, base), aiohttp.ClientSession() as s:
            idle = [await asyncio.to_thread(connect, port_of(base)) for _ in range(6)]
            await asyncio.sleep(0.1)
            async with s.post(base + "/v1/completions", json={"prompt": "x"}) as r:
                err = assert_openai_error(r.status, await r.read(), 503)
                assert err["code"] == "too_many_connections" and r.headers["Retry-After"] == "1"
            for sock in idle:
                sock.close()
            await asyncio.sleep(0.2)
            async with s.post(base + "/v1/completions", json={"prompt": "x"}) as r:
                assert r.status == 200
        await up.stop()
    run(main())


def test_a_stalled_stream_is_ended_after_the_idle_timeout() -> None:
    async def main() -> None:
        up = FakeUpstream("a")
        up.between = asyncio.Event()   # sends its first chunk, then nothing, never
        async with await limited_router(up) as (_app, base), aiohttp.ClientSession() as s:
            async with s.post(base + "/v1/completions", json={"prompt": "x", "stream": True, "n_chunks": 2}) as r:
                text = (await asyncio.wait_for(r.read(), 10)).decode()
            events = [json.loads(e[6:]) for e in text.split("\n\n") if e.startswith("data: {")]
            assert events[0]["choices"][0]["text"] == "t0 "
            assert "stream-idle-timeout" in events[-1]["error"]["message"]
            up.between.set()
        await up.stop()
    run(main())


GET_ROUTES = ["/v1/models", "/openapi.json"]
POST_ROUTES = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/v1/embeddings"]


def test_api_key_guards_every_route_but_the_exempt_ones() -> None:
    async def main() -> None:
        up = FakeUpstream("a")
        async with await limited_router(up, api_key=KEY) as (_app, base), aiohttp.ClientSession() as s:
            for bad in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": "Basic " + KEY}):
                for method, path in [("GET", p) for p in GET_ROUTES] + [("POST", p) for p in POST_ROUTES]:
                    async with s.request(method, base + path, json={"prompt": "x"}, headers=bad) as r:
                        err = assert_openai_error(r.status, await r.read(), 401)
                        assert err["code"] == "invalid_api_key" and r.headers["WWW-Authenticate"] == "Bearer"
            assert up.served == []
            for path in ("/health", "/ping", "/metrics"):
                async with s.get(base + path) as r:
                    assert r.status == 200
            ok = {"Authorization": f"Bearer {KEY}"}
            async with s.post(base + "/v1/completions", json={"prompt": "x"}, headers=ok) as r:
                assert r.status == 200 and (await r.json())["auth"] == f"Bearer {KEY}"   # forwarded as sent
            async with s.get(base + "/no/such/path", headers=ok) as r:
                assert_openai_error(r.status, await r.read(), 404)
            async with s.delete(base + "/v1/completions", headers=ok) as r:
                assert_openai_error(r.status, await r.read(), 405)
        await up.stop()
    run(main())


def test_auth_exempt_empty_guards_the_probes_too() -> None:
    async def main() -> None:
        up = FakeUpstream("a")
        async with await limited_router(up, api_key=KEY, auth_exempt=()) as (_app, base), aiohttp.ClientSession() as s:
            for path in ("/health", "/metrics"):
                async with s.get(base + path) as r:
                    assert_openai_error(r.status, await r.read(), 401)
        await up.stop()
    run(main())


@pytest.mark.parametrize("argv", [["--max-n", "17"], ["--max-logprobs", "21"], ["--auth-exempt", "health"]])
def test_cli_refuses_limits_beyond_their_ceiling(argv: list[str]) -> None:
    import argparse

    from pagedmodel.server.router.app import add_arguments, config_from_args
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(parser)
    with pytest.raises((ValueError, argparse.ArgumentError)):
        config_from_args(parser.parse_args(["--upstream", "http://x:1", *argv]))
