"""The engine tuner: each rule, the modes, cooldown, holds, judging and reverting a change."""
from __future__ import annotations

import json

import pytest

from pagedmodel.operator.observation import Observation
from pagedmodel.operator.spec import DEFAULTS
from pagedmodel.operator.tuner import TunerState, TuningPolicy, tune

ENGINE = {"maxNumSeqs": 256, "blockSize": 16}
STEP = 15.0


def policy(mode: str = "Auto", **kw) -> TuningPolicy:
    base = dict(mode=mode, min_max_num_seqs=16, max_max_num_seqs=1024, block_sizes=(8, 16, 32), cooldown_s=1800)
    base.update(kw)
    return TuningPolicy(**base)


def scrapes(start: float, end: float, *, engines: int = 2, kv: float = 0.5, waiting: int = 0,
            running: int | None = None, msn: int = 0, block: int = 0, preempt: float = 0.0, swaps: float = 0.0,
            finished: float = 4.0, seq_len: float = 300.0) -> list[Observation]:
    """One scrape every STEP seconds in [start, end): per-scrape increments of finished requests of
    `seq_len` tokens each (one third prompt), and of preemptions / swap-outs."""
    out = []
    t = start
    while t < end:
        out.append(Observation(t, engines, kv, waiting, running if running is not None else 20 * engines,
                               msn, block, preempt, swaps, finished, finished * seq_len / 3,
                               finished * seq_len * 2 / 3))
        t += STEP
    return out


def slot_bound(start: float, end: float, msn: int = 256, **kw) -> list[Observation]:
    return scrapes(start, end, kv=0.3, waiting=10, running=2 * msn, msn=msn, **kw)


# ---------------------------------------------------------------- rules

def test_slots_not_memory_the_bottleneck_raises_max_num_seqs():
    d = tune(policy("Recommend"), slot_bound(0, 300), ENGINE, TunerState(), 300.0)
    assert d.recommendation == {"maxNumSeqs": 512}          # at most doubling (0.8 / 0.3 would be 2.7x)
    assert not d.apply and not d.revert and d.held == "mode Recommend: proposal only"
    assert "slots are the bottleneck" in d.reason and "100% of 256 slots" in d.reason and "0.30" in d.reason


def test_raise_aims_at_the_target_kv_usage_and_respects_bounds():
    window = scrapes(0, 300, kv=0.5, waiting=6, running=512, msn=256)
    assert tune(policy(), window, ENGINE, TunerState(), 300.0).recommendation == {"maxNumSeqs": 416}   # 256*1.6
    capped = tune(policy(max_max_num_seqs=400), window, ENGINE, TunerState(), 300.0)
    assert capped.recommendation == {"maxNumSeqs": 400}
    # A raise below 25 % is not worth a rolling restart.
    assert tune(policy(max_max_num_seqs=300), window, ENGINE, TunerState(), 300.0).recommendation == {}


@pytest.mark.parametrize("kv, waiting, running, why", [
    (0.7, 10, 512, "memory near its limit"),
    (0.3, 0, 512, "nobody waits"),
    (0.3, 10, 400, "slots not full"),
])
def test_no_raise_unless_all_three_signals_agree(kv, waiting, running, why):
    d = tune(policy(), scrapes(0, 300, kv=kv, waiting=waiting, running=running, msn=256), ENGINE, TunerState(),
             300.0)
    assert d.recommendation == {}, why
    assert "no change" in d.reason


def test_memory_thrash_lowers_max_num_seqs_below_the_peak():
    window = scrapes(0, 300, kv=0.98, waiting=3, running=200, msn=256, preempt=2.0, finished=4)
    d = tune(policy("Recommend"), window, ENGINE, TunerState(), 300.0)
    assert d.recommendation == {"maxNumSeqs": 72}            # 0.75 x peak 100 running per engine, to 8s
    assert "memory thrash" in d.reason and "36 preemptions/swap-outs for 72 finished requests" in d.reason


