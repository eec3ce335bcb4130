"""The router's prefix-cache index (gap -> resync, bound, block-size change, removal), the prompt's hash
chain as the engine computes it, and the `prefix-cache` strategy's choice."""
from __future__ import annotations

import pytest

from pagedmodel.server.engine.block_manager import block_hash
from pagedmodel.server.engine.kv_events import HASH_SCHEME, KVEventLog
from pagedmodel.server.router.prefix_index import PrefixIndex, PromptChains, UpstreamBlocks, hash_chain
from pagedmodel.server.router.strategies import (MIN_GAIN, STRATEGIES, Router, UpstreamView, pick_prefix_cache,
                                                 rendezvous_order)

TOKENS = list(range(1000, 1041))    # 41 tokens: ten full 4-token blocks before the last one


def engine_log(tokens: list[int], block_size: int, salt: bytes = b"") -> KVEventLog:
    """A real engine-side log holding `tokens`' blocks: the router must read its messages."""
    log = KVEventLog(block_size)
    parent = None
    for i in range(len(tokens) // block_size):
        h = block_hash(parent, tuple(tokens[i * block_size:(i + 1) * block_size]), salt)
        log.stored(h, parent)
        parent = h
    log.publish()
    return log


def test_chain_matches_what_the_engine_stores_and_stops_before_the_last_token():
    log = engine_log(TOKENS, 4)
    chain = hash_chain(TOKENS, 4)
    assert len(chain) == 10 and len(hash_chain(TOKENS[:40], 4)) == 9   # the last token's block never counts
    up = UpstreamBlocks()
    assert up.apply(log.snapshot())
    assert up.matched_blocks(chain) == 10
    assert up.matched_blocks(hash_chain(TOKENS[:8] + [7] * 20, 4)) == 2        # diverges after two blocks
    assert up.matched_blocks(hash_chain(TOKENS, 4, salt=b"tenant")) == 0       # salted chain: no match


def test_batches_apply_in_order_and_a_gap_forces_a_resync():
    log = KVEventLog(4)
    up = UpstreamBlocks()
    assert up.apply(log.snapshot()) and up.usable
    h = [bytes([i]) * 32 for i in range(4)]
    log.stored(h[0], None)
    b1 = log.publish().to_json()
    log.stored(h[1], h[0])
    b2 = log.publish().to_json()
    log.removed(h[0])
    b3 = log.publish().to_json()
    assert up.apply(b1) and up.matched_blocks([h[0]]) == 1
    assert not up.apply(b3)                       # b2 was lost
    assert not up.synced and up.matched_blocks([h[1]]) == 0 and not up.hashes   # claims nothing until resync
    assert up.apply(log.snapshot())
    assert up.seq == 3 and set(up.hashes) == {h[1]}
    assert not up.apply(b2)                       # a stale batch after the snapshot is a gap too
    assert up.apply(log.snapshot()) and up.apply({"type": "heartbeat", "seq": 3})
    assert not up.apply({"type": "heartbeat", "seq": 5})   # the engine is ahead of us: we missed batches


def test_disconnect_claims_nothing_until_a_matching_resume_and_a_restart_resyncs():
    log = engine_log(TOKENS, 4)
    up = UpstreamBlocks()
    up.apply(log.snapshot())
    up.disconnected()
    assert up.synced and not up.usable and up.matched_blocks(hash_chain(TOKENS, 4)) == 0
    assert up.apply({"type": "resume", "instance": log.instance, "seq": log.seq, "block_size": 4})
    assert up.matched_blocks(hash_chain(TOKENS, 4)) == 10
    up.disconnected()
    assert not up.apply({"type": "resume", "instance": "restarted", "seq": log.seq, "block_size": 4})
    assert not up.synced


def test_block_size_is_learned_from_the_snapshot_and_a_change_stays_exact():
    index = PrefixIndex()
    prompt = PromptChains(TOKENS)
    index.get("http://a").apply(engine_log(TOKENS, 4).snapshot())
    assert index.cached_tokens("http://a", prompt) == 40
    # The engine restarts with --block-size 8: a new instance, a new snapshot, chains of 8 tokens.
    index.get("http://a").apply(engine_log(TOKENS, 8).snapshot())
    assert index.get("http://a").block_size == 8
    assert index.cached_tokens("http://a", prompt) == 40
    assert index.cached_tokens("http://unknown", prompt) == 0


def test_index_is_bounded_and_forgets_removed_upstreams():
    index = PrefixIndex(max_blocks_per_upstream=3)
    up = index.get("http://a")
    up.apply(engine_log(TOKENS, 4).snapshot())
    assert len(up.hashes) == 3
    assert index.cached_tokens("http://a", PromptChains(TOKENS)) == 0   # the oldest (leading) blocks went
    index.remove("http://a")
    assert "http://a" not in index.upstreams
    with pytest.raises(ValueError):
        PrefixIndex(0)


def test_unknown_hash_scheme_is_not_trusted():
    snap = engine_log(TOKENS, 4).snapshot() | {"hash_scheme": "xxhash-v9"}
    up = UpstreamBlocks()
    assert not up.apply(snap) and not up.usable
    assert HASH_SCHEME != "xxhash-v9"


def view(url: str, inflight: int = 0, cached: int = 0, prompt: int = 100, **kw) -> UpstreamView:
    return UpstreamView(url, inflight=inflight, max_inflight=8, cached_tokens=cached, prompt_tokens=prompt, **kw)


def test_strategy_picks_the_longest_cached_prefix():
    ups = [view("http://a", cached=32), view("http://b", cached=96), view("http://c")]
    assert pick_prefix_cache(ups).url == "http://b"
    assert "prefix-cache" in STRATEGIES and Router("prefix-cache").pick(ups).url == "http://b"


def test_strategy_spills_past_the_load_bound_and_refuses_nothing():
    hot = [view("http://a", inflight=6, cached=96), view("http://b"), view("http://c")]
    assert pick_prefix_cache(hot).url != "http://a"          # a past the bounded-load cap: spills
    busy = [view("http://a", cached=96, kv_usage=0.9), view("http://b", kv_usage=0.0)]
    assert all(pick_prefix_cache(busy, prompt=f"t{t}").url == "http://a" for t in range(16))   # a hit outweighs free KV
    assert pick_prefix_cache([]) is None


def rendezvous_urls(urls: list[str], prompt: str) -> list[str]:
    return [u.url for u in rendezvous_order([view(u) for u in urls], prompt)]


def home_and_second(urls: list[str], prompt: str) -> tuple[str, str]:
    order = rendezvous_urls(urls, prompt)
    return order[0], order[1]


def test_prompts_nobody_caches_spread_and_each_keeps_its_home_whatever_the_load():
    # A cold prompt goes to its own rendezvous home, not to the least loaded replica: the first design
    # sent it wherever load was lowest at that moment, so a tenant's prompt was computed on a second
    # and third engine and evicted other tenants' prefixes (2026-12-02 benchmark).
    urls = ["http://a", "http://b", "http://c"]
    prompts = [f"system:tenant {t} rules" for t in range(16)]
    idle = [view(u) for u in urls]
    homes = [pick_prefix_cache(idle, prompt=p).url for p in prompts]
    assert set(homes) == set(urls)
    assert homes == [pick_prefix_cache(list(reversed(idle)), prompt=p).url for p in prompts]
    assert homes == [home_and_second(urls, p)[0] for p in prompts]
    for p, home in zip(prompts, homes):
        # the home among the busiest but below the cap (1, 1 and 0 in flight: cap ceil(1.25 * 3 / 3) = 2),
        # another replica idle: the prompt still goes home, as it would under the hash strategy
        other, idle_one = [u for u in urls if u != home]
        loads = [view(home, inflight=1), view(other, inflight=1), view(idle_one)]
        assert pick_prefix_cache(loads, prompt=p).url == home
    assert Router("prefix-cache").pick(idle, prompts[3]) == pick_prefix_cache(idle, prompt=prompts[3])


def test_a_spill_goes_to_the_prompts_stable_second_home_not_the_least_loaded():
    urls = ["http://a", "http://b", "http://c"]
    for t in range(16):
        p = f"system:tenant {t} rules"
        home, second, third = rendezvous_urls(urls, p)
        # the home holds the prompt but is past the cap (3 in flight of 4: cap ceil(1.25 * 5 / 3) = 3);
        # the second home has one in flight, the third none: the spill still goes to the second home
        ups = [view(home, inflight=3, cached=96), view(second, inflight=1), view(third)]
        assert pick_prefix_cache(ups, prompt=p).url == second
        # and the second home, once it holds the prompt too, takes the next spill as well
        ups = [view(home, inflight=3, cached=96), view(second, inflight=1, cached=96), view(third)]
        assert pick_prefix_cache(ups, prompt=p).url == second


def test_a_real_hit_elsewhere_moves_the_prompt_a_token_of_boilerplate_does_not():
    urls = ["http://a", "http://b", "http://c"]
    for t in range(16):
        p = f"system:tenant {t} rules"
        home, second, third = rendezvous_urls(urls, p)
        ups = [view(home), view(second), view(third, cached=96)]
        assert pick_prefix_cache(ups, prompt=p).url == third              # the prefix is really there
        ups = [view(home), view(second, cached=96, kv_usage=0.2), view(third, cached=64)]
        assert pick_prefix_cache(ups, prompt=p).url == second             # more of it there outweighs some load
        gain = int(100 * MIN_GAIN) - 1                                    # a shared template block or two
        ups = [view(home), view(second, cached=gain), view(third, cached=gain)]
        assert pick_prefix_cache(ups, prompt=p).url == home
        ups = [view(home, cached=40), view(second, cached=40 + gain), view(third)]
        assert pick_prefix_cache(ups, prompt=p).url == home


def test_a_prompt_held_nowhere_goes_where_it_delays_the_fewest_others():
    # A cold prompt is a full prefill: sent home regardless, it queued the hottest tenant's cache hits
    # behind it (2026-12-02 benchmark, run 6). It goes where the least prefill is pending, then where the
    # fewest recent requests went; only then does its rendezvous order decide.
    urls = ["http://a", "http://b", "http://c"]
    for t in range(16):
        p = f"system:tenant {t} rules"
        home, second, third = rendezvous_urls(urls, p)
        ups = [view(home, pending_prefill=1500), view(second, pending_prefill=40, recent_picks=1),
               view(third, recent_picks=20)]
        assert pick_prefix_cache(ups, prompt=p).url == third              # nothing pending there
        ups = [view(home, recent_picks=20), view(second, recent_picks=6), view(third, recent_picks=5)]
        assert pick_prefix_cache(ups, prompt=p).url == third              # then the least recent traffic
        ups = [view(home, recent_picks=5), view(second, recent_picks=5), view(third, recent_picks=9)]
        assert pick_prefix_cache(ups, prompt=p).url == home               # then its own order
        # held somewhere (here past the cap): a spill, which keeps the stable second home
        ups = [view(home, inflight=3, cached=96), view(second, inflight=1, recent_picks=20, pending_prefill=900),
               view(third)]
        assert pick_prefix_cache(ups, prompt=p).url == second
        # held at home: a hit, whatever is pending there
        ups = [view(home, cached=96, pending_prefill=1500, recent_picks=30), view(second), view(third)]
        assert pick_prefix_cache(ups, prompt=p).url == home


def test_routing_counts_pending_prefill_until_the_first_token_and_recent_picks_in_a_window():
    from pagedmodel.server.router.prefix_cache import RECENT_PICKS, PrefixCacheRouting

    routing = PrefixCacheRouting(None)
    routing.index.get("http://a").apply(engine_log(TOKENS, 4).snapshot())    # a holds all ten blocks
    cold, warm = PromptChains([7] * 41), PromptChains(TOKENS)
    routing.routed("http://b", cold)
    routing.routed("http://a", warm)
    views = routing.annotate([view("http://a"), view("http://b")], warm)
    assert [(v.pending_prefill, v.recent_picks, v.cached_tokens) for v in views] == [(1, 1, 40), (41, 1, 0)]
    routing.routed("http://a", cold)          # a retry elsewhere moves the pending tokens with it
    assert dict(routing.pending_prefill) == {"http://a": 42}
    routing.prefilled(cold)
    routing.prefilled(cold)                   # idempotent: a stream's every later chunk says it again
    routing.prefilled(warm)
    routing.prefilled(None)
    assert dict(routing.pending_prefill) == {}
    for i in range(RECENT_PICKS):
        chains = PromptChains([i])
        routing.routed("http://c", chains)
        routing.prefilled(chains)
    views = routing.annotate([view("http://a"), view("http://c")], warm)
    assert [v.recent_picks for v in views] == [0, RECENT_PICKS]   # a's picks fell out of the window


def test_a_prompts_home_survives_another_replica_leaving():
    urls = ["http://a", "http://b", "http://c", "http://d"]
    for t in range(32):
        p = f"system:tenant {t} rules"
        home, _ = home_and_second(urls, p)
        rest = [view(u) for u in urls if u != next(u for u in urls if u != home)]
        assert pick_prefix_cache(rest, prompt=p).url == home


def test_operator_spec_and_crds_offer_exactly_the_routers_strategies():
    from pathlib import Path

    import yaml

    from pagedmodel.operator.spec import validate, with_defaults

    root = Path(__file__).resolve().parents[2]
    for crd in ("crds/pagedmodel.yaml", "charts/pagedmodel/crds/pagedmodel.yaml"):
        doc = yaml.safe_load((root / crd).read_text())
        props = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
        assert props["router"]["properties"]["strategy"]["enum"] == list(STRATEGIES), crd
    for strategy in STRATEGIES:
        assert not validate(with_defaults({"model": {"source": "builtin://smollm2"}, "router": {"strategy": strategy}}))
    assert validate(with_defaults({"model": {"source": "builtin://smollm2"}, "router": {"strategy": "prefix-cach"}}))


def test_a_routed_prompt_counts_as_held_until_confirmed_denied_or_expired():
    log = KVEventLog(4)
    index = PrefixIndex()
    index.get("http://a").apply(log.snapshot())
    prompt = PromptChains(TOKENS)
    chain = prompt.chain(4)
    index.expect("http://a", prompt, now=100.0, ttl=30.0)
    assert index.cached_tokens("http://a", prompt, now=101.0) == 40     # in flight: the next one follows it
    assert index.cached_tokens("http://a", prompt, now=131.0) == 0      # never confirmed: the claim lapses
    index.expect("http://a", prompt, now=200.0, ttl=30.0)
    log.stored(chain[0], None)
    log.removed(chain[1])      # the engine evicted what it was expected to hold: denied at once
    assert index.get("http://a").apply(log.publish().to_json())
    assert index.cached_tokens("http://a", prompt, now=201.0) == 4
    assert chain[0] in index.get("http://a").hashes and chain[0] not in index.get("http://a").expected
