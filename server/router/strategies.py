"""How the router picks an upstream for a request: pure functions over upstream snapshots.

Each strategy sees only the upstreams that can take a request now (ready, not ejected, below
their in-flight cap) and returns one of them, or None when the list is empty.

- `kv-aware` (default): least loaded by a score mixing the engine's scraped KV-cache usage and
  waiting queue with the router's own in-flight count. The scrape lags (about a second) and an
  engine only counts a request once it arrives, so under bursts the router's fresh in-flight
  count is what keeps it from sending the whole burst to the replica that looked emptiest.
- `least-load`: fewest in-flight requests from this router (ties: lower KV usage).
- `round-robin`: rotate through the ready upstreams.
- `prefix`: requests with the same leading prompt go to the same upstream (consistent hashing
  on a ring of virtual nodes, so adding or removing a replica remaps only its share), unless
  that upstream's in-flight load exceeds `load_factor` times the mean ("bounded load"), in
  which case the next upstream clockwise on the ring takes it.
- `prefix-cache`: exact prefix-cache awareness. The router knows from the engines' own KV events
  which blocks each one holds (prefix_index.py) and how many of the prompt's leading tokens each
  would serve from cache. Upstreams past the same bounded-load cap as `prefix` are left out. Each
  prompt has a stable order of the others (a rendezvous hash of its leading text): its *home* is
  the first of them. The prompt goes home unless another upstream holds at least `MIN_GAIN` more of
  it; then the score `kv_score` minus `PREFIX_WEIGHT` times the cached share decides between home
  and those. So spills land where the hash strategy would put them (one home, one stable second
  home), and the cache knowledge only moves a prompt to where its prefix really is. A prompt no
  upstream holds (a cold tenant, or one evicted everywhere) is a full prefill that delays every
  request behind it on its engine, so it goes where it delays the fewest: the upstream with the
  least prefill pending, then the fewest recent picks, then its rendezvous order. Sending it home
  regardless put cold tenants' prefills in front of the hottest tenant's cache hits (2026-12-02
  benchmark: more hits than the hash strategy, a longer p99 TTFT).
"""
from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

STRATEGIES = ("kv-aware", "least-load", "prefix", "prefix-cache", "round-robin")
# A fully cached prompt is worth one full replica of load (kv_score's unit): prefill dominates a
# long prompt's first-token time, so a cached replica wins unless the other is nearly idle and it is not.
PREFIX_WEIGHT = 1.0
# How much more of the prompt (a share of its tokens) another upstream must hold for the prompt to leave
# its stable home. Below it the saving is small and a move would copy the prompt to a second engine.
MIN_GAIN = 0.1
PREFIX_KEY_CHARS = 256   # leading characters of the prompt that key the `prefix` ring and prefix-cache's ties
RING_CACHE = 32   # consistent-hash rings kept for recently seen upstream sets (PrefixAffinity)


@dataclass(frozen=True)
class UpstreamView:
    """What a strategy knows about one upstream at decision time."""

    url: str
    inflight: int = 0                    # requests this router has open to it (fresh)
    max_inflight: int | None = None      # the engine's capacity (max-num-seqs) if known
    kv_usage: float | None = None        # scraped vllm:kv_cache_usage_perc, 0..1
    waiting: float | None = None         # scraped vllm:num_requests_waiting
    running: float | None = None         # scraped vllm:num_requests_running
    cached_tokens: int = 0               # prompt tokens its prefix cache holds (prefix-cache strategy)
    prompt_tokens: int = 0               # the prompt's length in tokens, when the router tokenized it
    pending_prefill: int = 0             # uncached prompt tokens of its requests still before their first token
    recent_picks: int = 0                # how many of the router's latest picks went to it (prefix-cache)