def test_swap_outs_count_as_thrash_but_a_rare_preemption_does_not():
    swaps = scrapes(0, 300, kv=0.98, running=200, msn=256, swaps=1.0, finished=4)
    assert tune(policy(), swaps, ENGINE, TunerState(), 300.0).recommendation == {"maxNumSeqs": 72}
    rare = scrapes(0, 300, kv=0.9, running=200, msn=256, finished=40)
    rare[5] = Observation(rare[5].time, 2, 0.9, 0, 200, 256, 0, 3.0, 0.0, 40, 4000, 8000)
    assert tune(policy(), rare, ENGINE, TunerState(), 300.0).recommendation == {}   # 3 of 760 finished


def test_thrash_fix_that_would_not_bind_is_not_proposed():
    # The bound keeps maxNumSeqs >= 128 but engines only ever run 60: a cap of 128 changes nothing.
    window = scrapes(0, 300, kv=0.98, running=120, msn=256, preempt=2.0)
    assert tune(policy(min_max_num_seqs=128), window, ENGINE, TunerState(), 300.0).recommendation == {}


@pytest.mark.parametrize("block, seq_len, sizes, expected", [
    (16, 900, (8, 16, 32), 32),      # long texts -> 32
    (16, 100, (8, 16, 32), 8),       # short chats -> 8
    (16, 350, (8, 16, 32), None),    # middle -> stays 16
    (16, 600, (8, 16, 32), None),    # 32 fits from 512, but the change needs 640 (hysteresis)
    (32, 450, (8, 16, 32), None),    # ... and back to 16 only below 410
    (32, 380, (8, 16, 32), 16),
    (8, 300, (8, 16, 32), None),     # 8 -> 16 needs 320
    (8, 330, (8, 16, 32), 16),
    (16, 100, (16, 32), None),       # 8 not allowed
    (64, 100, (8, 16, 32), 8),       # current size not allowed: straight to the pick
    (16, 5000, (8, 16, 32, 64, 128), 128),
])
def test_block_size_from_the_sequence_length_mix(block, seq_len, sizes, expected):
    window = scrapes(0, 300, seq_len=seq_len)
    d = tune(policy("Recommend", block_sizes=sizes), window, {"maxNumSeqs": 256, "blockSize": block},
             TunerState(), 300.0)
    assert d.recommendation == ({"blockSize": expected} if expected else {})
    if expected:
        assert f"mean sequence {seq_len:.0f} tokens" in d.reason and f"blockSize {block} -> {expected}" in d.reason


def test_block_size_needs_enough_finished_requests():
    window = scrapes(0, 300, seq_len=900, finished=0.5)     # 10 finished in the window
    assert tune(policy(), window, ENGINE, TunerState(), 300.0).recommendation == {}
    assert tune(policy(min_finished=5), window, ENGINE, TunerState(), 300.0).recommendation == {"blockSize": 32}


def test_both_fields_in_one_change():
    window = scrapes(0, 300, kv=0.3, waiting=10, running=512, msn=256, seq_len=900)
    d = tune(policy(), window, ENGINE, TunerState(), 300.0)
    assert d.recommendation == {"maxNumSeqs": 512, "blockSize": 32} and d.apply
    assert d.state.change_kind == "slots+blocks"
    assert d.state.last_change == {"maxNumSeqs": [256, 512], "blockSize": [16, 32]}


def test_not_enough_scrapes_or_engines_disagreeing_with_the_config():
    assert tune(policy(), slot_bound(240, 300), ENGINE, TunerState(), 300.0).recommendation   # 4 scrapes do
    d = tune(policy(), slot_bound(255, 300), ENGINE, TunerState(), 300.0)
    assert d.recommendation == {} and "not enough data: 3 of 4 scrapes" in d.reason
    d = tune(policy(), slot_bound(0, 300, msn=128), ENGINE, TunerState(), 300.0)
    assert d.recommendation == {} and "engines report maxNumSeqs [128], the config says 256" in d.reason


