"""Adapter affinity as a pure decision (adapter_affinity.py): which upstreams may take a request for a
`model`, resident ones first, and how it composes with every --strategy."""
from __future__ import annotations

import pytest

from pagedmodel.server.router.adapter_affinity import (ModelServing, Outcome, Served, choose, is_served,
                                                       parse_lora_info, parse_models, served_names)
from pagedmodel.server.router.strategies import STRATEGIES, Router, UpstreamView

A, B, C = "http://a:1", "http://b:1", "http://c:1"


def serving(*adapters: str, running: tuple[str, ...] = (), waiting: tuple[str, ...] = (),
            max_lora: int | None = 2) -> ModelServing:
    return ModelServing(frozenset({"base", *adapters}), "base", frozenset(running), frozenset(waiting), max_lora)


def urls(views: list[UpstreamView]) -> set[str]:
    return {v.url for v in views}


def test_only_upstreams_serving_the_adapter_are_candidates():
    views = [UpstreamView(A), UpstreamView(B), UpstreamView(C)]
    servings = {A: serving("sql"), B: serving(), C: serving("sql", "chat")}
    got = choose("sql", views, servings)
    assert urls(got.candidates) == {A, C} and got.outcome is Outcome.FREE_SLOT
    assert urls(choose("chat", views, servings).candidates) == {C}


def test_resident_upstreams_are_preferred_over_idle_ones():
    views = [UpstreamView(A, inflight=1), UpstreamView(B, inflight=0)]
    servings = {A: serving("sql", running=("sql",)), B: serving("sql")}
    got = choose("sql", views, servings)
    assert urls(got.candidates) == {A} and got.outcome is Outcome.HIT
    # waiting requests of the adapter mean it holds (or is about to hold) a slot there too
    servings = {A: serving("sql"), B: serving("sql", waiting=("sql",))}
    assert urls(choose("sql", views, servings).candidates) == {B}


def test_a_hot_resident_upstream_spills_to_others_beyond_bounded_load():
    # 6 in flight on A, 0 on B: the cap is ceil(1.25 * 7 / 2) = 5, so A no longer counts as resident
    views = [UpstreamView(A, inflight=6), UpstreamView(B, inflight=0)]
    servings = {A: serving("sql", running=("sql",)), B: serving("sql")}
    got = choose("sql", views, servings)
    assert got.outcome is Outcome.FREE_SLOT and B in urls(got.candidates)
    assert Router("kv-aware").pick(got.candidates).url == B


def test_free_slot_beats_full_slots_and_full_slots_still_serve():
    views = [UpstreamView(A), UpstreamView(B)]
    full = serving("sql", "x", "y", running=("x", "y"), max_lora=2)
    got = choose("sql", views, {A: full, B: serving("sql", running=("x",), max_lora=2)})
    assert urls(got.candidates) == {B} and got.outcome is Outcome.FREE_SLOT
    got = choose("sql", views, {A: full, B: full})
    assert urls(got.candidates) == {A, B} and got.outcome is Outcome.NO_SLOT


def test_base_model_and_no_model_go_anywhere_that_serves_them():
    views = [UpstreamView(A), UpstreamView(B)]
    servings = {A: serving("sql"), B: serving()}
    assert choose("base", views, servings).outcome is Outcome.BASE
    assert urls(choose("base", views, servings).candidates) == {A, B}
    assert urls(choose(None, views, servings).candidates) == {A, B}


def test_unknown_lists_pass_through_only_when_nothing_is_known():
    views = [UpstreamView(A), UpstreamView(B)]
    got = choose("sql", views, {A: ModelServing(), B: ModelServing()})
    assert urls(got.candidates) == {A, B} and got.outcome is Outcome.UNVERIFIED
    # B's list is known and lacks it: A (unknown) does not get it blindly; the request waits or is a 404
    got = choose("sql", views, {A: ModelServing(), B: serving()})
    assert got.candidates == [] and got.outcome is Outcome.NONE


