"""Where each tenant's system prompt was computed and evicted, read off the engines' own KV events
(GET /v1/kv_events) during a benchmarks/prefix_routing.py run: a diagnosis of the routing, not a score.

Every request of a tenant starts with the same first block (the chat template's opening plus the
first words of its system prompt), so a BlockStored carrying that block's hash on engine E means E
computed the tenant's prompt from scratch (a full miss), and a BlockRemoved means E evicted it.
"""
from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any

import aiohttp

from pagedmodel.server.router.prefix_index import hash_chain
from pagedmodel.server.router.prompt_tokens import token_ids


def first_blocks(tokenizer: Any, prompts: list[str], model: str, block_size: int) -> dict[bytes, int]:
    """The first block hash of each tenant's chat prompt -> tenant index."""
    out = {}
    for tenant, system in enumerate(prompts):
        body = {"model": model, "messages": [{"role": "system", "content": system}, {"role": "user", "content": "?"}]}
        ids = token_ids(tokenizer, "/v1/chat/completions", body)
        assert ids is not None, "the tokenizer has no chat template"
        out[hash_chain(ids, block_size)[0]] = tenant
    return out


class KVEventTrace:
    """Counts, per engine, first-block stores (full misses) and evictions of each tenant."""

    def __init__(self, tenants_by_block: dict[bytes, int]) -> None:
        self.tenants_by_block = tenants_by_block
        self.stored: dict[str, Counter[int]] = {}
        self.removed: dict[str, Counter[int]] = {}
        self._tasks: list[asyncio.Task[None]] = []

    def start(self, session: aiohttp.ClientSession, urls: list[str]) -> None:
        for i, url in enumerate(urls):
            self.stored[f"engine{i}"], self.removed[f"engine{i}"] = Counter(), Counter()
            self._tasks.append(asyncio.create_task(self._follow(session, url, f"engine{i}")))

    async def stop(self) -> dict[str, Any]:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        holders = Counter(t for c in self.stored.values() for t in c)
        return {"full_misses_per_engine": {e: sum(c.values()) for e, c in self.stored.items()},
                "evictions_per_engine": {e: sum(c.values()) for e, c in self.removed.items()},
                "tenants_computed_on_n_engines": dict(Counter(
                    sum(1 for c in self.stored.values() if c[t]) for t in holders)),
                "stored": {e: dict(c) for e, c in self.stored.items()},
                "removed": {e: dict(c) for e, c in self.removed.items()}}

    async def _follow(self, session: aiohttp.ClientSession, url: str, name: str) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_read=None)
        async with session.get(url + "/v1/kv_events", timeout=timeout) as resp:
            buf = b""
            async for chunk in resp.content.iter_any():   # own line splitting: a snapshot line may be long
                *lines, buf = (buf + chunk).split(b"\n")
                for line in lines:
                    if line.strip():
                        self._apply(name, json.loads(line))

    def _apply(self, name: str, msg: dict[str, Any]) -> None:
        for event in msg.get("events", ()) if msg.get("type") == "batch" else ():
            into = {"BlockStored": self.stored, "BlockRemoved": self.removed}.get(event.get("type"))
            for h in event.get("block_hashes", ()) if into is not None else ():
                tenant = self.tenants_by_block.get(bytes.fromhex(h))
                if tenant is not None:
                    into[name][tenant] += 1
