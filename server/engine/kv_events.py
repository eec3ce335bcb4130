"""The engine's prefix-cache change log: what a router needs to know which prompts this replica holds.

The block pool reports each full block it commits to the prefix cache (`stored`) and each cached block
it hands out again (`removed`, an eviction). Those land in a pending list on the engine thread; once
per step `publish()` turns them into one numbered batch. A bounded ring of recent batches lets a
subscriber that lost its connection replay from its last sequence number; one that fell behind the
ring, or saw a different `instance` (the engine restarted), starts again from `snapshot()`: every
hash cached now, with the block size and the hash scheme, so it can compute the same chain.

Shapes follow vLLM's KV events (BlockStored, BlockRemoved, AllBlocksCleared), as JSON-ready dicts
with hashes in hex. Token ids are not sent: the subscriber computes the hashes from its own copy of
the prompt, so the hashes alone say which prefixes are held.

Threading: the pool side (`stored`, `removed`, `cleared`, `publish`) runs on the engine thread only;
`snapshot`, `since` and `subscribe` may run on any thread. One lock guards what both sides read;
it is taken once per step that changed the cache, never per block. With nobody subscribed the cost
is a list append per committed or evicted block (docs/router.md has the measurement).
"""
from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Names the chained hash of block_manager.block_hash; a subscriber that does not know it cannot match.
HASH_SCHEME = "sha256-chain-v1"
DEFAULT_RING = 4096   # batches kept for replay: at one batch per step, several seconds of a busy engine


@dataclass(frozen=True)
class EventBatch:
    seq: int
    ts: float
    events: tuple[dict[str, Any], ...]

    def to_json(self) -> dict[str, Any]:
        return {"type": "batch", "seq": self.seq, "ts": self.ts, "events": list(self.events)}


class KVEventLog:
    def __init__(self, block_size: int, ring_size: int = DEFAULT_RING, clock: Callable[[], float] = time.time):
        if ring_size < 1:
            raise ValueError("ring_size must be >= 1")
        self.block_size = block_size
        self.instance = uuid.uuid4().hex   # changes on every engine start: subscribers then resync
        self._clock = clock
        self._pending: list[tuple[str, bytes | None, bytes | None]] = []   # (kind, hash, parent)
        self._lock = threading.Lock()
        self._ring: deque[EventBatch] = deque(maxlen=ring_size)
        self._seq = 0
        # the subscribers' view of the pool as of the last batch; a dict keeps commit order, so a
        # snapshot lists every parent before its children
        self._cached: dict[bytes, None] = {}
        self._listeners: dict[int, Callable[[], None]] = {}
        self._ids = itertools.count()

    # ---- engine thread ------------------------------------------------------------------------
    def stored(self, block_hash: bytes, parent_hash: bytes | None) -> None:
        self._pending.append(("s", block_hash, parent_hash))

    def removed(self, block_hash: bytes) -> None:
        self._pending.append(("r", block_hash, None))

    def cleared(self) -> None:
        self._pending.append(("c", None, None))

    def publish(self) -> EventBatch | None:
        """Turn the pending changes into the next batch and wake the subscribers; None if nothing changed."""
        if not self._pending:
            return None
        pending, self._pending = self._pending, []
        events = tuple(self._events(pending))
        with self._lock:
            for kind, h, _ in pending:
                if kind == "s":
                    self._cached[h] = None
                elif kind == "r":
                    self._cached.pop(h, None)
                else:
                    self._cached.clear()
            self._seq += 1
            batch = EventBatch(self._seq, self._clock(), events)
            self._ring.append(batch)
            listeners = list(self._listeners.values())
        for wake in listeners:
            wake()
        return batch

    def _events(self, pending: list[tuple[str, bytes | None, bytes | None]]) -> list[dict[str, Any]]:
        """Consecutive stores of one chain merge into one BlockStored (a prompt's blocks commit in order)."""
        out: list[dict[str, Any]] = []
        for kind, h, parent in pending:
            last = out[-1] if out else None
            if kind == "s":
                if last is not None and last["type"] == "BlockStored" and last["block_hashes"][-1] == _hex(parent):
                    last["block_hashes"].append(h.hex())
                else:
                    out.append({"type": "BlockStored", "block_hashes": [h.hex()], "parent_block_hash": _hex(parent),
                                "block_size": self.block_size})
            elif kind == "r":
                if last is not None and last["type"] == "BlockRemoved":
                    last["block_hashes"].append(h.hex())
                else:
                    out.append({"type": "BlockRemoved", "block_hashes": [h.hex()]})
            else:
                out.append({"type": "AllBlocksCleared"})
        return out

    # ---- any thread ---------------------------------------------------------------------------
    @property
    def seq(self) -> int:
        with self._lock:
            return self._seq

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            blocks = [h.hex() for h in self._cached]
            seq = self._seq
        return {"type": "snapshot", "instance": self.instance, "seq": seq, "block_size": self.block_size,
                "hash_scheme": HASH_SCHEME, "block_hashes": blocks}

    def since(self, seq: int, instance: str | None = None) -> list[EventBatch] | None:
        """The batches after `seq`, or None when they cannot be replayed (fell out of the ring, a
        sequence number from the future, or another instance): the caller then sends a snapshot."""
        if instance is not None and instance != self.instance:
            return None
        with self._lock:
            if seq > self._seq:
                return None
            if seq == self._seq:
                return []
            oldest = self._ring[0].seq if self._ring else self._seq + 1
            if seq + 1 < oldest:
                return None
            return [b for b in self._ring if b.seq > seq]

    def subscribe(self, wake: Callable[[], None]) -> Callable[[], None]:
        """`wake()` is called (on the engine thread: it must only schedule work) after each batch;
        returns the function that unsubscribes."""
        key = next(self._ids)
        with self._lock:
            self._listeners[key] = wake

        def unsubscribe() -> None:
            with self._lock:
                self._listeners.pop(key, None)
        return unsubscribe

    @property
    def num_subscribers(self) -> int:
        with self._lock:
            return len(self._listeners)


def _hex(h: bytes | None) -> str | None:
    return None if h is None else h.hex()