def kv_score(u: UpstreamView) -> float:
    """Lower is better; units are roughly "fractions of a full replica".

    KV usage is already 0..1. Request counts are normalised by the engine's capacity when known,
    else by a nominal 64 sequences. Load is max(router in-flight, engine running + waiting): the
    router's own count is fresh (a burst shows up at once) but misses other routers' requests;
    the engine's count sees those but lags a scrape; taking the larger never counts a request
    twice. Waiting requests are added once more because an engine that queues is saturated.
    """
    capacity = float(u.max_inflight) if u.max_inflight else 64.0
    kv = min(max(u.kv_usage or 0.0, 0.0), 1.0)
    waiting = max(u.waiting or 0.0, 0.0)
    load = max(float(u.inflight), waiting + max(u.running or 0.0, 0.0))
    return kv + load / capacity + waiting / capacity


def _rotate_ties(ups: Sequence[UpstreamView], key, turn: int) -> UpstreamView | None:
    """The upstream with the lowest `key`; equal ones take turns (by `turn`). Breaking ties by URL
    sent every request to the same replica whenever the engines were idle between requests (low
    traffic finishes each request before the next arrives), leaving the others cold."""
    if not ups:
        return None
    best = min(key(u) for u in ups)
    tied = sorted((u for u in ups if key(u) == best), key=lambda u: u.url)
    return tied[turn % len(tied)]


def pick_kv_aware(ups: Sequence[UpstreamView], turn: int = 0) -> UpstreamView | None:
    return _rotate_ties(ups, lambda u: (kv_score(u), u.inflight), turn)


def pick_least_load(ups: Sequence[UpstreamView], turn: int = 0) -> UpstreamView | None:
    return _rotate_ties(ups, lambda u: (u.inflight, u.kv_usage or 0.0), turn)


def bounded_load(ups: Sequence[UpstreamView], load_factor: float = 1.25) -> int:
    """Most in-flight requests an upstream may hold before affinity stops counting for it."""
    total = sum(u.inflight for u in ups) + 1   # counting the request being placed
    return max(1, math.ceil(load_factor * total / len(ups)))


def cached_share(u: UpstreamView) -> float:
    """The share of the prompt's tokens `u` would serve from its prefix cache, 0..1."""
    share = u.cached_tokens / u.prompt_tokens if u.prompt_tokens > 0 else 0.0
    return min(max(share, 0.0), 1.0)


def prefix_cache_score(u: UpstreamView) -> float:
    """Lower is better: load (kv_score) minus the weighted share of the prompt served from cache."""
    return kv_score(u) - PREFIX_WEIGHT * cached_share(u)


def rendezvous_order(ups: Sequence[UpstreamView], prompt: str) -> list[UpstreamView]:
    """The upstreams in this prompt's own stable order (highest random weight first): removing one
    keeps the others' order, so a prompt's home and its second home survive upstream changes."""
    key = prompt[:PREFIX_KEY_CHARS].encode("utf-8", "surrogatepass")
    return sorted(ups, key=lambda u: (-_hash(u.url.encode() + b"\n" + key), u.url))


def pick_prefix_cache(ups: Sequence[UpstreamView], load_factor: float = 1.25, prompt: str = "") -> UpstreamView | None:
    """The prompt's home (first below the bounded-load cap in its rendezvous order) unless another
    upstream below the cap holds at least MIN_GAIN more of the prompt; then the best score among home
    and those. Spills follow the rendezvous order: sending them to the least loaded engine (the first
    design) computed a hot prompt on a second and third engine and evicted others' prefixes (in the
    2026-12-02 benchmark its hit rate, 72 %, stayed below the hash strategy's 81 %). A prompt held
    nowhere goes where the least prefill waits and the fewest recent requests went."""
    if not ups:
        return None
    cap = bounded_load(ups, load_factor)
    # never empty: the cap is above the mean in-flight, so some upstream is below it
    open_ = [u for u in rendezvous_order(ups, prompt) if u.inflight < cap] or rendezvous_order(ups, prompt)
    rank = {u.url: i for i, u in enumerate(open_)}
    if all(cached_share(u) < MIN_GAIN for u in ups):
        # held nowhere (over the cap included, else this is a spill): a full prefill, placed where it
        # holds up the fewest others
        return min(open_, key=lambda u: (u.pending_prefill, u.recent_picks, rank[u.url]))
    home = open_[0]
    holders = [u for u in open_[1:] if cached_share(u) >= cached_share(home) + MIN_GAIN]
    if not holders:
        return home
    return min([home, *holders], key=lambda u: (prefix_cache_score(u), rank[u.url]))


