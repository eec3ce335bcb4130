"""Faults injected into real processes under load: two `pagedmodel serve` engines (tiny model) behind
`pagedmodel router` (round-robin, so each engine holds some of every kind of request), then an engine
SIGSTOPped for 10 s, an engine SIGKILLed and brought back on its address, and the router itself killed
and restarted. Each test's docstring names the outcome it guards.

A stream that had started when its engine failed ends with one SSE error event, then `data: [DONE]`,
then a clean end of the response (the engine ends its own failed streams the same way).
"""
from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from .servers import Outcome, Server, body, engine, metric, router, send, upstream_healthy, wait_for

STREAM_IDLE_S = 4.0          # the router's --stream-idle-timeout here: a stream silent this long is ended
LONG = 800                   # tokens of a request meant to be in flight when the fault hits (200 could finish first)
IN_FLIGHT_TOKENS = 1000      # tokens of one that must outlast the router's kill (--max-model-len 1024 here)


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server, Server]]:
    logdir = tmp_path_factory.mktemp("faults")
    a, b = engine("engine-a", tiny_llama_dir, logdir), engine("engine-b", tiny_llama_dir, logdir)
    r = router([a, b], logdir, "--stream-idle-timeout", str(STREAM_IDLE_S))
    try:
        for s in (a, b, r):
            s.start()
        yield a, b, r
    finally:
        for s in (r, a, b):
            s.stop()


def _in_rotation(r: Server, *engines: Server, timeout: float = 30.0) -> None:
    for e in engines:
        wait_for(lambda e=e: upstream_healthy(r.url, e), timeout, f"{e.name} in the router's rotation")


async def _load(url: str, n_pairs: int, max_tokens: int = LONG) -> list[asyncio.Task[Outcome]]:
    """Pairs of streams and pairs of whole requests, started in turn: with round-robin over two engines,
    each engine gets streams and whole requests."""
    client = httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=10.0))
    tasks = []
    for i in range(n_pairs):
        stream = i % 2 == 0
        for _ in range(2):
            tasks.append(asyncio.create_task(send(client, url, body(stream, max_tokens))))
            await asyncio.sleep(0.05)
    return tasks


def _assert_clean_stream_end(o: Outcome) -> None:
    """A stream either completed, or its last event is an error followed by [DONE]; never a hang or a reset."""
    assert o.error is None and o.status == 200 and o.done, o
    if o.error_events:
        assert o.events[-1] is o.error_events[0] and len(o.error_events) == 1, o.events[-3:]
        assert {"message", "type", "code"} <= set(o.events[-1]["error"]), o.events[-1]
    else:
        assert o.events[-1].get("choices") is not None and o.events[-1]["choices"][0].get("finish_reason"), o.events[-1]


def _assert_whole_completed(o: Outcome) -> None:
    assert o.error is None and o.status == 200, o
    assert o.body["choices"][0]["finish_reason"] == "length", o.body


async def _wait_started(a: Server, tasks: list[asyncio.Task[Outcome]], timeout: float = 60.0) -> None:
    """Until engine `a` runs some of the requests (so the fault hits work in progress)."""
    deadline = time.monotonic() + timeout
    while metric(a.url, "vllm:num_requests_running") < 2:
        assert time.monotonic() < deadline and not all(t.done() for t in tasks), "the load never reached engine A"
        await asyncio.sleep(0.2)
    await asyncio.sleep(0.5)   # a few tokens out: its streams have started


def test_engine_sigstop_moves_traffic_away_and_nothing_hangs(cluster):
    """Guards: an engine hung for 10 s (SIGSTOP) costs no whole request: its scrapes time out, the router
    ejects it and retries elsewhere what it held unanswered; no client hangs: its started streams end
    after --stream-idle-timeout with an error event and [DONE]; after SIGCONT it is re-admitted and runs
    nothing for the requests the router gave up on."""
    a, b, r = cluster
    _in_rotation(r, a, b)

    async def scenario() -> tuple[list[Outcome], float]:
        tasks = await _load(r.url, 4)
        await _wait_started(a, tasks)
        stopped_at = time.monotonic()
        a.signal(signal.SIGSTOP)
        try:
            # requests sent while it is stopped must go around it too
            later = await _load(r.url, 2, max_tokens=16)
            await asyncio.to_thread(wait_for, lambda: upstream_healthy(r.url, a) is False, 15,
                                    "the hung engine ejected")
            await asyncio.sleep(max(0.0, 10 - (time.monotonic() - stopped_at)))
        finally:
            a.signal(signal.SIGCONT)
        return list(await asyncio.gather(*tasks, *later)), stopped_at

    outcomes, stopped_at = asyncio.run(scenario())
    bound = 60.0   # ejection (a few seconds), then the retry's own generation on the other engine, loaded machine
    for o in outcomes:
        assert o.ended - stopped_at < bound, f"{o.kind} request took {o.ended - stopped_at:.0f} s after SIGSTOP"
        _assert_clean_stream_end(o) if o.kind == "stream" else _assert_whole_completed(o)
    assert any(o.error_events for o in outcomes if o.kind == "stream"), "no stream was on the stopped engine"
    _in_rotation(r, a, timeout=20)
    wait_for(lambda: metric(a.url, "vllm:num_requests_running") + metric(a.url, "vllm:num_requests_waiting") == 0,
             20, "the resumed engine abandoning the requests the router gave up on")


