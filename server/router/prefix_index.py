"""The router's index of which prefix-cache blocks each engine holds, fed by the engines' KV events.

Per upstream: the engine instance and last batch number seen, its block size (learned from the
snapshot, so a `--block-size` change needs no router configuration) and the set of block hashes
it holds, capped at `max_blocks` with least-recently-stored eviction (an index that forgets a block
only makes routing fall back to load for it; it never claims a block the engine lacks).

In flight: a prompt just routed to an engine is not in its cache until that engine has computed it
(seconds for a long prompt under load); without more, the next request with the same prefix would
see no holder and go by load to another engine, which computes the prefix a second time. So the
router records the chain it routed as *expected* on the chosen engine (`expect`), counted as held
until the engine's events confirm it (BlockStored), deny it (BlockRemoved) or `EXPECT_TTL_S` passes.

Correctness under loss: a batch whose number is not the next one means events were lost; the index
marks the upstream as needing a resync and matches nothing for it until a snapshot replaces its set
(an index that is unsure claims nothing). Pure data structure: the network side is kv_subscriber.py.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pagedmodel.server.engine.block_manager import block_hash
from pagedmodel.server.engine.kv_events import HASH_SCHEME   # the chain hash_chain below recomputes

DEFAULT_MAX_BLOCKS = 1 << 18      # per upstream: ~256k hashes, ~40 MiB at worst; far above a KV cache
EXPECT_TTL_S = 30.0               # longer than a queued long prefill takes; a lost request's claim ends


@dataclass
class UpstreamBlocks:
    """One engine's cached blocks as the router knows them."""

    max_blocks: int = DEFAULT_MAX_BLOCKS
    instance: str | None = None
    seq: int | None = None          # last batch applied; None: no valid state (resync needed)
    block_size: int | None = None
    hashes: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    expected: dict[bytes, float] = field(default_factory=dict)   # routed, not yet confirmed: hash -> expiry
    resyncs: int = 0
    live: bool = False              # connected and confirmed current (snapshot, or a resume that matched)

    @property
    def synced(self) -> bool:
        """The state is a valid prefix of the engine's stream: a reconnect may resume after `seq`."""
        return self.seq is not None and self.block_size is not None

    @property
    def usable(self) -> bool:
        return self.live and self.synced

    def disconnected(self) -> None:
        """The stream broke: claim nothing until a resume shows no batch was missed (or the engine,
        restarted, sends a snapshot)."""
        self.live = False

    def apply(self, msg: dict[str, Any]) -> bool:
        """Apply one line of the engine's stream; False when the stream can no longer be trusted
        (a gap, another instance, an unknown hash scheme): the caller resubscribes from a snapshot."""
        kind = msg.get("type")
        if kind == "snapshot":
            return self._snapshot(msg)
        if kind == "resume":
            self.live = self.synced and msg.get("instance") == self.instance and msg.get("seq") == self.seq
            return self.live or self.invalidate()
        if kind == "heartbeat":
            return msg.get("seq") == self.seq or self.invalidate()
        if kind == "batch":
            if not self.synced or msg.get("seq") != self.seq + 1:   # type: ignore[operator]
                return self.invalidate()
            for event in msg.get("events", ()):
                self._event(event)
            self.seq = msg["seq"]
            return True
        return True   # a line of a newer engine we do not know: harmless to skip

    def invalidate(self) -> bool:
        self.seq = None
        self.live = False
        self.hashes.clear()
        return False

    def _snapshot(self, msg: dict[str, Any]) -> bool:
        self.hashes.clear()
        if msg.get("hash_scheme") != HASH_SCHEME or not isinstance(msg.get("block_size"), int):
            self.seq = self.block_size = None
            return False
        self.instance, self.seq, self.block_size = msg.get("instance"), int(msg["seq"]), msg["block_size"]
        self._store(msg.get("block_hashes", ()))
        self.resyncs += 1
        self.live = True
        return True

    def _event(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind == "BlockStored":
            self._store(event.get("block_hashes", ()))
        elif kind == "BlockRemoved":
            for h in event.get("block_hashes", ()):
                key = bytes.fromhex(h)
                self.hashes.pop(key, None)
                self.expected.pop(key, None)
        elif kind == "AllBlocksCleared":
            self.hashes.clear()
            self.expected.clear()

    def _store(self, hexes: Iterable[str]) -> None:
        for h in hexes:
            key = bytes.fromhex(h)
            self.hashes[key] = None
            self.hashes.move_to_end(key)
            self.expected.pop(key, None)
        while len(self.hashes) > self.max_blocks:
            self.hashes.popitem(last=False)

    def expect(self, chain: list[bytes], until: float, now: float) -> None:
        """The engine was just sent a prompt with this chain: count it as held until `until`."""
        for h in chain:
            if h not in self.hashes:
                self.expected.pop(h, None)   # re-inserted last: the dict stays in expiry order
                self.expected[h] = until
        if len(self.expected) > self.max_blocks:
            for h in [h for h, t in self.expected.items() if t <= now]:
                del self.expected[h]
            while len(self.expected) > self.max_blocks:
                del self.expected[next(iter(self.expected))]

    def matched_blocks(self, chain: list[bytes], now: float = float("-inf")) -> int:
        """How many leading blocks of the prompt's hash chain this engine holds (or is computing)."""
        if not self.usable:
            return 0
        n = 0
        for h in chain:
            if h not in self.hashes and self.expected.get(h, now) <= now:
                break
            n += 1
        return n


def hash_chain(token_ids: list[int], block_size: int, salt: bytes = b"") -> list[bytes]:
    """The engine's chained block hashes of a prompt: every full block before the last token (the
    engine always computes that one, so it is never served from the cache)."""
    out: list[bytes] = []
    parent: bytes | None = None
    for i in range((len(token_ids) - 1) // block_size):
        parent = block_hash(parent, tuple(token_ids[i * block_size:(i + 1) * block_size]), salt)
        out.append(parent)
    return out


class PromptChains:
    """One prompt's hash chains, computed once per block size seen among the upstreams."""

    def __init__(self, token_ids: list[int], salt: bytes = b"") -> None:
        self.token_ids = token_ids
        self.salt = salt
        self._by_size: dict[int, list[bytes]] = {}

    def chain(self, block_size: int) -> list[bytes]:
        got = self._by_size.get(block_size)
        if got is None:
            got = self._by_size[block_size] = hash_chain(self.token_ids, block_size, self.salt)
        return got


class PrefixIndex:
    """All upstreams' blocks; entries come and go with the upstream set."""

    def __init__(self, max_blocks_per_upstream: int = DEFAULT_MAX_BLOCKS) -> None:
        if max_blocks_per_upstream < 1:
            raise ValueError("max_blocks_per_upstream must be >= 1")
        self.max_blocks = max_blocks_per_upstream
        self.upstreams: dict[str, UpstreamBlocks] = {}

    def get(self, url: str) -> UpstreamBlocks:
        up = self.upstreams.get(url)
        if up is None:
            up = self.upstreams[url] = UpstreamBlocks(self.max_blocks)
        return up

    def remove(self, url: str) -> None:
        self.upstreams.pop(url, None)

    def cached_tokens(self, url: str, prompt: PromptChains, now: float = float("-inf")) -> int:
        """Prompt tokens `url` would serve from its prefix cache (0 when unknown or out of sync)."""
        up = self.upstreams.get(url)
        if up is None or not up.usable:
            return 0
        assert up.block_size is not None
        return up.matched_blocks(prompt.chain(up.block_size), now) * up.block_size

    def expect(self, url: str, prompt: PromptChains, now: float, ttl: float = EXPECT_TTL_S) -> None:
        up = self.upstreams.get(url)
        if up is not None and up.usable:
            assert up.block_size is not None
            up.expect(prompt.chain(up.block_size), now + ttl, now)
