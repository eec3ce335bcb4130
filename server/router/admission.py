"""Rate limiting for the router: token buckets, one global and optionally one per client.

Pure logic with an injectable clock (a zero-argument callable returning seconds), so tests
drive time explicitly and never sleep.
"""
from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

Clock = Callable[[], float]


def bearer_token(lowered: Mapping[str, str]) -> str | None:
    """The API key of `Authorization: Bearer KEY` (`lowered`: header names in lower case), or None."""
    auth = lowered.get("authorization", "")
    if auth[:7].lower() == "bearer " and auth[7:].strip():
        return auth[7:].strip()
    return None


def retry_after_seconds(delay: float) -> int:
    """Retry-After carries whole seconds; round up so a client retrying on time is admitted, never below 1."""
    return max(1, math.ceil(delay - 1e-9))



def evict_one(entries: OrderedDict, is_idle: Callable[[Any], bool]) -> None:
    """Drop one entry of an LRU-ordered map of per-client state: the least recently used idle one, since a
    bucket that is not full still remembers a debt; if none is idle, the oldest (memory must stay bounded)."""
    for key, value in entries.items():
        if is_idle(value):
            del entries[key]
            return
    entries.popitem(last=False)

class TokenBucket:
    """`burst` tokens at most, refilled at `rate` per second; each admitted request takes one token."""

    def __init__(self, rate: float, burst: int, clock: Clock = time.monotonic) -> None:
        if not (rate > 0 and math.isfinite(rate)):
            raise ValueError(f"rate must be a positive number of requests per second, got {rate!r}")
        if int(burst) != burst or burst < 1:
            raise ValueError(f"burst must be an integer >= 1, got {burst!r}")
        self.rate = float(rate)
        self.burst = int(burst)
        self._clock = clock
        self._tokens = float(burst)   # a fresh bucket admits a full burst at once
        self._last = clock()

    def _refill(self) -> None:
        now = self._clock()
        if now > self._last:  # a clock stepping backwards must never mint or burn tokens
            self._tokens = min(float(self.burst), self._tokens + (now - self._last) * self.rate)
            self._last = now

    @property
    def tokens(self) -> float:
        self._refill()
        return self._tokens

    def try_acquire(self) -> float:
        """Take one token. Returns 0.0 when admitted, else the seconds until a token will be available."""
        self._refill()
        if self._tokens >= 1.0 - 1e-9:
            self._tokens -= 1.0
            return 0.0
        return (1.0 - self._tokens) / self.rate

    def refund(self) -> None:
        """Give back a token taken for a request another limit then refused."""
        self._tokens = min(float(self.burst), self._tokens + 1.0)

    def idle_full(self) -> bool:
        """True when the bucket is back to `burst`: forgetting it changes nothing (per-client eviction)."""
        return self.tokens >= self.burst - 1e-9


@dataclass(frozen=True)
class RateDecision:
    allowed: bool
    retry_after: int = 0      # whole seconds for the Retry-After header; 0 when allowed
    scope: str = ""           # "global" or "client" when refused


class RateLimiter:
    """A global bucket and, optionally, one bucket per client.

    The client key is the request's API key (`Authorization: Bearer ...`) or, when `client_header`
    is set, that header's value; requests without a key share the global bucket only. A request
    must pass both buckets; the client bucket is checked first so a throttled client does not burn
    global tokens other clients could use (and a global refusal refunds the client's token). Idle, full client buckets are forgotten once more than
    `max_clients` are tracked, bounding memory under many distinct keys.
    """

    def __init__(self, rate: float | None = None, burst: int | None = None, *,
                 client_rate: float | None = None, client_burst: int | None = None,
                 client_header: str | None = None, max_clients: int = 10_000,
                 clock: Clock = time.monotonic) -> None:
        self._clock = clock
        self.global_bucket = (TokenBucket(rate, burst if burst is not None else max(1, math.ceil(rate)), clock)
                              if rate is not None else None)
        if client_rate is None and client_burst is not None:
            raise ValueError("a per-client burst needs a per-client rate")
        self.client_rate = client_rate
        self.client_burst = (client_burst if client_burst is not None
                             else (max(1, math.ceil(client_rate)) if client_rate is not None else None))
        if client_rate is not None:
            TokenBucket(client_rate, self.client_burst, clock)  # validates the parameters up front
        self.client_header = client_header.lower() if client_header else None
        if max_clients < 1:
            raise ValueError(f"max_clients must be >= 1, got {max_clients}")
        self.max_clients = max_clients
        self._clients: OrderedDict[str, TokenBucket] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.global_bucket is not None or self.client_rate is not None

    def client_key(self, headers: Mapping[str, str]) -> str | None:
        """The key a request's per-client bucket is found by (header lookup is case-insensitive)."""
        lowered = {k.lower(): v for k, v in headers.items()}
        if self.client_header:
            value = lowered.get(self.client_header, "").strip()
            return value or None
        return bearer_token(lowered)

    def _client_bucket(self, key: str) -> TokenBucket:
        bucket = self._clients.get(key)
        if bucket is None:
            if len(self._clients) >= self.max_clients:
                self._evict()
            assert self.client_rate is not None and self.client_burst is not None
            bucket = self._clients[key] = TokenBucket(self.client_rate, self.client_burst, self._clock)
        self._clients.move_to_end(key)
        return bucket

    def _evict(self) -> None:
        evict_one(self._clients, TokenBucket.idle_full)

    @property
    def tracked_clients(self) -> int:
        return len(self._clients)

    def check(self, client: str | None) -> RateDecision:
        bucket = None
        if self.client_rate is not None and client is not None:
            bucket = self._client_bucket(client)
            wait = bucket.try_acquire()
            if wait > 0:
                return RateDecision(False, retry_after_seconds(wait), "client")
        if self.global_bucket is not None:
            wait = self.global_bucket.try_acquire()
            if wait > 0:
                if bucket is not None:
                    bucket.refund()  # the request was not served: the client's budget is untouched
                return RateDecision(False, retry_after_seconds(wait), "global")
        return RateDecision(True)