# ---------------------------------------------------------------- modes, cooldown, holds

def test_mode_off_recommends_nothing_even_under_thrash():
    window = scrapes(0, 300, kv=0.98, running=200, msn=256, preempt=5.0, seq_len=900)
    state = TunerState(last_change_time=1.0)
    d = tune(policy("Off"), window, ENGINE, state, 300.0)
    assert d.recommendation == {} and not d.apply and not d.revert and d.held is None and d.state is state


def test_recommend_mode_never_applies_nor_changes_state():
    d = tune(policy("Recommend"), slot_bound(0, 300), ENGINE, TunerState(), 300.0)
    assert d.recommendation and not d.apply and d.state == TunerState()


def test_auto_applies_once_then_holds_for_the_cooldown():
    p = policy(cooldown_s=1800)
    d = tune(p, slot_bound(0, 300), ENGINE, TunerState(), 300.0)
    assert d.apply and d.held is None and d.recommendation == {"maxNumSeqs": 512}
    assert d.state.last_change_time == 300.0 and d.state.baseline and not d.state.judged
    engine = {**ENGINE, "maxNumSeqs": 512}
    d = tune(p, [], engine, d.state, 400.0)           # the rollout is done: judging starts
    # Still slot bound at 512 after the change (the load grew): judged kept, then held by the cooldown.
    window = slot_bound(400, 1000, msn=512)
    d2 = tune(p, window, engine, d.state, 1000.0)
    assert d2.recommendation == {"maxNumSeqs": 1024} and not d2.apply
    assert d2.held == "cooldown until 1970-01-01T00:35:00Z (cooldownSeconds 1800 after the last change)"
    window = slot_bound(1800, 2200, msn=512)
    d3 = tune(p, window, engine, d2.state, 2200.0)
    assert d3.apply and d3.recommendation == {"maxNumSeqs": 1024}


@pytest.mark.parametrize("flags, held", [
    ({"rolling_out": True}, "a rollout is in progress"),
    ({"panicking": True}, "the autoscaler is panicking"),
])
def test_auto_never_applies_during_a_rollout_or_a_panic(flags, held):
    d = tune(policy(), slot_bound(0, 300), ENGINE, TunerState(), 300.0, **flags)
    assert d.recommendation and not d.apply and d.held == held and d.state == TunerState()


# ---------------------------------------------------------------- judging and reverting

def applied(p: TuningPolicy, t: float = 300.0) -> TunerState:
    d = tune(p, slot_bound(t - 300, t), ENGINE, TunerState(), t)
    assert d.apply
    return d.state


AFTER = {**ENGINE, "maxNumSeqs": 512}


def test_a_change_that_causes_thrash_at_equal_load_is_reverted_and_not_proposed_again():
    p = policy()
    state = applied(p)
    # Rollout, then the engines preempt at the same token rate.
    d = tune(p, [], AFTER, state, 400.0, rolling_out=True)
    assert d.recommendation == {} and "waits for its rollout" in d.reason
    d = tune(p, [], AFTER, d.state, 420.0)
    assert d.state.settled_time == 420.0
    worse = slot_bound(300, 420, msn=512) + scrapes(435, 540, kv=0.98, waiting=10, running=1024, msn=512,
                                                    preempt=4.0)
    d = tune(p, worse, AFTER, d.state, 540.0)
    assert d.revert and d.apply and d.recommendation == {"maxNumSeqs": 256}
    assert "revert maxNumSeqs 256 -> 512" in d.reason and "preemptions" in d.reason
    assert d.state.reverted and d.state.last_change == {"maxNumSeqs": [512, 256]}
    assert d.state.rejected == {"maxNumSeqs": 512} and d.state.rejected_until == 540.0 + 4 * 1800
    # Back at 256 and slot bound again after the cooldown: the raise stays rejected, no flip-flop.
    later = tune(p, slot_bound(2400, 2700), ENGINE, d.state, 2700.0)
    assert later.recommendation == {} and not later.apply
    much_later = tune(p, slot_bound(9000, 9300), ENGINE, d.state, 9300.0)
    assert much_later.recommendation == {"maxNumSeqs": 512} and much_later.apply


