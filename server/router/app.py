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
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from pagedmodel.server.http_common.api_key import DEFAULT_AUTH_EXEMPT, add_auth_arguments
from pagedmodel.server.http_common.http_limits import (HTTPLimits, add_limit_arguments, limits_from_args,
                                                       non_negative_int, positive_int)
from .admission import RateLimiter
from .discovery import PodDiscovery, current_namespace
from .dispatch import Dispatcher
from .handlers import RouterHandlers
from .http_guard import JSONErrorsAppRunner, guard_middleware
from .metrics import RouterMetrics
from .model_catalog import ModelCatalog
from .prefix_cache import PrefixCacheRouting
from .prompt_tokens import load_tokenizer
from .queue import AdmissionQueue
from .relay import Relay
from .strategies import STRATEGIES, Router
from .tenancy import Tenancy
from .token_limits import Limits, TenantLimiter, parse_tenant_limit
from .upstreams import UpstreamPool, scrape_once

logger = logging.getLogger("pagedmodel.router")

# On SIGTERM the router stops accepting and gives running requests (streams relayed from engines) this
# long; the operator's router pods get a grace period above it (operator/desired_state.py).
DRAIN_S = 60.0


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


class RouterApp:
    """Owns the router's parts and their lifecycle (start, maintenance, stop); builds the aiohttp application.

    The request path runs through `handlers.py` (checks, then one `RoutedRequest`), `dispatch.py` (a slot
    on an upstream, at once or through the queue) and `relay.py` (forwarding, retries, the streamed answer).
    """

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
        self.dispatcher = Dispatcher(self.pool, self.queue, self.router, self.catalog, self.tenancy, self.metrics,
                                     prefix_cache, clock)
        self.relay = Relay(self.pool, self.dispatcher, self.metrics, max_attempts=cfg.max_attempts,
                           stream_idle_timeout=cfg.limits.stream_idle_timeout, clock=clock)
        self.handlers = RouterHandlers(self)
        self.session: aiohttp.ClientSession | None = None
        self._background: asyncio.Task[None] | None = None
        self._gauged: set[str] = set()
        self.http_server: web.Server | None = None   # set by serve(): its open client connections are gauged

    # lifecycle

    def build(self) -> web.Application:
        cfg = self.cfg
        handlers = self.handlers
        guard = guard_middleware(cfg.limits, cfg.api_key, cfg.auth_exempt, count=handlers.count,
                                 connections=lambda: len(self.http_server.connections) if self.http_server else 0)
        app = web.Application(client_max_size=cfg.limits.max_body_bytes, middlewares=[guard])
        app.router.add_get("/health", handlers.health)
        app.router.add_get("/metrics", handlers.metrics_endpoint)
        app.router.add_get("/v1/models", handlers.models_list)
        app.router.add_post("/v1/{tail:.+}", handlers.proxy_post)
        # vLLM's serving surface, passed through as the /v1 routes are; /ping is the router's own liveness
        app.router.add_post("/tokenize", handlers.proxy_post)
        app.router.add_post("/detokenize", handlers.proxy_post)
        app.router.add_get("/version", handlers.models)
        app.router.add_get("/openapi.json", handlers.models)   # the engines' document: the same surface
        app.router.add_get("/ping", handlers.health)
        app.router.add_post("/ping", handlers.health)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _app: web.Application) -> None:
        # No total timeout: generations stream for minutes; only connecting is bounded. Raw bytes
        # pass through (no decompression), and one connection pool serves all upstreams.
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, connect=self.cfg.connect_timeout),
            auto_decompress=False, connector=aiohttp.TCPConnector(limit=0))
        self.relay.session = self.session
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
        self.dispatcher.dispatch()
        self.update_gauges()

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
                self.dispatcher.dispatch()
                self.update_gauges()
            except asyncio.CancelledError:
                raise
            except Exception:   # the loop must survive anything one round throws
                logger.exception("router maintenance round failed")
            await asyncio.sleep(self.cfg.scrape_interval)

    def update_gauges(self) -> None:
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
