"""The router's view of its engine replicas: in-flight counts, scraped metrics, health and ejection.

Health is passive and active at once: a connection failure or 5xx from proxying counts as a
failure, and so does a scrape of `/metrics` that cannot connect or times out (a dead or hung engine
is ejected within a few scrape intervals even when no request is there to notice);
`consecutive_failures_to_eject` in a row eject the upstream for a backoff that doubles
on every ejection (capped), and an ejected upstream is re-admitted only after a successful probe
of its `/health` once the backoff has passed. A successful scrape or request resets the failure
count. All timing uses an injectable clock; network I/O lives in `scrape_once` / `probe_once`.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import aiohttp

from pagedmodel import metrics_contract as mc
from .adapter_affinity import ModelServing, parse_lora_info, parse_models
from .admission import Clock
from .strategies import UpstreamView

logger = logging.getLogger("pagedmodel.router")

# engine metric -> Upstream attribute. The engine's --max-num-seqs, when it exports it, becomes the
# in-flight cap unless --max-inflight-per-upstream pins one (the engine would only queue what lies beyond).
SCRAPED = {mc.KV_CACHE_USAGE.name: "kv_usage", mc.NUM_REQUESTS_WAITING.name: "waiting",
           mc.NUM_REQUESTS_RUNNING.name: "running", mc.MAX_NUM_SEQS.name: "max_num_seqs"}


def normalise_url(url: str) -> str:
    """`host:port` or `http://host:port[/v1]` -> `http://host:port` (the router appends API paths)."""
    if "://" not in url:
        url = "http://" + url
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"bad upstream URL {url!r}: expected http(s)://host:port")
    path = parts.path.rstrip("/")
    if path in ("", "/v1"):
        path = ""
    else:
        raise ValueError(f"bad upstream URL {url!r}: give the server root (optionally ending in /v1)")
    return f"{parts.scheme}://{parts.netloc}{path}"


@dataclass
class Upstream:
    url: str
    max_inflight: int | None = None
    inflight: int = 0
    kv_usage: float | None = None
    waiting: float | None = None
    running: float | None = None
    scraped_at: float | None = None
    consecutive_failures: int = 0
    ejections: int = 0
    ejected_until: float | None = None   # None: in rotation
    draining: bool = False               # removed by discovery: no new requests, in-flight ones finish
    # what it serves (model_catalog.py: its /v1/models cards, None until fetched) and its LoRA slots' use
    # (scraped vllm:lora_requests_info); adapter_affinity.py decides with them
    model_cards: list[dict] | None = field(default=None, repr=False)
    served_models: frozenset[str] | None = None
    base_model: str | None = None
    lora_running: frozenset[str] = frozenset()
    lora_waiting: frozenset[str] = frozenset()
    max_lora: int | None = None
    # called on ejection: requests still waiting for this upstream's answer give up on it (app.py)
    on_eject: set[Callable[[], None]] = field(default_factory=set, repr=False, compare=False)

    @property
    def ejected(self) -> bool:
        return self.ejected_until is not None

    def has_capacity(self) -> bool:
        return self.max_inflight is None or self.inflight < self.max_inflight

    def view(self) -> UpstreamView:
        return UpstreamView(self.url, self.inflight, self.max_inflight, self.kv_usage, self.waiting, self.running)

    def set_models(self, cards: list[dict] | None) -> None:
        """Its /v1/models cards (validated by the caller), or None: what it serves is unknown."""
        self.model_cards = cards
        self.served_models, self.base_model = parse_models({"data": cards}) if cards is not None else (None, None)

    def serving(self) -> ModelServing:
        return ModelServing(self.served_models, self.base_model, self.lora_running, self.lora_waiting, self.max_lora)


class UpstreamPool:
    def __init__(self, urls: Iterable[str], *, max_inflight: int | None = None,
                 consecutive_failures_to_eject: int = 3, base_backoff: float = 1.0, max_backoff: float = 30.0,
                 stale_after: float = 5.0, clock: Clock = time.monotonic) -> None:
        if max_inflight is not None and max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
        if consecutive_failures_to_eject < 1:
            raise ValueError("consecutive_failures_to_eject must be >= 1")
        self.max_inflight = max_inflight
        self.failures_to_eject = consecutive_failures_to_eject
        self.base_backoff = base_backoff
        self.max_backoff = max_backoff
        self.stale_after = stale_after
        self._clock = clock
        self.upstreams: dict[str, Upstream] = {}
        self.set_urls(urls)

    # membership (static list or discovery)

    def set_urls(self, urls: Iterable[str]) -> None:
        wanted = {normalise_url(u) for u in urls}
        for url in wanted:
            up = self.upstreams.get(url)
            if up is None:
                self.upstreams[url] = Upstream(url, max_inflight=self.max_inflight)
            else:
                up.draining = False
        for url, up in list(self.upstreams.items()):
            if url not in wanted:
                if up.inflight:
                    up.draining = True   # finish what it has, then forget it
                else:
                    del self.upstreams[url]

    # routing view

    def available(self) -> list[Upstream]:
        """Upstreams a new request may go to now."""
        return [u for u in self.upstreams.values() if not u.ejected and not u.draining and u.has_capacity()]

    def routable(self) -> list[Upstream]:
        """Upstreams that take requests, free or not (not ejected, not draining)."""
        return [u for u in self.upstreams.values() if not u.ejected and not u.draining]

    def any_ready(self) -> bool:
        return any(not u.ejected and not u.draining for u in self.upstreams.values())

    def acquire(self, up: Upstream) -> None:
        up.inflight += 1

    def release(self, up: Upstream) -> None:
        up.inflight = max(0, up.inflight - 1)
        if up.draining and up.inflight == 0:
            self.upstreams.pop(up.url, None)

    # health

    def record_success(self, up: Upstream) -> None:
        up.consecutive_failures = 0

    def record_failure(self, up: Upstream) -> bool:
        """Count a failure; True when it ejected the upstream."""
        up.consecutive_failures += 1
        if not up.ejected and up.consecutive_failures >= self.failures_to_eject:
            self._eject(up)
            return True
        return False

    def record_unserved(self, up: Upstream, reason: str) -> None:
        """The upstream said it cannot take requests (draining, dead): out of rotation now, not after
        N failures; the /health probe re-admits it if it comes back (a restart on the same address)."""
        if not up.ejected:
            up.consecutive_failures = max(up.consecutive_failures, self.failures_to_eject)
            self._eject(up)
            logger.info("upstream %s refused a request unstarted (%s): out of rotation", up.url, reason)

    def _eject(self, up: Upstream) -> None:
        backoff = min(self.max_backoff, self.base_backoff * (2 ** up.ejections))
        up.ejections += 1
        up.ejected_until = self._clock() + backoff
        logger.warning("upstream %s ejected for %.1fs after %d consecutive failures",
                       up.url, backoff, up.consecutive_failures)
        for callback in list(up.on_eject):
            callback()

    def due_for_probe(self) -> list[Upstream]:
        now = self._clock()
        return [u for u in self.upstreams.values() if u.ejected and u.ejected_until <= now]  # type: ignore[operator]

    def probe_result(self, up: Upstream, ok: bool) -> None:
        """An ejected upstream's probe: re-admit on success, back off longer on failure."""
        if not up.ejected:
            return
        if ok:
            up.ejected_until = None
            up.consecutive_failures = 0
            up.ejections = 0 if up.ejections <= 1 else up.ejections - 1   # forgive gradually
            logger.info("upstream %s re-admitted", up.url)
        else:
            self._eject(up)

    # scraping

    def apply_scrape(self, up: Upstream, metrics_text: str) -> None:
        # summed over model_name label sets (one engine serves one model)
        values = {SCRAPED[name]: v for name, v in mc.sums(metrics_text, SCRAPED).items()}
        if self.max_inflight is None and values.get("max_num_seqs", 0) >= 1:
            up.max_inflight = int(values["max_num_seqs"])
        up.kv_usage = values.get("kv_usage")
        up.waiting = values.get("waiting")
        up.running = values.get("running")
        up.lora_running, up.lora_waiting, up.max_lora = parse_lora_info(metrics_text)
        up.scraped_at = self._clock()

    def expire_stale(self) -> None:
        """Metrics older than `stale_after` are dropped: routing falls back to in-flight counts only."""
        now = self._clock()
        for up in self.upstreams.values():
            if up.scraped_at is not None and now - up.scraped_at > self.stale_after:
                up.kv_usage = up.waiting = up.running = None
                up.lora_running = up.lora_waiting = frozenset()
                up.scraped_at = None


