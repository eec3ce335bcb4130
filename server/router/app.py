"""`pagedmodel router`: an asynchronous OpenAI-API proxy in front of engine replicas.

Per request: rate limit (429) -> the tenant's request and token limits (429 with OpenAI's
x-ratelimit-* headers, tenancy.py) -> free upstream slot now, else the bounded priority queue, fair
between tenants (503 when full or timed out) -> strategy picks the upstream -> the response is
streamed back chunk by chunk, its usage settling the tenant's reservation. A connection failure
before any response byte, an upstream ejected (dead or hung) while the request waited for its answer,
or a 503 the engine marks as refused unstarted (X-PagedModel-Unserved: draining after SIGTERM), is
retried on another upstream; a started response never is. An upstream
failing repeatedly is ejected and re-probed (upstreams.py). Mid-stream failures end an SSE stream
with an OpenAI-style error event, which the `openai` SDK raises as APIError.

Upstreams come from `--upstream URL` (static) or `--discover SELECTOR` (Ready pods, watched via
the Kubernetes API; see discovery.py).

The router's own `/health` answers 200 whenever the router serves, even with no upstream ready:
requests then wait in the queue (up to --queue-timeout), which is what scale-from-zero needs.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from pagedmodel.server.http_common.api_key import DEFAULT_AUTH_EXEMPT, add_auth_arguments
from pagedmodel.server.http_common.errors import UNSERVED_HEADER, APIError
from pagedmodel.server.http_common.http_limits import (HTTPLimits, add_limit_arguments, limits_from_args,
                                                       non_negative_int, positive_int)
from .adapter_affinity import Outcome, Served, choose, is_served, served_names
from .admission import RateLimiter
from .discovery import PodDiscovery, current_namespace
from .http_guard import JSONErrorsAppRunner, guard_middleware, read_json
from .metrics import RouterMetrics
from .model_catalog import ModelCatalog
from .prefix_cache import PrefixCacheRouting
from .prefix_index import PromptChains
from .prompt_tokens import load_tokenizer
from .queue import AdmissionQueue, QueueFull, QueueTimeout, Ticket
from .strategies import STRATEGIES, Router
from .tenancy import Admission, Tenancy
from .token_limits import Limits, TenantLimiter, TokenDecision, parse_tenant_limit
from .usage import UsageMeter
from .upstreams import Upstream, UpstreamPool, scrape_once

logger = logging.getLogger("pagedmodel.router")

# Hop-by-hop headers (RFC 9110 §7.6.1) and ones the proxy recomputes are never forwarded.
_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                  "transfer-encoding", "upgrade", "host", "content-length"})
# On SIGTERM the router stops accepting and gives running requests (streams relayed from engines) this
# long; the operator's router pods get a grace period above it (operator/desired_state.py).
DRAIN_S = 60.0
# The engine answers these for the model (base or LoRA adapter) the body's `model` names, 404 for others.
_MODEL_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"})
class UpstreamEjected(ConnectionError):
    """The upstream was ejected (dead or hung) while a request waited for its answer."""


_CONNECT_ERRORS = (UpstreamEjected, aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError,
                   aiohttp.ServerTimeoutError, asyncio.TimeoutError)


@dataclass
class RouterConfig:
    upstreams: list[str]
    strategy: str = "kv-aware"
    rate_limit: float | None = None
    burst: int | None = None
    client_rate_limit: float | None = None
    client_burst: int | None = None
    client_header: str | None = None
    max_queue_len: int = 256
    queue_timeout: float = 30.0
    max_inflight_per_upstream: int | None = None
    scrape_interval: float = 1.0
    connect_timeout: float = 5.0
    failures_to_eject: int = 3
    eject_backoff: float = 1.0
    eject_max_backoff: float = 30.0
    max_attempts: int = 3
    tenant_header: str | None = None
    tenant_requests_per_minute: float | None = None
    tenant_tokens_per_minute: float | None = None
    tenant_overrides: dict[str, Limits] = field(default_factory=dict)
    default_max_tokens: int = 256      # completion tokens reserved for a request that names no max_tokens
    api_key: str | None = None         # required of clients on every path but auth_exempt (http_guard.py)
    auth_exempt: tuple[str, ...] = DEFAULT_AUTH_EXEMPT
    limits: HTTPLimits = field(default_factory=HTTPLimits)   # docs/limits.md, the engine's flags and checks
    tokenizer: str | None = None       # the model (dir or name) whose tokenizer prefix-cache routing uses
    upstream_api_key: str | None = None   # for the router's own calls to engines (their KV-event streams)


def _error(status: int, message: str, *, code: str | None = None, retry_after: int | None = None,
           err_type: str | None = None, param: str | None = None,
           headers: dict[str, str] | None = None) -> web.Response:
    headers = dict(headers or {})
    if retry_after is not None:
        headers["Retry-After"] = str(retry_after)
    return web.json_response(APIError(status, message, code=code, err_type=err_type, param=param).body(),
                             status=status, headers=headers or None)


def _tools_key(tools: Any) -> str:
    """Tool definitions as canonical JSON: the same tools (whatever their key order) give the same key."""
    return "tools:" + json.dumps(tools, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _prompt_key(body: dict[str, Any]) -> str:
    """The leading text prefix affinity hashes: the prompt, or the chat messages rendered in order.

    A chat request's tools go where the engine renders them, into the system prompt ahead of the
    conversation (after the first system message's own text), so requests sharing a system prompt and
    tools share an upstream, and with it their cached prefix.
    """
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]   # a batch of prompts: the first one decides
    if isinstance(prompt, list):   # token ids
        return ",".join(map(str, prompt))
    if isinstance(prompt, str):
        return prompt
    messages = body.get("messages")
    if isinstance(messages, list):
        parts = []
        for m in messages:
            if isinstance(m, dict):
                content = m.get("content")
                parts.append(f"{m.get('role')}:{content if isinstance(content, str) else json.dumps(content)}")
        tools = body.get("tools")
        if tools:
            first_is_system = bool(messages) and isinstance(messages[0], dict) and messages[0].get("role") == "system"
            parts.insert(1 if first_is_system else 0, _tools_key(tools))
        return "\n".join(parts)
    return ""


@dataclass
class _Pending:
    prompt: str
    chains: PromptChains | None = None   # the prompt's block hashes (prefix-cache strategy only)
    upstream: Upstream | None = None
    admission: Admission | None = None
    exclude: set[str] = field(default_factory=set)
    model: str | None = None             # the request's `model`: only upstreams serving it may take it


class RouterApp:
    """Owns the pool, limiter, queue and strategy; builds the aiohttp application."""

    def __init__(self, cfg: RouterConfig, *, clock: Callable[[], float] = time.monotonic,
                 discovery: PodDiscovery | None = None, prefix_cache: PrefixCacheRouting | None = None) -> None:
        self.cfg = cfg
        if prefix_cache is None and cfg.strategy == "prefix-cache":
            # Without --tokenizer the engines' /tokenize renders prompts (prompt_tokens.py weighs both).
            prefix_cache = PrefixCacheRouting(load_tokenizer(cfg.tokenizer) if cfg.tokenizer else None,
                                              api_key=cfg.upstream_api_key)
        self.prefix_cache = prefix_cache
        self.discovery = discovery
        self.clock = clock
        self.pool = UpstreamPool(cfg.upstreams, max_inflight=cfg.max_inflight_per_upstream,
                                 consecutive_failures_to_eject=cfg.failures_to_eject, base_backoff=cfg.eject_backoff,
                                 max_backoff=cfg.eject_max_backoff, stale_after=max(5.0, 5 * cfg.scrape_interval),
                                 clock=clock)
        self.limiter = RateLimiter(cfg.rate_limit, cfg.burst, client_rate=cfg.client_rate_limit,
                                   client_burst=cfg.client_burst, client_header=cfg.client_header, clock=clock)
        self.queue = AdmissionQueue(cfg.max_queue_len, cfg.queue_timeout, clock=clock)
        self.router = Router(cfg.strategy)
        self.catalog = ModelCatalog(self.pool, api_key=cfg.upstream_api_key, clock=clock)
        self.metrics = RouterMetrics()
        limits = Limits(cfg.tenant_requests_per_minute, cfg.tenant_tokens_per_minute)
        self.tenancy = Tenancy(TenantLimiter(limits, overrides=cfg.tenant_overrides, header=cfg.tenant_header,
                                             clock=clock), self.queue, self.metrics,
                               default_max_tokens=cfg.default_max_tokens, clock=clock)
        self.session: aiohttp.ClientSession | None = None
        self._background: asyncio.Task[None] | None = None
        self._gauged: set[str] = set()
        self.http_server: web.Server | None = None   # set by serve(): its open client connections are gauged

    # lifecycle

    def build(self) -> web.Application:
        cfg = self.cfg
        guard = guard_middleware(cfg.limits, cfg.api_key, cfg.auth_exempt, count=self._count,
                                 connections=lambda: len(self.http_server.connections) if self.http_server else 0)
        app = web.Application(client_max_size=cfg.limits.max_body_bytes, middlewares=[guard])
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_endpoint)
        app.router.add_get("/v1/models", self.models_list)
        app.router.add_post("/v1/{tail:.+}", self.proxy_post)
        # vLLM's serving surface, passed through as the /v1 routes are; /ping is the router's own liveness
        app.router.add_post("/tokenize", self.proxy_post)
        app.router.add_post("/detokenize", self.proxy_post)
        app.router.add_get("/version", self.models)
        app.router.add_get("/openapi.json", self.models)   # the engines' document: the same surface
        app.router.add_get("/ping", self.health)
        app.router.add_post("/ping", self.health)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _app: web.Application) -> None:
        # No total timeout: generations stream for minutes; only connecting is bounded. Raw bytes
        # pass through (no decompression), and one connection pool serves all upstreams.
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, connect=self.cfg.connect_timeout),
            auto_decompress=False, connector=aiohttp.TCPConnector(limit=0))
        if self.prefix_cache is not None:
            self.prefix_cache.start(self.session, self.pool.upstreams)
        self._background = asyncio.create_task(self._maintain())
        if self.discovery is not None:
            loop = asyncio.get_running_loop()
            # The watch runs in a thread; membership changes are applied on the event loop.
            self.discovery.on_change = lambda urls: loop.call_soon_threadsafe(self.set_upstreams, urls)
            self.discovery.start()

    def set_upstreams(self, urls: list[str]) -> None:
        """Replace the upstream set (discovery): new replicas take queued requests at once."""
        self.pool.set_urls(urls)
        if self.prefix_cache is not None:
            self.prefix_cache.sync(self.pool.upstreams)
        self._dispatch()
        self._update_gauges()

    async def _stop(self, _app: web.Application) -> None:
        if self.discovery is not None:
            self.discovery.stop()
        if self._background:
            self._background.cancel()
            try:
                await self._background
            except asyncio.CancelledError:
                pass
        if self.prefix_cache is not None:
            await self.prefix_cache.close()
        await self.catalog.close()
        if self.session:
            await self.session.close()

    async def _maintain(self) -> None:
        """About once a second: scrape metrics, probe ejected upstreams, expire and dispatch the queue."""
        assert self.session is not None
        while True:
            try:
                timeout = max(1.0, self.cfg.scrape_interval * 2)
                self.catalog.timeout = timeout
                await asyncio.gather(scrape_once(self.pool, self.session, timeout=timeout),
                                     self.catalog.refresh_after(self.clock(), self.session))
                self.queue.expire()
                if self.prefix_cache is not None:   # a drained upstream leaves the pool between changes
                    self.prefix_cache.sync(self.pool.upstreams)
                self._dispatch()
                self._update_gauges()
            except asyncio.CancelledError:
                raise
            except Exception:   # the loop must survive anything one round throws
                logger.exception("router maintenance round failed")
            await asyncio.sleep(self.cfg.scrape_interval)

    def _update_gauges(self) -> None:
        self.metrics.queue_length.set(len(self.queue))
        self.tenancy.update_gauges()
        for up in self.pool.upstreams.values():
            self.metrics.inflight.labels(up.url).set(up.inflight)
            self.metrics.healthy.labels(up.url).set(0 if up.ejected else 1)
            if self.prefix_cache is not None:
                self.metrics.pending_prefill.labels(up.url).set(self.prefix_cache.pending_prefill[up.url])
        # Replicas discovery removed must not linger as stale series (pod IPs churn).
        for url in self._gauged - set(self.pool.upstreams):
            for metric in (self.metrics.inflight, self.metrics.healthy, self.metrics.latency, self.metrics.pending_prefill):
                try:
                    metric.remove(url)
                except KeyError:
                    pass
        self._gauged = set(self.pool.upstreams)
        self._update_leak_gauges()

    def _update_leak_gauges(self) -> None:
        """Connections and tasks, which return to their idle level once traffic stops (soak's leak check)."""
        if self.http_server is not None:
            self.metrics.client_connections.set(len(self.http_server.connections))
        connector = self.session.connector if self.session is not None else None
        if connector is not None:
            # aiohttp has no public count; its pool keeps idle connections per host and the acquired set
            idle = sum(len(v) for v in getattr(connector, "_conns", {}).values())
            self.metrics.upstream_connections.labels("idle").set(idle)
            self.metrics.upstream_connections.labels("in_use").set(len(getattr(connector, "_acquired", ())))
        try:
            self.metrics.asyncio_tasks.set(len(asyncio.all_tasks()))
        except RuntimeError:   # no running loop (unit tests calling in from outside one)
            pass

    # admission

    def _pick(self, prompt: str, exclude: set[str] = frozenset(),  # type: ignore[assignment]
              chains: PromptChains | None = None, model: str | None = None) -> Upstream | None:
        # Adapter affinity first (only upstreams serving `model`, resident ones preferred), then a retry
        # avoids the upstreams it already tried, then the strategy scores what is left.
        affinity = choose(model, [u.view() for u in self.pool.available()], self.catalog.servings())
        views = [v for v in affinity.candidates if v.url not in exclude]
        if not views and affinity.candidates:
            if self._untried_elsewhere(exclude, model):
                return None   # wait for a busy replica it has not failed on, not the one that just failed it
            views = affinity.candidates   # it has been everywhere: the same replica again beats a refusal
        if self.prefix_cache is not None:
            views = self.prefix_cache.annotate(views, chains)
        view = self.router.pick(views, prompt)
        if view is None:
            return None
        if affinity.outcome not in (Outcome.BASE, Outcome.NONE):   # every pick is acquired by the caller
            self.metrics.adapter_routing.labels(affinity.outcome.value).inc()
        if self.prefix_cache is not None:
            self.prefix_cache.routed(view.url, chains)
        return self.pool.upstreams.get(view.url)

    def _untried_elsewhere(self, exclude: set[str], model: str | None) -> bool:
        """Some replica serving ``model`` and not in ``exclude`` takes requests, though none is free now."""
        others = [u.view() for u in self.pool.routable() if u.url not in exclude]
        return bool(others) and bool(choose(model, others, self.catalog.servings()).candidates)

    def _dispatch(self) -> None:
        """Hand free upstream slots to queued requests, most urgent first."""
        self.queue.expire()
        while (ticket := self.queue.peek()) is not None:
            pending: _Pending = ticket.payload
            up = self._pick(pending.prompt, pending.exclude, pending.chains, pending.model)
            if up is None:
                ticket, up = self._first_placeable_behind()
                if ticket is None or up is None:
                    break
                pending = ticket.payload
            self.pool.acquire(up)
            pending.upstream = up
            self.queue.grant(ticket)
            if pending.admission is not None:
                self.tenancy.dispatched(pending.admission, queued=True)
        self.metrics.queue_length.set(len(self.queue))

    def _first_placeable_behind(self) -> tuple[Ticket | None, Upstream | None]:
        """The most urgent queued request some free upstream serves, when the head's model has none free
        (its only replicas are full): a request for another model must not wait behind it."""
        blocked: set[str | None] = set()   # a model's pick does not depend on the request otherwise
        for ticket in self.queue.waiting_in_order():
            pending: _Pending = ticket.payload
            if pending.model in blocked:
                continue
            up = self._pick(pending.prompt, pending.exclude, pending.chains, pending.model)
            if up is not None:
                return ticket, up
            if pending.exclude:   # a retry waits for a replica it has not tried: others may go where it failed
                continue
            if pending.model is None:   # nothing is free at all
                break
            blocked.add(pending.model)
        return None, None

    async def _acquire(self, priority: int, prompt: str, exclude: set[str], adm: Admission | None,
                       chains: PromptChains | None = None, model: str | None = None) -> Upstream:
        """A slot on an upstream: at once when one is free and nobody waits, else through the queue."""
        if len(self.queue) == 0:
            up = self._pick(prompt, exclude, chains, model)
            if up is not None:
                self.pool.acquire(up)
                if adm is not None:
                    self.tenancy.dispatched(adm, queued=False)
                return up
        pending = _Pending(prompt, chains=chains, exclude=exclude, admission=adm, model=model)
        ticket: Ticket = self.queue.enqueue(priority, with_future=True, payload=pending,
                                            tenant=adm.tenant if adm else "", cost=adm.reserved if adm else 0)
        self.metrics.queue_length.set(len(self.queue))
        self._dispatch()
        try:
            await self.queue.wait(ticket)
        except asyncio.CancelledError:
            if pending.upstream is not None:   # granted in the same instant the client left
                self._prefilled(chains)
                self._release(pending.upstream)
            raise
        finally:
            self.metrics.queue_length.set(len(self.queue))
            self.metrics.queue_time.observe(max(0.0, self.clock() - ticket.enqueued_at))
        assert pending.upstream is not None
        return pending.upstream

    def _prefilled(self, chains: PromptChains | None) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.prefilled(chains)

    def _release(self, up: Upstream) -> None:
        self.pool.release(up)
        self.metrics.inflight.labels(up.url).set(up.inflight)
        self._dispatch()

    # endpoints

    async def health(self, _request: web.Request) -> web.Response:
        ready = sum(1 for u in self.pool.upstreams.values() if not u.ejected and not u.draining)
        return web.json_response({"status": "ok", "upstreams": len(self.pool.upstreams), "upstreams_ready": ready,
                                  "queue_length": len(self.queue)})

    async def metrics_endpoint(self, _request: web.Request) -> web.Response:
        self._update_gauges()
        return web.Response(body=self.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"})

    async def models(self, request: web.Request) -> web.StreamResponse:
        """/version and /openapi.json, from any ready upstream (they all run the same server)."""
        return await self._forward(request, "GET", b"", priority=0, prompt="", adm=None)

    async def models_list(self, request: web.Request) -> web.StreamResponse:
        """The union of what the upstreams serve (base model + each one's adapters), freshly asked; passed
        through from any ready upstream while the router cannot read their lists (e.g. no --upstream-api-key)."""
        assert self.session is not None
        await self.catalog.refresh_after(self.clock(), self.session)
        cards = self.catalog.cards()
        if cards is None:
            return await self.models(request)
        return self._count(web.json_response({"object": "list", "data": cards}))

    async def _unserved_model(self, model: str) -> web.Response | None:
        """404 model_not_found for a name no upstream lists, after asking them all once more (it may have
        been loaded a moment ago); None when some upstream serves it or none has answered yet."""
        if is_served(model, self.catalog.servings()) is not Served.NO:
            return None
        assert self.session is not None
        await self.catalog.refresh_after(self.clock(), self.session)
        servings = self.catalog.servings()
        if is_served(model, servings) is not Served.NO:
            return None
        self.metrics.adapter_routing.labels("not_served").inc()
        names = ", ".join(f"`{n}`" for n in served_names(servings))
        return _error(404, f"The model `{model}` does not exist. The replicas behind this router serve {names}.",
                      code="model_not_found", param="model")

    async def proxy_post(self, request: web.Request) -> web.StreamResponse:
        payload, body = await read_json(request, self.cfg.limits)   # an APIError leaves through the guard
        priority = payload.get("priority", 0)
        if isinstance(priority, bool) or not isinstance(priority, int):
            return self._count(_error(400, "priority must be an integer (lower values are served first)",
                                      code="invalid_priority"))
        decision = self.limiter.check(self.limiter.client_key(request.headers))
        if not decision.allowed:
            self.metrics.rate_limited.labels(decision.scope).inc()
            return self._count(_error(429, f"rate limit exceeded ({decision.scope}); retry after "
                                           f"{decision.retry_after}s", code="rate_limit_exceeded",
                                      retry_after=decision.retry_after))
        model = payload.get("model") if request.path in _MODEL_PATHS and isinstance(payload.get("model"), str) else None
        if model is not None and (missing := await self._unserved_model(model)) is not None:
            return self._count(missing)
        adm = self.tenancy.admit(request.headers, payload, generates=request.path.endswith("/completions"))
        if isinstance(adm, TokenDecision):
            return self._count(self._tenant_refusal(adm))
        try:
            chains = await self.prefix_cache.chains(request.path, payload) if self.prefix_cache is not None else None
            return await self._forward(request, "POST", body, priority=priority, prompt=_prompt_key(payload), adm=adm,
                                       chains=chains, model=model)
        finally:
            self.tenancy.finish(adm)

    def _tenant_refusal(self, refused: TokenDecision) -> web.Response:
        self.metrics.rate_limited.labels("tenant").inc()
        # OpenAI's shape: type names the exhausted limit ("requests" or "tokens"), code rate_limit_exceeded.
        return _error(429, refused.message, code="rate_limit_exceeded", err_type=refused.scope,
                      param=refused.param, retry_after=refused.retry_after, headers=refused.headers)

    def _count(self, resp: web.StreamResponse) -> web.StreamResponse:
        self.metrics.requests.labels(str(resp.status)).inc()
        return resp

    async def _forward(self, request: web.Request, method: str, body: bytes, *, priority: int,
                       prompt: str, adm: Admission | None,
                       chains: PromptChains | None = None, model: str | None = None) -> web.StreamResponse:
        assert self.session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        tried: set[str] = set()
        unserved: str | None = None   # the last attempt's refusal, when an engine refused it unstarted
        for attempt in range(self.cfg.max_attempts):
            try:
                up = await self._acquire(priority, prompt, tried, adm, chains, model)
            except QueueFull as exc:
                return self._count(_error(503, "router queue is full", code="queue_full",
                                          retry_after=exc.retry_after))
            except QueueTimeout as exc:
                return self._count(_error(503, f"no upstream could take the request: {exc}", code="queue_timeout",
                                          retry_after=exc.retry_after))
            tried.add(up.url)
            started = self.clock()
            try:
                upstream_resp = await self._send_upstream(up, method, up.url + request.path_qs, body, headers)
            except _CONNECT_ERRORS as exc:
                # Nothing reached the client yet: count the failure and try another replica.
                logger.warning("upstream %s failed before responding (%s); retrying elsewhere", up.url, exc)
                if self.pool.record_failure(up):
                    self.metrics.healthy.labels(up.url).set(0)
                self._prefilled(chains)
                self._release(up)
                unserved = None
                if attempt + 1 < self.cfg.max_attempts:
                    self.metrics.retries.inc()
                continue
            if (reason := _unserved_reason(upstream_resp)) is not None:
                # The engine refused before starting (draining after SIGTERM, dead): another replica
                # takes it; relaying this 503 would lose a request during every scale-down or rollout.
                upstream_resp.release()
                self.pool.record_unserved(up, reason)
                self._prefilled(chains)
                self._release(up)
                unserved = reason
                if attempt + 1 < self.cfg.max_attempts:
                    self.metrics.retries.inc()
                continue
            try:
                relayed = await self._relay(request, upstream_resp, up, adm, chains)
            except BaseException:
                upstream_resp.close()   # client gone or relay broken: drop the upstream connection (aborts it)
                raise
            else:
                upstream_resp.release()
                return self._count(relayed)
            finally:
                self.metrics.latency.labels(up.url).observe(max(0.0, self.clock() - started))
                self._prefilled(chains)
                self._release(up)
        if unserved is not None:
            return self._count(_error(503, f"no replica could take the request after {self.cfg.max_attempts} "
                                           f"attempts (last: {unserved})", code="upstreams_unavailable",
                                      retry_after=1))
        return self._count(_error(502, f"no upstream answered after {self.cfg.max_attempts} attempts",
                                  code="upstream_unreachable"))

    async def _send_upstream(self, up: Upstream, method: str, url: str, body: bytes,
                             headers: dict[str, str]) -> aiohttp.ClientResponse:
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
                return await self.session.request(method, url, data=body or None, headers=headers)
        except TimeoutError:
            if deadline.expired():   # closes its connection: the engine sees the disconnect and aborts it
                raise UpstreamEjected(f"{up.url} was taken out of rotation before it answered") from None
            raise
        finally:
            up.on_eject.discard(on_eject)

    async def _relay(self, request: web.Request, upstream_resp: aiohttp.ClientResponse,
                     up: Upstream, adm: Admission | None, chains: PromptChains | None = None) -> web.StreamResponse:
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
            if k.lower() not in _HOP:
                resp.headers.add(k, v)
        is_sse = upstream_resp.content_type == "text/event-stream"
        meter = UsageMeter(streamed=is_sse)
        if adm is not None:
            for k, v in adm.headers.items():
                resp.headers[k] = v
            adm.meter, adm.relayed, adm.status = meter, True, upstream_resp.status
        await resp.prepare(request)
        # A stream whose engine stalls (hung, SIGSTOPped) is ended after --stream-idle-timeout, not held open.
        idle = self.cfg.limits.stream_idle_timeout if is_sse else None
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
                    self._prefilled(chains)
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


# CLI

def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--upstream", action="append", default=[], metavar="URL",
                     help="engine base URL (http://host:port); repeat for several replicas")
    src.add_argument("--discover", metavar="SELECTOR",
                     help="discover engine pods by Kubernetes label selector (Ready pods, watched)")
    parser.add_argument("--namespace", default=None,
                        help="namespace for --discover (default: the pod's own namespace)")
    parser.add_argument("--discover-port", type=positive_int, default=8000,
                        help="engine port when a discovered pod declares no container port named http")
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument("--strategy", choices=STRATEGIES, default="kv-aware", help="how an upstream is chosen")
    parser.add_argument("--tokenizer", default=None, metavar="MODEL",
                        help="model directory or name whose tokenizer --strategy prefix-cache hashes prompts with "
                             "(the engines' --model); without it the engines' /tokenize is asked")
    parser.add_argument("--upstream-api-key", default=os.environ.get("PAGEDMODEL_UPSTREAM_API_KEY"), metavar="KEY",
                        help="API key the router sends to engines for its own calls (their /v1/kv_events); "
                             "default $PAGEDMODEL_UPSTREAM_API_KEY")
    parser.add_argument("--rate-limit", type=_positive_float, default=None, metavar="RPS",
                        help="global requests per second (token bucket); off when not given")
    parser.add_argument("--burst", type=positive_int, default=None,
                        help="global bucket size (default: ceil(--rate-limit))")
    parser.add_argument("--client-rate-limit", type=_positive_float, default=None, metavar="RPS",
                        help="per-client requests per second, keyed by API key or --client-header")
    parser.add_argument("--client-burst", type=positive_int, default=None)
    parser.add_argument("--client-header", default=None,
                        help="header naming the client for per-client limits (default: the bearer API key)")
    parser.add_argument("--tenant-header", default=None,
                        help="header naming the tenant for token limits and fair queueing (default: the API key)")
    parser.add_argument("--tenant-requests-per-minute", type=_positive_float, default=None, metavar="RPM",
                        help="requests per minute each tenant may send; off when not given")
    parser.add_argument("--tenant-tokens-per-minute", type=_positive_float, default=None, metavar="TPM",
                        help="tokens per minute each tenant may use (prompt estimate + max_tokens reserved, "
                             "settled by usage); off when not given")
    parser.add_argument("--tenant-limit", action="append", default=[], type=_tenant_limit,
                        metavar="NAME:requests=RPM,tokens=TPM", help="one tenant's own limits; repeatable")
    parser.add_argument("--default-max-tokens", type=positive_int, default=256,
                        help="completion tokens reserved for a request that sets no max_tokens")
    parser.add_argument("--max-queue-len", type=non_negative_int, default=256,
                        help="requests that may wait for an upstream slot before 503")
    parser.add_argument("--queue-timeout", type=_positive_float, default=30.0, metavar="S",
                        help="seconds a request may wait in the queue before 503")
    parser.add_argument("--max-inflight-per-upstream", type=positive_int, default=None,
                        help="cap on requests open to one engine (set to its --max-num-seqs); unlimited if unset")
    parser.add_argument("--scrape-interval", type=_positive_float, default=1.0, metavar="S",
                        help="seconds between scrapes of each upstream's /metrics")
    parser.add_argument("--eject-backoff", type=_positive_float, default=1.0, metavar="S",
                        help="first ejection of a failing engine lasts this long before a /health probe; doubles "
                             "on each failed probe")
    parser.add_argument("--eject-max-backoff", type=_positive_float, default=30.0, metavar="S",
                        help="cap on that backoff: an engine back on its address is re-admitted within about this long")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--api-key", default=os.environ.get("PAGEDMODEL_API_KEY"), metavar="KEY",
                        help="require 'Authorization: Bearer KEY' of clients on every path but --auth-exempt "
                             "(default $PAGEDMODEL_API_KEY); forwarded to the engines as sent")
    add_auth_arguments(parser)
    add_limit_arguments(parser, engine=False)


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def _tenant_limit(text: str) -> tuple[str, Limits]:
    try:
        return parse_tenant_limit(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    if args.burst is not None and args.rate_limit is None:
        raise ValueError("--burst needs --rate-limit")
    return RouterConfig(upstreams=list(args.upstream), strategy=args.strategy, rate_limit=args.rate_limit,
                        burst=args.burst, client_rate_limit=args.client_rate_limit, client_burst=args.client_burst,
                        client_header=args.client_header, max_queue_len=args.max_queue_len,
                        queue_timeout=args.queue_timeout, max_inflight_per_upstream=args.max_inflight_per_upstream,
                        scrape_interval=args.scrape_interval,
                        eject_backoff=args.eject_backoff, eject_max_backoff=args.eject_max_backoff,
                        tenant_header=args.tenant_header,
                        tenant_requests_per_minute=args.tenant_requests_per_minute,
                        tenant_tokens_per_minute=args.tenant_tokens_per_minute,
                        tenant_overrides=dict(args.tenant_limit), default_max_tokens=args.default_max_tokens,
                        tokenizer=args.tokenizer, upstream_api_key=args.upstream_api_key,
                        api_key=args.api_key or None, auth_exempt=args.auth_exempt, limits=limits_from_args(args))


async def serve(app: RouterApp, host: str, port: int, ready: Callable[[int], Awaitable[None] | None] | None = None,
                stop: asyncio.Event | None = None) -> None:
    """Run until `stop` is set (or forever). `ready(port)` is called once listening (tests use port 0)."""
    limits = app.cfg.limits
    # aiohttp bounds each head line (a longer one is a JSON 431 through the runner), http_guard.py the whole head.
    runner = JSONErrorsAppRunner(app.build(), max_header_bytes=limits.max_header_bytes,
                                 request_read_timeout=limits.request_read_timeout, handler_cancellation=True,
                                 access_log=None, shutdown_timeout=DRAIN_S, keepalive_timeout=limits.keep_alive_timeout,
                                 max_line_size=limits.max_header_bytes, max_field_size=limits.max_header_bytes)
    await runner.setup()
    app.http_server = runner.server
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = int(runner.addresses[0][1]) if runner.addresses else port
    logger.info("router listening on %s:%d -> %d upstream(s), strategy %s", host, bound,
                len(app.pool.upstreams), app.cfg.strategy)
    if ready is not None:
        result = ready(bound)
        if asyncio.iscoroutine(result):
            await result
    try:
        await (stop.wait() if stop is not None else asyncio.Event().wait())
    finally:
        await runner.cleanup()


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), format="%(asctime)s %(levelname)s %(name)s: "
                        "%(message)s")
    if not args.upstream and not args.discover:
        print("pagedmodel router: give at least one --upstream URL, or --discover SELECTOR", flush=True)
        return 2
    try:
        discovery = None
        if args.discover:
            discovery = PodDiscovery(args.discover, args.namespace or current_namespace(), lambda urls: None,
                                     default_port=args.discover_port)
            discovery.connect()
        app = RouterApp(config_from_args(args), discovery=discovery)
    except Exception as exc:   # bad flags, or no Kubernetes credentials for --discover
        print(f"pagedmodel router: {exc}", flush=True)
        return 2
    async def main() -> None:
        # SIGTERM (Kubernetes) and SIGINT stop accepting, then let in-flight requests finish (aiohttp's
        # shutdown waits for running handlers) before the process exits 0.
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(app, args.host, args.port, stop=stop)

    asyncio.run(main())
    return 0