def test_the_only_server_at_capacity_leaves_no_candidate():
    # A serves sql but is not among the available views (full): the request must wait, not go to B
    got = choose("sql", [UpstreamView(B)], {A: serving("sql"), B: serving()})
    assert got.candidates == [] and got.outcome is Outcome.NONE


def test_is_served_and_the_union():
    servings = {A: serving("sql"), B: serving("chat"), C: ModelServing()}
    assert is_served("sql", servings) is Served.YES
    assert is_served("nope", servings) is Served.NO
    assert is_served("nope", {A: ModelServing()}) is Served.UNKNOWN
    assert is_served("nope", {}) is Served.UNKNOWN
    assert served_names(servings) == ["base", "chat", "sql"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_picks_only_among_affinity_candidates(strategy):
    router = Router(strategy)
    # C is the emptiest, but it does not serve the adapter; A is resident but busier than B
    views = [UpstreamView(A, inflight=2, kv_usage=0.5), UpstreamView(B, inflight=1, kv_usage=0.2),
             UpstreamView(C, inflight=0, kv_usage=0.0)]
    servings = {A: serving("sql", running=("sql",)), B: serving("sql", running=("sql",)), C: serving()}
    for i in range(20):
        got = choose("sql", views, servings)
        assert router.pick(got.candidates, f"prompt {i}").url in {A, B}
    if strategy in ("kv-aware", "least-load"):   # within the candidates, the strategy's own score decides
        assert router.pick(choose("sql", views, servings).candidates).url == B


def test_parse_models_reads_names_and_the_base():
    body = {"object": "list", "data": [{"id": "base", "parent": None}, {"id": "sql", "parent": "base"}]}
    assert parse_models(body) == (frozenset({"base", "sql"}), "base")
    for bad in ({}, {"data": "x"}, {"data": [{"no": "id"}]}, [1]):
        with pytest.raises(ValueError):
            parse_models(bad)


def test_parse_lora_info_takes_the_newest_sample():
    text = ('# TYPE vllm:lora_requests_info gauge\n'
            'vllm:lora_requests_info{max_lora="4",running_lora_adapters="sql,chat",waiting_lora_adapters=""} 10\n'
            'vllm:lora_requests_info{max_lora="4",running_lora_adapters="",waiting_lora_adapters="x"} 20\n'
            'vllm:num_requests_running{model_name="m"} 1\n')
    assert parse_lora_info(text) == (frozenset(), frozenset({"x"}), 4)
    one = 'vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql,chat",waiting_lora_adapters=""} 5\n'
    assert parse_lora_info(one) == (frozenset({"sql", "chat"}), frozenset(), 2)
    assert parse_lora_info('vllm:num_requests_running{model_name="m"} 1\n') == (frozenset(), frozenset(), None)


def test_prefix_rings_of_alternating_candidate_sets_pick_as_fresh_rings_do():
    from pagedmodel.server.router.strategies import RING_CACHE, PrefixAffinity

    sets = [[UpstreamView(u) for u in urls_] for urls_ in ([A, B, C], [A, C], [B, C], [A])]
    prompts = [f"shared system prompt {i}" for i in range(30)]
    fresh = {i: [PrefixAffinity().pick(views, p).url for p in prompts] for i, views in enumerate(sets)}
    cached = PrefixAffinity()
    for _ in range(3):   # alternate as requests for different adapters would
        for i, views in enumerate(sets):
            assert [cached.pick(views, p).url for p in prompts] == fresh[i]
    assert len(cached._rings) == len(sets)
    for i in range(RING_CACHE + 5):   # bounded: old sets are dropped
        cached.pick([UpstreamView(f"http://x{i}:1")], "p")
    assert len(cached._rings) == RING_CACHE
    assert [cached.pick(sets[0], p).url for p in prompts] == fresh[0]
