"""GET /v1/kv_events: the engine's prefix-cache changes as a stream of JSON lines (NDJSON).

`?since=SEQ&instance=ID` resumes after batch SEQ of engine instance ID; without them, or when the
ring no longer holds what came after SEQ, or the engine restarted (another instance), the stream
starts with a snapshot. Then one line per batch as the engine thread publishes it, and a heartbeat
line (`{"type": "heartbeat", "seq": N}`) after `HEARTBEAT_S` of quiet, so a subscriber can tell a
dead connection from a quiet cache and check it has missed nothing. The engine thread only
schedules a wake-up on the event loop; encoding and sending happen here. The stream ends when the
server starts draining (a router then resubscribes to whichever replica replaces it).
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from pagedmodel.server.engine.kv_events import KVEventLog
from .errors import APIError
from .serving import OpenAIServing

HEARTBEAT_S = 2.0
MEDIA_TYPE = "application/x-ndjson"


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def parse_since(request: Request) -> tuple[int | None, str | None]:
    raw, instance = request.query_params.get("since"), request.query_params.get("instance")
    if raw is None:
        return None, instance
    if not raw.isdigit():
        raise APIError(400, f"since must be a non-negative integer (a batch sequence number), got {raw!r}",
                       param="since", code="invalid_since")
    return int(raw), instance


async def stream_kv_events(serving: OpenAIServing, request: Request) -> StreamingResponse:
    log: KVEventLog | None = serving.engine.kv_events
    if log is None:
        raise APIError(404, "this engine publishes no KV events: prefix caching is off "
                            "(start it with --enable-prefix-caching)", code="kv_events_unavailable")
    since, instance = parse_since(request)
    return StreamingResponse(_events(serving, log, since, instance), media_type=MEDIA_TYPE,
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _events(serving: OpenAIServing, log: KVEventLog, since: int | None,
                  instance: str | None) -> AsyncIterator[bytes]:
    loop = asyncio.get_running_loop()
    wake = asyncio.Event()
    # Subscribe before reading: a batch published in between then wakes us instead of being missed.
    unsubscribe = log.subscribe(lambda: loop.call_soon_threadsafe(wake.set))
    try:
        batches = log.since(since, instance) if since is not None else None
        if batches is None:
            snap = log.snapshot()
            yield _line(snap)
            last = snap["seq"]
        else:
            yield _line({"type": "resume", "instance": log.instance, "seq": since, "block_size": log.block_size})
            last = since
            for b in batches:
                yield _line(b.to_json())
                last = b.seq
        while not serving.draining:
            try:
                await asyncio.wait_for(wake.wait(), HEARTBEAT_S)
            except asyncio.TimeoutError:
                yield _line({"type": "heartbeat", "seq": last})
                continue
            wake.clear()
            batches = log.since(last)
            if batches is None:   # this subscriber fell behind the whole ring
                snap = log.snapshot()
                yield _line(snap)
                last = snap["seq"]
                continue
            for b in batches:
                yield _line(b.to_json())
                last = b.seq
    finally:
        unsubscribe()
