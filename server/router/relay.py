"""Forwarding a request to an upstream and relaying the answer back chunk by chunk.

Up to `max_attempts` attempts: a connection failure before any response byte, an upstream ejected
(dead or hung) while the request waited for its answer, or a 503 the engine marks as refused
unstarted (X-PagedModel-Unserved: draining after SIGTERM) is retried on another upstream; a started
response never is. Mid-stream failures end an SSE stream with an OpenAI-style error event, which the
`openai` SDK raises as APIError.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

import aiohttp
from aiohttp import web

from pagedmodel.server.http_common.errors import UNSERVED_HEADER, APIError
from .dispatch import Dispatcher
from .http_guard import refusal
from .metrics import RouterMetrics
from .queue import QueueFull, QueueTimeout
from .request import RoutedRequest
from .upstreams import Upstream, UpstreamPool
from .usage import UsageMeter

logger = logging.getLogger("pagedmodel.router")

# Hop-by-hop headers (RFC 9110 §7.6.1) and ones the proxy recomputes are never forwarded.
HOP_HEADERS = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                         "transfer-encoding", "upgrade", "host", "content-length"})


class UpstreamEjected(ConnectionError):
    """The upstream was ejected (dead or hung) while a request waited for its answer."""


_CONNECT_ERRORS = (UpstreamEjected, aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError,
                   aiohttp.ServerTimeoutError, asyncio.TimeoutError)


def forwarded_headers(request: web.Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}


class Relay:
    """Sends a request to the upstream dispatch grants it, retrying what no engine started."""

    def __init__(self, pool: UpstreamPool, dispatcher: Dispatcher, metrics: RouterMetrics, *, max_attempts: int,
                 stream_idle_timeout: float, clock: Callable[[], float]) -> None:
        self.pool = pool
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.max_attempts = max_attempts
        self.stream_idle_timeout = stream_idle_timeout
        self.clock = clock
        self.session: aiohttp.ClientSession | None = None   # set when the app starts

    async def forward(self, request: web.Request, routed: RoutedRequest) -> web.StreamResponse:
        """The upstream's answer relayed to the client, or the router's own 502/503 when none gave one."""
        unserved: str | None = None   # the last attempt's refusal, when an engine refused it unstarted
        for attempt in range(self.max_attempts):
            try:
                up = await self.dispatcher.acquire(routed)
            except QueueFull as exc:
                return refusal(503, "router queue is full", code="queue_full", retry_after=exc.retry_after)
            except QueueTimeout as exc:
                return refusal(503, f"no upstream could take the request: {exc}", code="queue_timeout",
                               retry_after=exc.retry_after)
            routed.tried.add(up.url)
            started = self.clock()
            try:
                upstream_resp = await self._send_upstream(up, routed)
            except _CONNECT_ERRORS as exc:
                # Nothing reached the client yet: count the failure and try another replica.
                logger.warning("upstream %s failed before responding (%s); retrying elsewhere", up.url, exc)
                if self.pool.record_failure(up):
                    self.metrics.healthy.labels(up.url).set(0)
                self._done_with(up, routed)
                unserved = None
                self._count_retry(attempt)
                continue
            if (reason := _unserved_reason(upstream_resp)) is not None:
                # The engine refused before starting (draining after SIGTERM, dead): another replica
                # takes it; relaying this 503 would lose a request during every scale-down or rollout.
                upstream_resp.release()
                self.pool.record_unserved(up, reason)
                self._done_with(up, routed)
                unserved = reason
                self._count_retry(attempt)
                continue
            try:
                relayed = await self._relay(request, upstream_resp, up, routed)
            except BaseException:
                upstream_resp.close()   # client gone or relay broken: drop the upstream connection (aborts it)
                raise
            else:
                upstream_resp.release()
                return relayed
            finally:
                self.metrics.latency.labels(up.url).observe(max(0.0, self.clock() - started))
                self._done_with(up, routed)
        if unserved is not None:
            return refusal(503, f"no replica could take the request after {self.max_attempts} attempts "
                                f"(last: {unserved})", code="upstreams_unavailable", retry_after=1)
        return refusal(502, f"no upstream answered after {self.max_attempts} attempts", code="upstream_unreachable")

    def _done_with(self, up: Upstream, routed: RoutedRequest) -> None:
        self.dispatcher.prefilled(routed.chains)
        self.dispatcher.release(up)

    def _count_retry(self, attempt: int) -> None:
        if attempt + 1 < self.max_attempts:
            self.metrics.retries.inc()

    async def _send_upstream(self, up: Upstream, routed: RoutedRequest) -> aiohttp.ClientResponse:
        """The upstream's response, unless the pool ejects it first (its scrapes or other requests failed:
        dead or hung, e.g. SIGSTOPped). A non-streamed answer sends nothing until it is done, so silence
        alone cannot tell a hung engine from a long generation; the ejection can, and then the request,
        which sent the client nothing yet, is dropped here and retried elsewhere by the caller."""
        assert self.session is not None
        deadline = asyncio.timeout(None)   # in this task: aiohttp's response must be read where it was made

        def on_eject() -> None:
            deadline.reschedule(asyncio.get_running_loop().time())
        up.on_eject.add(on_eject)
        try:
            async with deadline:
                return await self.session.request(routed.method, up.url + routed.path_qs, data=routed.body or None,
                                                  headers=routed.headers)
        except TimeoutError:
            if deadline.expired():   # closes its connection: the engine sees the disconnect and aborts it
                raise UpstreamEjected(f"{up.url} was taken out of rotation before it answered") from None
            raise
        finally:
            up.on_eject.discard(on_eject)

    async def _relay(self, request: web.Request, upstream_resp: aiohttp.ClientResponse, up: Upstream,
                     routed: RoutedRequest) -> web.StreamResponse:
        """Copy status and headers, then each chunk as it arrives (never the whole body at once). The first
        chunk with generated text (any chunk of a non-streamed body) ends the request's pending prefill."""
        # Only gateway-type answers count against the replica: a 500 may be one poisoned request (three
        # of them must not eject every healthy engine) and a 503 is back-pressure from a live engine.
        if upstream_resp.status in (502, 504):
            self.pool.record_failure(up)
        else:
            self.pool.record_success(up)
        resp = web.StreamResponse(status=upstream_resp.status, reason=upstream_resp.reason)
        for k, v in upstream_resp.headers.items():
            if k.lower() not in HOP_HEADERS:
                resp.headers.add(k, v)
        is_sse = upstream_resp.content_type == "text/event-stream"
        meter = UsageMeter(streamed=is_sse)
        if (adm := routed.admission) is not None:
            for k, v in adm.headers.items():
                resp.headers[k] = v
            adm.meter, adm.relayed, adm.status = meter, True, upstream_resp.status
        await resp.prepare(request)
        # A stream whose engine stalls (hung, SIGSTOPped) is ended after --stream-idle-timeout, not held open.
        idle = self.stream_idle_timeout if is_sse else None
        try:
            while True:
                try:
                    chunk = await asyncio.wait_for(upstream_resp.content.readany(), idle)
                except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
                    return await self._upstream_failed_mid_response(request, resp, up, exc, idle if is_sse else None)
                if not chunk:
                    break
                meter.feed(chunk)
                if meter.text_events or not is_sse:
                    self.dispatcher.prefilled(routed.chains)
                await resp.write(chunk)
            meter.finish()
            await resp.write_eof()
        except ConnectionResetError:
            # The client left mid-response: not the engine's fault. Closing the upstream response drops the
            # engine's connection, which aborts the request there and frees its KV blocks.
            logger.info("client left mid-response from %s; request dropped upstream", up.url)
            upstream_resp.close()
        return resp

    async def _upstream_failed_mid_response(self, request: web.Request, resp: web.StreamResponse, up: Upstream,
                                            exc: Exception, sse_idle: float | None) -> web.StreamResponse:
        """The engine broke off after the headers went out: an SSE error event and [DONE] end a stream
        (``sse_idle`` is its --stream-idle-timeout); any other body is cut short, the only honest signal left."""
        logger.warning("upstream %s failed mid-response: %s", up.url, exc)
        self.pool.record_failure(up)
        if sse_idle is None:
            if request.transport is not None:
                request.transport.close()
            return resp
        why = str(exc) or f"no data for {sse_idle:g}s (--stream-idle-timeout)"
        err = APIError(502, f"upstream failed mid-stream: {why}", code="upstream_failed").body()
        await resp.write(b"data: " + json.dumps(err).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")   # as the engine ends its failed streams
        await resp.write_eof()
        return resp


def _unserved_reason(resp: aiohttp.ClientResponse) -> str | None:
    """Why the engine refused the request before starting it (its 503 says so in a header), else None."""
    if resp.status != 503:
        return None
    return resp.headers.get(UNSERVED_HEADER)