def test_more_waiting_at_equal_load_is_reverted():
    p = policy()
    state = tune(p, [], AFTER, applied(p), 400.0).state
    after = scrapes(415, 520, kv=0.5, waiting=40, running=1024, msn=512, finished=4)
    d = tune(p, after, AFTER, state, 520.0)
    assert d.revert and "waiting 5.0 -> 20.0 per engine" in d.reason


def test_a_change_that_helps_is_kept():
    p = policy()
    state = tune(p, [], AFTER, applied(p), 400.0).state
    better = scrapes(415, 520, kv=0.6, waiting=0, running=700, msn=512, finished=6)
    d = tune(p, better, AFTER, state, 520.0)
    assert not d.revert and d.state.judged and d.reason.startswith("kept maxNumSeqs 256 -> 512")


def test_worse_under_higher_load_is_not_comparable_until_the_cooldown_ends():
    p = policy(cooldown_s=600)
    state = tune(p, [], AFTER, applied(p), 400.0).state
    busier = scrapes(415, 520, kv=0.5, waiting=40, running=1024, msn=512, finished=8)   # 2x the tokens
    d = tune(p, busier, AFTER, state, 520.0)
    assert not d.revert and not d.state.judged and "not comparable yet" in d.reason
    d = tune(p, scrapes(700, 1000, kv=0.5, waiting=40, running=1024, msn=512, finished=8), AFTER, d.state, 1000.0)
    assert not d.revert and d.reason.startswith("kept maxNumSeqs 256 -> 512")
    # Kept, so the next proposal (still slot bound) is a new change.
    assert d.apply and d.state.last_change == {"maxNumSeqs": [512, 824]}


def test_thrash_fix_may_cost_some_queueing():
    p = policy()
    thrash = scrapes(0, 300, kv=0.98, waiting=3, running=200, msn=256, preempt=2.0, finished=4)
    d = tune(p, thrash, ENGINE, TunerState(), 300.0)
    assert d.apply and d.recommendation == {"maxNumSeqs": 72} and d.state.change_kind == "thrash"
    lowered = {**ENGINE, "maxNumSeqs": 72}
    state = tune(p, [], lowered, d.state, 400.0).state
    calm = scrapes(415, 520, kv=0.8, waiting=12, running=144, msn=72, finished=4)
    kept = tune(p, calm, lowered, state, 520.0)
    assert not kept.revert and kept.state.judged
    still = scrapes(415, 520, kv=0.98, waiting=12, running=144, msn=72, preempt=2.0, finished=4)
    assert tune(p, still, lowered, state, 520.0).revert      # thrash stayed: the waiting counts again


def test_revert_is_held_while_panicking_and_applied_after():
    p = policy()
    state = tune(p, [], AFTER, applied(p), 400.0).state
    worse = scrapes(415, 520, kv=0.98, waiting=10, running=1024, msn=512, preempt=4.0)
    d = tune(p, worse, AFTER, state, 520.0, panicking=True)
    assert d.revert and not d.apply and d.held == "the autoscaler is panicking" and not d.state.reverted
    d = tune(p, worse, AFTER, d.state, 535.0)
    assert d.revert and d.apply


