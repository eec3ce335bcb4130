"""In-memory object storage with one global resourceVersion and a bounded event history for watches."""
from __future__ import annotations

import asyncio
import copy
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

Key = tuple[str, str]   # (namespace or "", name)


@dataclass
class WatchEvent:
    rv: int
    storage: str
    type: str            # ADDED | MODIFIED | DELETED
    obj: dict[str, Any]  # stored form, never mutated after recording
    old: dict[str, Any] | None = None   # the previous state, so filtered watches see objects leave


Delivery = tuple[int, str, dict[str, Any]]   # (resourceVersion, event type, object)


class Watcher:
    """One subscriber. ``transform`` filters and rewrites events (None drops one); queued without bound."""

    def __init__(self, storage: str, transform: Callable[[WatchEvent], Delivery | None]) -> None:
        self.storage = storage
        self.transform = transform
        self.queue: asyncio.Queue[Delivery | None] = asyncio.Queue()

    def offer(self, event: WatchEvent) -> None:
        if event.storage == self.storage:
            delivery = self.transform(event)
            if delivery is not None:
                self.queue.put_nowait(delivery)

    def close(self) -> None:
        self.queue.put_nowait(None)


class Store:
    def __init__(self, history_size: int = 20000) -> None:
        self.resource_version = 100
        self._objects: dict[str, dict[Key, dict[str, Any]]] = {}
        self._history: deque[WatchEvent] = deque(maxlen=history_size)
        # Watches may start from any version > this; older ones get 410 Gone.
        self.oldest_watchable = self.resource_version
        self._watchers: set[Watcher] = set()
        self._listeners: list[Callable[[WatchEvent], None]] = []

    # --- reads -------------------------------------------------------------------------

    def get(self, storage: str, namespace: str, name: str) -> dict[str, Any] | None:
        obj = self._objects.get(storage, {}).get((namespace, name))
        return copy.deepcopy(obj) if obj is not None else None

    def peek(self, storage: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The stored object itself, for read-only use inside the event loop (no copy)."""
        return self._objects.get(storage, {}).get((namespace, name))

    def list(self, storage: str, namespace: str | None = None) -> list[dict[str, Any]]:
        items = self._objects.get(storage, {})
        keys = sorted(k for k in items if namespace is None or k[0] == namespace)
        return [items[k] for k in keys]

    def storages(self) -> list[str]:
        return list(self._objects)

    # --- writes ------------------------------------------------------------------------

    def write(self, storage: str, obj: dict[str, Any], event_type: str) -> dict[str, Any]:
        """Store ``obj`` (ADDED or MODIFIED) under a new resourceVersion; returns a copy."""
        self.resource_version += 1
        obj["metadata"]["resourceVersion"] = str(self.resource_version)
        key = (obj["metadata"].get("namespace", ""), obj["metadata"]["name"])
        stored = copy.deepcopy(obj)
        bucket = self._objects.setdefault(storage, {})
        old = bucket.get(key)
        bucket[key] = stored
        self._record(WatchEvent(self.resource_version, storage, event_type, stored, old))
        return copy.deepcopy(stored)

    def remove(self, storage: str, namespace: str, name: str) -> dict[str, Any] | None:
        stored = self._objects.get(storage, {}).pop((namespace, name), None)
        if stored is None:
            return None
        self.resource_version += 1
        final = copy.deepcopy(stored)
        final["metadata"]["resourceVersion"] = str(self.resource_version)
        self._record(WatchEvent(self.resource_version, storage, "DELETED", final, stored))
        return copy.deepcopy(final)

    def drop_storage(self, storage: str) -> None:
        self._objects.pop(storage, None)

    def _record(self, event: WatchEvent) -> None:
        if len(self._history) == self._history.maxlen:
            self.oldest_watchable = self._history[0].rv
        self._history.append(event)
        for watcher in list(self._watchers):
            watcher.offer(event)
        for listener in list(self._listeners):
            listener(event)

    def compact(self) -> None:
        """Forget history (as etcd compaction does): watches from older versions now get 410."""
        self._history.clear()
        self.oldest_watchable = self.resource_version

    # --- watching ----------------------------------------------------------------------

    def subscribe(self, watcher: Watcher, since: int | None) -> list[Delivery] | None:
        """Register ``watcher``; returns the backlog after ``since`` or None if that version is gone.

        Runs without awaiting, so no write can slip between the backlog and live events.
        """
        backlog: list[Delivery] = []
        if since is not None:
            if since < self.oldest_watchable:
                return None
            for event in self._history:
                if event.rv > since and event.storage == watcher.storage:
                    delivery = watcher.transform(event)
                    if delivery is not None:
                        backlog.append(delivery)
        self._watchers.add(watcher)
        return backlog

    def unsubscribe(self, watcher: Watcher) -> None:
        self._watchers.discard(watcher)

    def close_watchers(self) -> None:
        for watcher in list(self._watchers):
            watcher.close()
        self._watchers.clear()

    def add_listener(self, listener: Callable[[WatchEvent], None]) -> None:
        """In-process observers (the local controllers) called synchronously on each write."""
        self._listeners.append(listener)