def test_engine_sigkill_retries_unstarted_requests_and_readmits_the_replacement(cluster):
    """Guards: when an engine is SIGKILLed under load, every whole (non-streamed) request completes (those
    it held had sent nothing to the client and are retried on the other replica); its started streams end
    with an error event and [DONE], not a hung connection; the router ejects it within its probe interval
    and re-admits a new engine on the same address, which then serves requests."""
    a, b, r = cluster
    _in_rotation(r, a, b)
    retries_before = metric(r.url, "pagedmodel_router_retries_total")

    async def scenario() -> tuple[list[Outcome], float]:
        tasks = await _load(r.url, 4)
        await _wait_started(a, tasks)
        a.signal(signal.SIGKILL)
        ejected_after = await asyncio.to_thread(wait_for, lambda: upstream_healthy(r.url, a) is False, 10,
                                                "the dead engine ejected")
        return list(await asyncio.gather(*tasks)), ejected_after

    outcomes, ejected_after = asyncio.run(scenario())
    for o in outcomes:
        _assert_clean_stream_end(o) if o.kind == "stream" else _assert_whole_completed(o)
    assert any(o.error_events for o in outcomes if o.kind == "stream"), "no stream was on the killed engine"
    assert metric(r.url, "pagedmodel_router_retries_total") > retries_before
    assert ejected_after < 5.0   # 3 scrapes 0.5 s apart, or the first failed request

    a.start()   # a new process on the same address
    _in_rotation(r, a, timeout=20)   # the probe's backoff is capped at 2 s here

    async def after() -> list[Outcome]:
        return list(await asyncio.gather(*await _load(r.url, 2, max_tokens=8)))
    for o in asyncio.run(after()):
        _assert_clean_stream_end(o) if o.kind == "stream" else _assert_whole_completed(o)
    assert metric(a.url, "vllm:request_success_total") > 0, "the re-admitted engine served nothing"


def test_router_restart_under_load_costs_only_the_restart_window(cluster):
    """Guards: killing the router under load and starting it again on its address gives clients connection
    errors only between the kill and the new router answering, and leaves nothing running in the engines
    for the requests whose client (the old router) is gone: they are aborted, not generated to the end."""
    a, b, r = cluster
    _in_rotation(r, a, b)
    _wait_idle(a, b)
    aborted_before = _aborted(a, b)
    window: dict[str, float] = {}

    seen: list[Outcome] = []

    async def clients(done: asyncio.Event) -> None:
        """Short requests in a loop until `done`: some overlap the kill, the rest come before or after it."""
        async def loop(stream: bool) -> None:
            async with httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=5.0)) as c:
                while not done.is_set():
                    seen.append(await send(c, r.url, body(stream, 16), timeout=60))
                    await asyncio.sleep(0.05)
        await asyncio.gather(*(loop(i % 2 == 0) for i in range(4)))

    async def scenario() -> list[Outcome]:
        # Requests that cannot finish before the kill: max_tokens near --max-model-len, and the kill comes
        # once the engines run all four (before any steady request starts, so they are the ones counted)
        # and the steady clients have completed a handful of 16-token requests.
        in_flight = await _load(r.url, 2, max_tokens=IN_FLIGHT_TOKENS)
        await asyncio.to_thread(wait_for, lambda: _running(a, b) >= len(in_flight), 60,
                                "the engines running the long requests")
        done = asyncio.Event()
        steady = asyncio.create_task(clients(done))
        await asyncio.to_thread(wait_for, lambda: sum(o.status == 200 for o in list(seen)) >= 4, 60,
                                "the steady clients completing requests through the router")
        assert not any(t.done() for t in in_flight), "a long request ended before the router was killed"
        window["kill"] = time.monotonic()
        r.signal(signal.SIGKILL)
        # with no router, nothing may keep generating for the clients it had
        await asyncio.to_thread(wait_for, lambda: _running(a, b) + _waiting(a, b) == 0, 60,
                                "the engines aborting the dead router's requests")
        await asyncio.to_thread(r.start)
        window["back"] = time.monotonic()
        # keep the steady clients going until some have started well after the new router answered
        await asyncio.to_thread(wait_for, lambda: sum(o.started > window["back"] + 1.0 and o.status == 200
                                                      for o in list(seen)) >= 4, 60,
                                "requests through the restarted router")
        done.set()
        await steady
        return list(await asyncio.gather(*in_flight))

    cut = asyncio.run(scenario())
    assert all(o.error for o in cut), [o for o in cut if not o.error]   # their connection died with the router
    # each cut request was aborted in its engine (the steady requests cut by the kill add to this)
    assert _aborted(a, b) >= aborted_before + len(cut)
    failed = [o for o in seen if o.error or o.status != 200]
    assert seen and len(failed) < len(seen)
    for o in failed:   # only transport errors, and only for requests that overlapped the restart window
        assert o.error is not None and o.ended >= window["kill"] and o.started <= window["back"] + 1.0, o
    after = [o for o in seen if o.started > window["back"] + 1.0]
    assert after and all(o.error is None and o.status == 200 for o in after)
    for o in after:
        _assert_clean_stream_end(o) if o.kind == "stream" else _assert_whole_completed(o)


def _running(*engines: Server) -> float:
    return sum(metric(e.url, "vllm:num_requests_running") for e in engines)


def _waiting(*engines: Server) -> float:
    return sum(metric(e.url, "vllm:num_requests_waiting") for e in engines)


def _aborted(*engines: Server) -> float:
    return sum(metric(e.url, "vllm:request_success_total", finished_reason="abort") for e in engines)


def _wait_idle(*engines: Server) -> None:
    """Until earlier tests' requests (abandoned ones included) have left the engines."""
    wait_for(lambda: _running(*engines) + _waiting(*engines) == 0, 60, "the engines idle")