def test_judging_waits_until_the_change_is_in_effect_and_for_enough_scrapes():
    p = policy()
    state = applied(p)
    d = tune(p, slot_bound(0, 315), ENGINE, state, 315.0)
    assert d.recommendation == {} and "not in effect yet" in d.reason and d.state == state
    d = tune(p, [], AFTER, state, 330.0)
    d = tune(p, scrapes(345, 380, msn=512), AFTER, d.state, 380.0)
    assert "3 of 4 scrapes since the rollout" in d.reason and not d.state.judged
    # Scrapes of engines still on the old config do not count as "after".
    d2 = tune(p, scrapes(345, 420, msn=256), AFTER, d.state, 420.0)
    assert "0 of 4 scrapes" in d2.reason


def test_a_change_that_never_takes_effect_stops_blocking_the_tuner():
    p = policy(cooldown_s=600)
    state = applied(p)                                   # applied at 300, but the config stays at 256
    d = tune(p, slot_bound(600, 900), ENGINE, state, 900.0)
    assert "not in effect yet" in d.reason and not d.state.judged
    d = tune(p, slot_bound(700, 1000), ENGINE, state, 1000.0)
    assert d.reason.startswith("the change maxNumSeqs 256 -> 512 never took effect")
    assert d.apply and d.recommendation == {"maxNumSeqs": 512}      # proposes (and applies) afresh


def test_a_config_changed_by_someone_else_ends_the_judgement():
    p = policy()
    d = tune(p, [], {**ENGINE, "maxNumSeqs": 300}, applied(p), 400.0)
    assert d.state.judged and "moved on" in d.reason


def test_max_num_seqs_does_not_flip_flop_between_rules():
    # After a raise to 512 the KV usage sits at 0.7: neither slot bound (memory near its limit)
    # nor thrashing, so the tuner leaves it alone for good.
    p = policy(cooldown_s=0)
    state = tune(p, [], AFTER, applied(p), 400.0).state
    for k in range(10):
        t = 700.0 + 300 * k
        d = tune(p, scrapes(t - 300, t, kv=0.7, waiting=2, running=1000, msn=512), AFTER, state, t)
        assert d.recommendation == {}, d.reason
        state = d.state


# ---------------------------------------------------------------- state, spec

def test_state_json_round_trip_and_tolerance():
    s = TunerState(last_change_time=10.0, last_change={"maxNumSeqs": [256, 512]}, baseline={"load": 1.5},
                   settled_time=20.0, change_kind="slots", rejected={"blockSize": 8}, rejected_until=99.0)
    assert TunerState.from_json(json.loads(json.dumps(s.to_json()))) == s
    assert TunerState.from_json(TunerState(reverted=True, judged=True).to_json()) == TunerState(reverted=True,
                                                                                                judged=True)
    assert TunerState.from_json(None) == TunerState()
    assert TunerState.from_json({"lastChange": {"maxNumSeqs": [0, 5]}, "baseline": {"load": "x"},
                                 "lastChangeTime": "yesterday", "rejected": {"dtype": 3},
                                 "judged": "yes"}) == TunerState()


def test_policy_from_spec():
    p = TuningPolicy.from_spec(DEFAULTS["tuning"], DEFAULTS["engine"])
    assert (p.mode, p.min_max_num_seqs, p.max_max_num_seqs, p.block_sizes, p.cooldown_s) == \
        ("Off", 64, 1024, (8, 16, 32), 1800)
    # CPU engines keep their 128-token blocks unless the spec lists candidates
    assert TuningPolicy.from_spec(DEFAULTS["tuning"], DEFAULTS["engine"], "cpu").block_sizes == (128,)
    assert TuningPolicy.from_spec({"blockSizes": [16, 64]}, DEFAULTS["engine"], "cpu").block_sizes == (16, 64)
    p = TuningPolicy.from_spec({"mode": "Auto", "maxNumSeqs": {"min": 16, "max": 512}, "blockSizes": [32, 16],
                                "cooldownSeconds": 60}, {"maxNumSeqs": 4})
    assert (p.mode, p.min_max_num_seqs, p.max_max_num_seqs, p.block_sizes, p.cooldown_s) == \
        ("Auto", 16, 512, (16, 32), 60)
    assert TuningPolicy.from_spec({"mode": "Auto"}, {"maxNumSeqs": 2}).min_max_num_seqs == 1