async def scrape_once(pool: UpstreamPool, session: aiohttp.ClientSession, timeout: float = 2.0) -> None:
    """Scrape /metrics of every upstream in rotation; probe /health of ejected ones whose backoff ended."""
    async def scrape(up: Upstream) -> None:
        try:
            async with session.get(up.url + "/metrics", timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                if resp.status == 200:
                    pool.apply_scrape(up, await resp.text())
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
            # Nothing listening (killed) or no answer within the timeout (hung, SIGSTOPped): counts towards
            # ejection, as a failed request would. A live engine answers /metrics from its event loop even
            # while the engine thread is busy stepping.
            logger.debug("scrape of %s failed: %s", up.url, exc)
            pool.record_failure(up)
        except (aiohttp.ClientError, ValueError) as exc:
            # A malformed answer is not a health signal: its metrics go stale instead.
            logger.debug("scrape of %s failed: %s", up.url, exc)

    async def probe(up: Upstream) -> None:
        ok = False
        try:
            async with session.get(up.url + "/health", timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                ok = resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            ok = False
        pool.probe_result(up, ok)

    ups = list(pool.upstreams.values())
    await asyncio.gather(*(scrape(u) for u in ups if not u.ejected), *(probe(u) for u in pool.due_for_probe()))
    pool.expire_stale()
