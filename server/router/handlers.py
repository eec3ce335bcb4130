"""The router's HTTP endpoints: its own /health and /metrics, the model list, and every proxied POST.

A POST is checked in order (body and priority 400, rate limits 429, a model no replica serves 404,
the tenant's limits 429), then built once into a `RoutedRequest` that dispatch and relay carry on.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from .adapter_affinity import Served, is_served, served_names
from .http_guard import read_json, refusal
from .relay import forwarded_headers
from .request import RoutedRequest, prompt_key
from .token_limits import TokenDecision

if TYPE_CHECKING:
    from .app import RouterApp

# The engine answers these for the model (base or LoRA adapter) the body's `model` names, 404 for others.
_MODEL_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"})


class RouterHandlers:
    """aiohttp handlers over the router's parts (`RouterApp` owns them and their lifecycle)."""

    def __init__(self, app: RouterApp) -> None:
        self.app = app

    def count(self, resp: web.StreamResponse) -> web.StreamResponse:
        self.app.metrics.requests.labels(str(resp.status)).inc()
        return resp

    async def health(self, _request: web.Request) -> web.Response:
        app = self.app
        ready = sum(1 for u in app.pool.upstreams.values() if not u.ejected and not u.draining)
        return web.json_response({"status": "ok", "upstreams": len(app.pool.upstreams), "upstreams_ready": ready,
                                  "queue_length": len(app.queue)})

    async def metrics_endpoint(self, _request: web.Request) -> web.Response:
        self.app.update_gauges()
        return web.Response(body=self.app.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"})

    async def models(self, request: web.Request) -> web.StreamResponse:
        """/version and /openapi.json, from any ready upstream (they all run the same server)."""
        routed = RoutedRequest("GET", request.path_qs, b"", forwarded_headers(request))
        return self.count(await self.app.relay.forward(request, routed))

    async def models_list(self, request: web.Request) -> web.StreamResponse:
        """The union of what the upstreams serve (base model + each one's adapters), freshly asked; passed
        through from any ready upstream while the router cannot read their lists (e.g. no --upstream-api-key)."""
        app = self.app
        assert app.session is not None
        await app.catalog.refresh_after(app.clock(), app.session)
        cards = app.catalog.cards()
        if cards is None:
            return await self.models(request)
        return self.count(web.json_response({"object": "list", "data": cards}))

    async def _unserved_model(self, model: str) -> web.Response | None:
        """404 model_not_found for a name no upstream lists, after asking them all once more (it may have
        been loaded a moment ago); None when some upstream serves it or none has answered yet."""
        app = self.app
        if is_served(model, app.catalog.servings()) is not Served.NO:
            return None
        assert app.session is not None
        await app.catalog.refresh_after(app.clock(), app.session)
        servings = app.catalog.servings()
        if is_served(model, servings) is not Served.NO:
            return None
        app.metrics.adapter_routing.labels("not_served").inc()
        names = ", ".join(f"`{n}`" for n in served_names(servings))
        return refusal(404, f"The model `{model}` does not exist. The replicas behind this router serve {names}.",
                       code="model_not_found", param="model")

    async def proxy_post(self, request: web.Request) -> web.StreamResponse:
        app = self.app
        payload, body = await read_json(request, app.cfg.limits)   # an APIError leaves through the guard
        priority = payload.get("priority", 0)
        if isinstance(priority, bool) or not isinstance(priority, int):
            return self.count(refusal(400, "priority must be an integer (lower values are served first)",
                                      code="invalid_priority"))
        decision = app.limiter.check(app.limiter.client_key(request.headers))
        if not decision.allowed:
            app.metrics.rate_limited.labels(decision.scope).inc()
            return self.count(refusal(429, f"rate limit exceeded ({decision.scope}); retry after "
                                           f"{decision.retry_after}s", code="rate_limit_exceeded",
                                      retry_after=decision.retry_after))
        model = payload.get("model") if request.path in _MODEL_PATHS and isinstance(payload.get("model"), str) else None
        if model is not None and (missing := await self._unserved_model(model)) is not None:
            return self.count(missing)
        adm = app.tenancy.admit(request.headers, payload, generates=request.path.endswith("/completions"))
        if isinstance(adm, TokenDecision):
            return self.count(self._tenant_refusal(adm))
        try:
            chains = await app.prefix_cache.chains(request.path, payload) if app.prefix_cache is not None else None
            routed = RoutedRequest("POST", request.path_qs, body, forwarded_headers(request), priority=priority,
                                   prompt_key=prompt_key(payload), chains=chains, admission=adm, model=model)
            return self.count(await app.relay.forward(request, routed))
        finally:
            app.tenancy.finish(adm)

    def _tenant_refusal(self, refused: TokenDecision) -> web.Response:
        self.app.metrics.rate_limited.labels("tenant").inc()
        # OpenAI's shape: type names the exhausted limit ("requests" or "tokens"), code rate_limit_exceeded.
        return refusal(429, refused.message, code="rate_limit_exceeded", err_type=refused.scope,
                       param=refused.param, retry_after=refused.retry_after, headers=refused.headers)