@pytest.mark.parametrize("tuning, engine, message", [
    ({"mode": "Sometimes"}, ENGINE, "mode must be one of"),
    ({"mode": False}, ENGINE, "mode must be one of"),
    ({"maxNumSeqs": {"min": 64, "max": 16}}, ENGINE, "must not exceed"),
    ({"maxNumSeqs": 64}, ENGINE, "needs integer min and max"),
    ({"blockSizes": []}, ENGINE, "block_sizes"),
    ({"blockSizes": [12]}, ENGINE, "block_sizes"),
    ({"cooldownSeconds": -1}, ENGINE, "cooldown_s"),
    ({}, {"maxNumSeqs": 0}, "maxNumSeqs"),
])
def test_bad_specs_are_rejected(tuning, engine, message):
    with pytest.raises(ValueError, match=message):
        TuningPolicy.from_spec(tuning, engine)


def test_bad_engine_config_is_rejected():
    with pytest.raises(ValueError, match="engine.blockSize"):
        tune(policy(), [], {"maxNumSeqs": 256}, TunerState(), 0.0)


# ---------------------------------------------------------------- invariants on arbitrary inputs

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

observations = st.builds(
    lambda t, engines, kv, waiting, fill, msn, pre, fin, length: Observation(
        t, engines, kv, waiting, min(int(fill * engines * msn), engines * msn), msn, 16, pre, 0.0, fin,
        fin * length / 3, fin * length * 2 / 3),
    st.floats(0, 300), st.integers(1, 4), st.floats(0, 1), st.integers(0, 60), st.floats(0, 1),
    st.sampled_from([0, 256]), st.sampled_from([0.0, 1.0, 5.0]), st.sampled_from([0.0, 2.0, 10.0]),
    st.sampled_from([50.0, 300.0, 900.0]))
tuner_states = st.one_of(
    st.just(TunerState()),
    st.builds(lambda t, new, kind: TunerState(last_change_time=t, last_change={"maxNumSeqs": [128, new]},
                                              baseline={"load": 40.0, "thrash": 0.0, "waiting": 2.0,
                                                        "kvCacheUsage": 0.5, "engines": 2.0},
                                              change_kind=kind),
              st.floats(0, 300), st.sampled_from([256, 512]), st.sampled_from(["slots", "thrash"])))


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["Off", "Recommend", "Auto"]), st.lists(observations, max_size=24), tuner_states,
       st.floats(0, 4000), st.booleans(), st.booleans())
def test_tuning_invariants(mode, window, state, now, rolling_out, panicking):
    p = policy(mode, min_max_num_seqs=32, max_max_num_seqs=1024)
    d = tune(p, window, ENGINE, state, now, rolling_out=rolling_out, panicking=panicking)
    assert d == tune(p, window, ENGINE, state, now, rolling_out=rolling_out, panicking=panicking)
    assert TunerState.from_json(json.loads(json.dumps(d.state.to_json()))) == d.state
    if mode == "Off":
        assert d.recommendation == {} and not d.apply and d.state is state
    if d.apply:
        assert mode == "Auto" and not rolling_out and not panicking and d.recommendation and d.held is None
        assert d.state.last_change_time == now
        assert {k: v[1] for k, v in d.state.last_change.items()} == d.recommendation
    if d.recommendation and not d.apply:
        assert d.held
    if not d.revert:
        msn = d.recommendation.get("maxNumSeqs")
        assert msn is None or 32 <= msn <= 1024
        assert d.recommendation.get("blockSize", 16) in p.block_sizes
    if mode != "Auto":     # nothing is applied, so no change is ever recorded
        assert (d.state.last_change, d.state.last_change_time) == (state.last_change, state.last_change_time)