class RoundRobin:
    def __init__(self) -> None:
        self._next = 0

    def pick(self, ups: Sequence[UpstreamView]) -> UpstreamView | None:
        if not ups:
            return None
        ordered = sorted(ups, key=lambda u: u.url)   # stable order as upstreams come and go
        choice = ordered[self._next % len(ordered)]
        self._next += 1
        return choice


def _hash(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class PrefixAffinity:
    """Consistent hashing with bounded load (Mirrokni et al.'s scheme) keyed by the prompt prefix."""

    def __init__(self, vnodes: int = 64, load_factor: float = 1.25, prefix_chars: int = 256) -> None:
        if vnodes < 1 or load_factor < 1.0 or prefix_chars < 1:
            raise ValueError("vnodes >= 1, load_factor >= 1 and prefix_chars >= 1 are required")
        self.vnodes = vnodes
        self.load_factor = load_factor
        self.prefix_chars = prefix_chars
        self._ring_for: tuple[str, ...] = ()
        self._points: list[int] = []
        self._owners: list[str] = []
        # rings of recent upstream sets: adapter affinity hands each model its own subset, and requests for
        # different models alternate, so rebuilding one ring per change would rebuild on nearly every request
        self._rings: dict[tuple[str, ...], tuple[list[int], list[str]]] = {}

    def _ring(self, urls: tuple[str, ...]) -> None:
        if urls == self._ring_for:
            return
        ring = self._rings.pop(urls, None)
        if ring is None:
            pairs = sorted((_hash(f"{url}#{i}".encode()), url) for url in urls for i in range(self.vnodes))
            ring = [p for p, _ in pairs], [u for _, u in pairs]
            if len(self._rings) >= RING_CACHE:
                del self._rings[next(iter(self._rings))]   # least recently used
        self._rings[urls] = ring
        self._points, self._owners = ring
        self._ring_for = urls

    def key_of(self, prompt: str) -> bytes:
        return prompt[: self.prefix_chars].encode("utf-8", "surrogatepass")

    def bound(self, ups: Sequence[UpstreamView]) -> int:
        """Most in-flight requests an upstream may hold before the prefix spills to the next one."""
        return bounded_load(ups, self.load_factor)

    def pick(self, ups: Sequence[UpstreamView], prompt: str) -> UpstreamView | None:
        if not ups:
            return None
        by_url = {u.url: u for u in ups}
        self._ring(tuple(sorted(by_url)))
        cap = self.bound(ups)
        start = bisect.bisect(self._points, _hash(self.key_of(prompt))) % len(self._points)
        seen: set[str] = set()
        for i in range(len(self._points)):
            url = self._owners[(start + i) % len(self._points)]
            if url in seen:
                continue
            seen.add(url)
            if by_url[url].inflight < cap:
                return by_url[url]
            if len(seen) == len(by_url):
                break
        return pick_least_load(ups)   # cannot happen with cap >= mean, kept as a safe fallback


class Router:
    """One strategy instance per router process (round-robin and prefix keep state)."""

    def __init__(self, strategy: str) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
        self.strategy = strategy
        self._rr = RoundRobin()
        self._prefix = PrefixAffinity()
        self._turn = 0   # rotates ties among equally loaded upstreams (kv-aware, least-load)

    def pick(self, ups: Sequence[UpstreamView], prompt: str = "") -> UpstreamView | None:
        if self.strategy in ("kv-aware", "least-load"):
            self._turn += 1
            pick = pick_kv_aware if self.strategy == "kv-aware" else pick_least_load
            return pick(ups, self._turn)
        if self.strategy == "round-robin":
            return self._rr.pick(ups)
        if self.strategy == "prefix-cache":
            return pick_prefix_cache(ups, prompt=prompt)
        return self._prefix.pick(ups, prompt)
