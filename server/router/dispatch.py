"""Which upstream takes a request, and when: at once when one is free and nobody waits, else through
the queue, whose head is handed each slot that frees up (most urgent first, fair between tenants).

The choice itself is pure (adapter_affinity.py, then strategies.py over the upstreams' snapshots);
this module holds the slots: it acquires one per request and releases it when the relay is done.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable

from .adapter_affinity import Outcome, choose
from .metrics import RouterMetrics
from .model_catalog import ModelCatalog
from .prefix_cache import PrefixCacheRouting
from .prefix_index import PromptChains
from .queue import AdmissionQueue, Ticket
from .request import RoutedRequest
from .strategies import Router
from .tenancy import Tenancy
from .upstreams import Upstream, UpstreamPool


class Dispatcher:
    """Hands upstream slots to requests; the router's queue, pool and strategy meet here."""

    def __init__(self, pool: UpstreamPool, queue: AdmissionQueue, router: Router, catalog: ModelCatalog,
                 tenancy: Tenancy, metrics: RouterMetrics, prefix_cache: PrefixCacheRouting | None,
                 clock: Callable[[], float]) -> None:
        self.pool = pool
        self.queue = queue
        self.router = router
        self.catalog = catalog
        self.tenancy = tenancy
        self.metrics = metrics
        self.prefix_cache = prefix_cache
        self.clock = clock

    def pick(self, request: RoutedRequest) -> Upstream | None:
        # Adapter affinity first (only upstreams serving `model`, resident ones preferred), then a retry
        # avoids the upstreams it already tried, then the strategy scores what is left.
        affinity = choose(request.model, [u.view() for u in self.pool.available()], self.catalog.servings())
        views = [v for v in affinity.candidates if v.url not in request.tried]
        if not views and affinity.candidates:
            if self._untried_elsewhere(request.tried, request.model):
                return None   # wait for a busy replica it has not failed on, not the one that just failed it
            views = affinity.candidates   # it has been everywhere: the same replica again beats a refusal
        if self.prefix_cache is not None:
            views = self.prefix_cache.annotate(views, request.chains)
        view = self.router.pick(views, request.prompt_key)
        if view is None:
            return None
        if affinity.outcome not in (Outcome.BASE, Outcome.NONE):   # every pick is acquired by the caller
            self.metrics.adapter_routing.labels(affinity.outcome.value).inc()
        if self.prefix_cache is not None:
            self.prefix_cache.routed(view.url, request.chains)
        return self.pool.upstreams.get(view.url)

    def _untried_elsewhere(self, exclude: set[str], model: str | None) -> bool:
        """Some replica serving ``model`` and not in ``exclude`` takes requests, though none is free now."""
        others = [u.view() for u in self.pool.routable() if u.url not in exclude]
        return bool(others) and bool(choose(model, others, self.catalog.servings()).candidates)

    def dispatch(self) -> None:
        """Hand free upstream slots to queued requests, most urgent first."""
        self.queue.expire()
        while (ticket := self.queue.peek()) is not None:
            request: RoutedRequest = ticket.payload
            up = self.pick(request)
            if up is None:
                ticket, up = self._first_placeable_behind()
                if ticket is None or up is None:
                    break
                request = ticket.payload
            self.pool.acquire(up)
            request.upstream = up
            self.queue.grant(ticket)
            if request.admission is not None:
                self.tenancy.dispatched(request.admission, queued=True)
        self.metrics.queue_length.set(len(self.queue))

    def _first_placeable_behind(self) -> tuple[Ticket | None, Upstream | None]:
        """The most urgent queued request some free upstream serves, when the head's model has none free
        (its only replicas are full): a request for another model must not wait behind it."""
        blocked: set[str | None] = set()   # a model's pick does not depend on the request otherwise
        for ticket in self.queue.waiting_in_order():
            request: RoutedRequest = ticket.payload
            if request.model in blocked:
                continue
            up = self.pick(request)
            if up is not None:
                return ticket, up
            if request.tried:   # a retry waits for a replica it has not tried: others may go where it failed
                continue
            if request.model is None:   # nothing is free at all
                break
            blocked.add(request.model)
        return None, None

    async def acquire(self, request: RoutedRequest) -> Upstream:
        """A slot on an upstream: at once when one is free and nobody waits, else through the queue."""
        adm = request.admission
        if len(self.queue) == 0:
            up = self.pick(request)
            if up is not None:
                self.pool.acquire(up)
                if adm is not None:
                    self.tenancy.dispatched(adm, queued=False)
                return up
        request.upstream = None   # a retry waits afresh: only a grant from now on counts
        ticket: Ticket = self.queue.enqueue(request.priority, with_future=True, payload=request,
                                            tenant=adm.tenant if adm else "", cost=adm.reserved if adm else 0)
        self.metrics.queue_length.set(len(self.queue))
        self.dispatch()
        try:
            await self.queue.wait(ticket)
        except asyncio.CancelledError:
            if request.upstream is not None:   # granted in the same instant the client left
                self.prefilled(request.chains)
                self.release(request.upstream)
            raise
        finally:
            self.metrics.queue_length.set(len(self.queue))
            self.metrics.queue_time.observe(max(0.0, self.clock() - ticket.enqueued_at))
        assert request.upstream is not None
        return request.upstream

    def prefilled(self, chains: PromptChains | None) -> None:
        """The request's prompt has been computed (or never will be): it stops counting as pending prefill."""
        if self.prefix_cache is not None:
            self.prefix_cache.prefilled(chains)

    def release(self, up: Upstream) -> None:
        self.pool.release(up)
        self.metrics.inflight.labels(up.url).set(up.inflight)
        self.dispatch()
