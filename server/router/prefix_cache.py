"""The `prefix-cache` strategy's moving parts, owned by the router app: the index of what each engine
caches (prefix_index.py), one KV-event subscription per upstream (kv_subscriber.py) and the local
tokenizer (prompt_tokens.py), or, without one, the engines' own /tokenize. The strategy itself stays a pure function (strategies.py): this only
annotates each candidate's view with how many of the prompt's tokens it holds, how many uncached prompt
tokens its requests still have to prefill (from the pick until the first generated token comes back),
and how many of the latest picks went to it.
"""
from __future__ import annotations

import dataclasses
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import aiohttp

from .kv_subscriber import KVSubscriptions
from .prefix_index import DEFAULT_MAX_BLOCKS, PrefixIndex, PromptChains
from .prompt_tokens import PromptTokenizer, RemoteTokenizer
from .strategies import UpstreamView

RECENT_PICKS = 32   # the window of picks `recent_picks` counts over: a few minutes of a tenant mix's traffic


class PrefixCacheRouting:
    def __init__(self, tokenizer: Any | None, *, api_key: str | None = None,
                 max_blocks_per_upstream: int = DEFAULT_MAX_BLOCKS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.index = PrefixIndex(max_blocks_per_upstream)
        self.clock = clock
        self.tokenizer = PromptTokenizer(tokenizer) if tokenizer is not None else None
        self.remote: RemoteTokenizer | None = None
        self.api_key = api_key
        self.subscriptions: KVSubscriptions | None = None
        self._turn = 0
        self.pending_prefill: Counter[str] = Counter()                 # per upstream URL
        self._prefilling: dict[int, tuple[str, int]] = {}              # id(chains) -> (url, uncached tokens)
        self._recent: deque[str] = deque(maxlen=RECENT_PICKS)                # the latest picks' URLs

    def start(self, session: aiohttp.ClientSession, urls: Iterable[str]) -> None:
        self.subscriptions = KVSubscriptions(self.index, session, api_key=self.api_key)
        self.subscriptions.sync(urls)
        if self.tokenizer is None:
            self.remote = RemoteTokenizer(session, self.api_key)

    def sync(self, urls: Iterable[str]) -> None:
        """Follow exactly the current upstreams (discovery added or removed some)."""
        if self.subscriptions is not None:
            self.subscriptions.sync(urls)

    async def close(self) -> None:
        if self.subscriptions is not None:
            await self.subscriptions.close()
        if self.tokenizer is not None:
            self.tokenizer.close()

    async def chains(self, path: str, body: dict[str, Any]) -> PromptChains | None:
        if self.tokenizer is not None:
            return await self.tokenizer.chains(path, body)
        # Rotate over the engines whose stream is live (they all serve the same model): one slow
        # engine does not tax every request.
        live = sorted(url for url, up in self.index.upstreams.items() if up.usable)
        if self.remote is None or not live:
            return None
        self._turn += 1
        return await self.remote.chains(live[self._turn % len(live)], path, body)

    def annotate(self, views: Sequence[UpstreamView], chains: PromptChains | None) -> list[UpstreamView]:
        if chains is None:
            return list(views)
        n, now, recent = len(chains.token_ids), self.clock(), Counter(self._recent)
        return [dataclasses.replace(v, cached_tokens=self.index.cached_tokens(v.url, chains, now), prompt_tokens=n,
                                    pending_prefill=self.pending_prefill[v.url], recent_picks=recent[v.url])
                for v in views]

    def routed(self, url: str, chains: PromptChains | None) -> None:
        """The request went to `url`: its uncached tokens count as pending there until `prefilled`, and its
        prefix as held there while the engine computes it."""
        if chains is None:
            return
        self.prefilled(chains)   # a retry: the earlier attempt's upstream no longer computes it
        now = self.clock()
        uncached = max(0, len(chains.token_ids) - self.index.cached_tokens(url, chains, now))
        self._prefilling[id(chains)] = (url, uncached)
        self.pending_prefill[url] += uncached
        self._recent.append(url)
        self.index.expect(url, chains, now)

    def prefilled(self, chains: PromptChains | None) -> None:
        """The request's first token came back, or it ended or failed before one did (idempotent)."""
        url, uncached = self._prefilling.pop(id(chains), (None, 0)) if chains is not None else (None, 0)
        if url is not None:
            self.pending_prefill[url] -= uncached
            if self.pending_prefill[url] <= 0:
                del self.pending_prefill[url]
