"""The soak's request mix and outcome rules (benchmarks/soak_traffic.py), without a server."""
from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import soak_traffic as t  # noqa: E402


def _mix(seed: int, n: int = 2000) -> list[t.Planned]:
    return [t.plan(i, seed, "m", 512, 260) for i in range(n)]


def test_the_mix_is_fixed_by_its_seed_and_covers_every_kind():
    """Guards: the same seed replays the same requests; the shares are about what the soak claims."""
    a, b = _mix(7), _mix(7)
    assert a == b and a != _mix(8)
    kinds = Counter(p.kind.split(":")[0] for p in a)
    assert set(t.KIND_WEIGHTS) <= set(kinds) and kinds["hostile"] > 0
    assert 0.05 < sum(p.aborts for p in a) / len(a) < 0.15
    assert 0.005 < kinds["hostile"] / len(a) < 0.04
    assert any(p.stream for p in a) and any(not p.stream for p in a)
    beam = next(p for p in a if p.kind == "beam")
    assert json.loads(beam.body)["use_beam_search"] is True and beam.n == 2


def test_hostile_requests_are_rejected_4xx_only_with_an_openai_error_body():
    """Guards: a hostile request answered 2xx or 5xx, or with a non-OpenAI body, counts as 'other'."""
    p = next(p for p in _mix(1) if p.hostile)
    err = {"error": {"message": "bad", "type": "invalid_request_error", "param": None, "code": None}}
    assert t.classify_json(p, 400, err)[0] == "rejected_4xx"
    assert t.classify_json(p, 400, {"detail": "x"})[0] == "other"
    assert t.classify_json(p, 500, err)[0] == "other"
    assert t.classify_json(p, 200, {"choices": []})[0] == "other"


def test_valid_requests_need_a_well_formed_answer():
    """Guards: 5xx, a wrong number of choices, error events and streams without [DONE] are 'other'."""
    p = next(p for p in _mix(2) if p.kind == "n_samples" and not p.stream)
    ok = {"choices": [{"index": i, "finish_reason": "length"} for i in range(p.n)], "usage": {"completion_tokens": 9}}
    assert t.classify_json(p, 200, ok) == ("completed", 9, "")
    assert t.classify_json(p, 200, {**ok, "choices": ok["choices"][:1]})[0] == "other"
    assert t.classify_json(p, 503, {})[0] == "503" and t.classify_json(p, 502, {})[0] == "other"
    s = next(p for p in _mix(2) if p.kind == "chat_stream")
    events = [json.dumps({"choices": [{"index": 0}]}), json.dumps({"choices": [], "usage": {"completion_tokens": 3}})]
    assert t.classify_stream(s, events, done=True) == ("completed", 3, "")
    assert t.classify_stream(s, events, done=False)[0] == "other"
    assert t.classify_stream(s, [*events, json.dumps({"error": {"message": "x"}})], done=True)[0] == "other"


def test_percentile_and_tally():
    assert t.percentile([], 50) != t.percentile([], 50)   # nan
    assert t.percentile([3.0, 1.0, 2.0], 50) == 2.0 and t.percentile(list(map(float, range(100))), 99) == 98.0
    p = t.plan(0, 0, "m", 512, 260)
    tally = t.Tally([t.Result(p, "completed", 200, 1.0, 5), t.Result(p, "other", 500, 2.0)])
    assert tally.counts()["other"] == 1 and tally.completion_tokens() == 5 and len(tally.others()) == 1
