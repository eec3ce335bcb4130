"""One task per upstream following its `GET /v1/kv_events` stream into the PrefixIndex.

Started and stopped with the upstream set (`sync`, called on every discovery change). A task
reconnects after any failure: with `since`/`instance` when its state is still a valid prefix of the
engine's stream (the engine replays what it missed), without them after a gap, so the engine sends
a snapshot. A read that stays silent past `read_timeout` (the engine sends a heartbeat every two
seconds) counts as a broken connection. An engine without prefix caching answers 404; its entry
stays empty and the task asks again every `disabled_retry` seconds (it may be restarted with it on).
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterable

import aiohttp

from .prefix_index import PrefixIndex, UpstreamBlocks

logger = logging.getLogger("pagedmodel.router")

PATH = "/v1/kv_events"


class KVSubscriptions:
    def __init__(self, index: PrefixIndex, session: aiohttp.ClientSession, *, api_key: str | None = None,
                 read_timeout: float = 6.0, retry: float = 0.5, disabled_retry: float = 30.0) -> None:
        self.index = index
        self.session = session
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.read_timeout = read_timeout
        self.retry = retry
        self.disabled_retry = disabled_retry
        self.tasks: dict[str, asyncio.Task[None]] = {}

    def sync(self, urls: Iterable[str]) -> None:
        """Follow exactly `urls`: new ones get a task, gone ones lose theirs and their index entry."""
        wanted = set(urls)
        for url in wanted - set(self.tasks):
            self.tasks[url] = asyncio.create_task(self._follow(url), name=f"kv-events {url}")
        for url in set(self.tasks) - wanted:
            self.tasks.pop(url).cancel()
            self.index.remove(url)

    async def close(self) -> None:
        tasks = list(self.tasks.values())
        self.tasks.clear()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _follow(self, url: str) -> None:
        entry = self.index.get(url)
        while True:
            delay = self.retry
            try:
                delay = await self._stream(url, entry)
            except asyncio.CancelledError:
                raise
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, TypeError) as exc:
                logger.debug("kv events of %s: %s; reconnecting", url, exc)
            except Exception:   # never let one upstream's stream end its subscription for good
                logger.exception("kv events of %s failed; reconnecting", url)
            entry.disconnected()
            await asyncio.sleep(delay)

    async def _stream(self, url: str, entry: UpstreamBlocks) -> float:
        """Read one connection until it ends; returns how long to wait before the next one."""
        params = {"since": str(entry.seq), "instance": entry.instance or ""} if entry.synced else {}
        timeout = aiohttp.ClientTimeout(total=None, connect=self.read_timeout, sock_read=self.read_timeout)
        async with self.session.get(url + PATH, params=params, headers=self.headers, timeout=timeout) as resp:
            if resp.status == 404:
                entry.invalidate()
                return self.disabled_retry
            if resp.status != 200:
                logger.warning("kv events of %s: HTTP %d", url, resp.status)
                return self.disabled_retry if resp.status in (401, 403) else self.retry
            buf = bytearray()
            async for chunk in resp.content.iter_any():   # own line splitting: a snapshot line may be MiBs
                buf += chunk
                start = 0
                while (end := buf.find(b"\n", start)) >= 0:
                    line = bytes(buf[start:end])
                    start = end + 1
                    if line.strip() and not entry.apply(json.loads(line)):
                        logger.info("kv events of %s lost their place (gap or restart): resyncing", url)
                        return 0.0
                del buf[:start]
        return self.retry
