"""A request still unanswered when the drain runs out gets 503 + X-PagedModel-Unserved (the router then
retries it elsewhere), not uvicorn's plain 500; a started response is left to be cut."""
from __future__ import annotations

import asyncio
import json
import signal
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from pagedmodel.server.api.drain_cutoff import DrainCutoffMiddleware
from pagedmodel.server.api.errors import UNSERVED_HEADER
from support import wait_until

from .conftest import ServerProcess


def _cancelled_midway(draining: bool, start_response: bool) -> list[dict[str, Any]]:
    """Messages sent for a request whose handler is cancelled while it waits."""
    sent: list[dict[str, Any]] = []

    async def handler(_scope, _receive, send) -> None:
        if start_response:
            await send({"type": "http.response.start", "status": 200, "headers": []})
        await asyncio.Event().wait()

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def main() -> None:
        app = DrainCutoffMiddleware(handler, is_draining=lambda: draining)
        task = asyncio.create_task(app({"type": "http"}, None, send))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):   # the cancellation goes on, as uvicorn meant it
            await task
    asyncio.run(main())
    return sent


def test_unstarted_request_cut_by_the_drain_gets_the_unserved_503():
    start, body = _cancelled_midway(draining=True, start_response=False)
    assert start["status"] == 503
    headers = {k.decode(): v.decode() for k, v in start["headers"]}
    assert headers[UNSERVED_HEADER.lower()] == "shutting_down" and headers["content-type"] == "application/json"
    assert json.loads(body["body"])["error"]["code"] == "shutting_down"


def test_started_responses_and_cancellations_outside_a_drain_get_nothing_more():
    assert [m["status"] for m in _cancelled_midway(draining=True, start_response=True)] == [200]
    assert _cancelled_midway(draining=False, start_response=False) == []


@pytest.mark.slow
def test_non_streamed_request_left_at_the_shutdown_timeout_is_refused_unserved(server_model_dir: Path,
                                                                              tmp_path: Path) -> None:
    # One sequence at a time and three 1,000-token requests: whatever the CPU's speed, the queued ones
    # cannot all finish in the 0.5 s drain window (a lone 480-token request once did, and got a 200).
    srv = ServerProcess(server_model_dir, tmp_path / "server.log", "--max-model-len", "1024",
                        "--max-num-seqs", "1", "--kv-cache-memory", str(4 << 20),
                        "--shutdown-timeout", "0.5").wait_ready()
    replies: list[httpx.Response] = []
    body = {"prompt": "cutoff", "max_tokens": 1000, "ignore_eos": True}
    threads = [threading.Thread(target=lambda: replies.append(
        httpx.post(srv.base_url + "/v1/completions", json=body, timeout=60)), daemon=True) for _ in range(3)]
    try:
        for t in threads:
            t.start()
        assert wait_until(lambda: srv.metrics().get("vllm:num_requests_running", 0) >= 1, timeout=30)
        assert wait_until(lambda: srv.metrics().get("vllm:num_requests_waiting", 0) >= 1, timeout=30)
        srv.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        assert srv.proc.wait(30) == 0, srv.log()
    finally:
        srv.stop()
    assert len(replies) == 3, srv.log()[-2000:]
    unserved = [r for r in replies if r.status_code != 200]
    assert unserved, (replies, srv.log()[-2000:])
    for reply in unserved:
        assert reply.status_code == 503, (reply, reply.text)
        assert reply.headers[UNSERVED_HEADER] == "shutting_down"
        assert reply.json()["error"]["code"] == "shutting_down"
