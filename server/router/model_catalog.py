"""Which model names each upstream serves: its `/v1/models` (base model + LoRA adapters), fetched on the
router's scrape cycle and again, on demand, when a request names a model no upstream lists.

The on-demand refresh closes the race where an adapter was loaded into an engine (`POST
/v1/load_lora_adapter`) moments before a request for it reached the router: before answering 404 the
router asks every upstream again. Refreshes coalesce: a request only waits for a refresh that started
after it arrived, and many misses at once share one round of fetches, so a flood of unknown names
costs the engines one `/v1/models` per upstream per round trip, not one per request.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from .adapter_affinity import ModelServing, parse_models
from .upstreams import Upstream, UpstreamPool

logger = logging.getLogger("pagedmodel.router")


class ModelCatalog:
    def __init__(self, pool: UpstreamPool, *, api_key: str | None = None, timeout: float = 2.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pool = pool
        self.api_key = api_key
        self.timeout = timeout
        self.clock = clock
        self._round: asyncio.Task[None] | None = None
        self._round_started = float("-inf")
        self._fresh_since = float("-inf")   # start time of the newest completed round

    def servings(self) -> dict[str, ModelServing]:
        return {url: up.serving() for url, up in self.pool.upstreams.items()}

    def cards(self) -> list[dict[str, Any]] | None:
        """The union of the upstreams' model cards (first seen wins per id); None when no list is known."""
        known = [up for up in self.pool.upstreams.values() if up.model_cards is not None]
        if not known:
            return None
        union: dict[str, dict[str, Any]] = {}
        for up in sorted(known, key=lambda u: u.url):
            for card in up.model_cards or ():
                union.setdefault(card["id"], card)
        return [union[k] for k in sorted(union)]

    async def refresh_after(self, t: float, session: aiohttp.ClientSession) -> None:
        """Return once a round of fetches that started at or after `t` has completed."""
        while self._fresh_since < t:
            if self._round is None or self._round.done():
                self._round_started = self.clock()
                self._round = asyncio.create_task(self._fetch_all(session, self._round_started))
            started = self._round_started
            await asyncio.shield(self._round)
            if started >= t:
                return

    async def close(self) -> None:
        if self._round is not None and not self._round.done():
            self._round.cancel()
            try:
                await self._round
            except asyncio.CancelledError:
                pass

    async def _fetch_all(self, session: aiohttp.ClientSession, started: float) -> None:
        ups = [u for u in self.pool.upstreams.values() if not u.ejected and not u.draining]
        await asyncio.gather(*(self._fetch(session, u) for u in ups))
        self._fresh_since = max(self._fresh_since, started)

    async def _fetch(self, session: aiohttp.ClientSession, up: Upstream) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        try:
            async with session.get(up.url + "/v1/models", headers=headers,
                                   timeout=aiohttp.ClientTimeout(total=self.timeout)) as resp:
                if resp.status != 200:
                    # e.g. 401 (the engine wants --upstream-api-key): the router cannot know what it serves
                    logger.debug("/v1/models of %s answered %d", up.url, resp.status)
                    up.set_models(None)
                    return
                body = await resp.json(content_type=None)
            parse_models(body)   # validates before anything is kept
            up.set_models([card for card in body["data"]])
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            # Unreachable: health is the scrape's business; the last known list stays until it answers.
            logger.debug("/v1/models of %s failed: %s", up.url, exc)
        except ValueError as exc:
            logger.warning("/v1/models of %s is malformed: %s", up.url, exc)
            up.set_models(None)
