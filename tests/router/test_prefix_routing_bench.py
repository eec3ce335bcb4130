"""benchmarks/prefix_routing.py: its workload is the same for every strategy (seeded), shaped as it
says (prompt lengths, Zipf skew, Poisson rate), and its --quick mode runs end to end through real
engines and the real router, with the hit rate read from the engines' counters."""
from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import prefix_routing  # noqa: E402
from prefix_workload import requests, system_prompts, tenant_weights  # noqa: E402


def words(text: str) -> int:
    return len(text.split())


def schedule(seed: int) -> tuple[list[str], list[float], list]:
    rng = random.Random(seed)
    prompts = system_prompts(words, 16, 100, 200, rng)
    weights = tenant_weights(16, 1.0, rng)
    return prompts, weights, requests(400, 2.0, weights, rng)


def test_same_seed_same_workload_other_seed_another() -> None:
    assert schedule(7) == schedule(7)
    assert schedule(7)[2] != schedule(8)[2]


def test_prompts_are_distinct_and_within_their_token_range() -> None:
    prompts, _, _ = schedule(0)
    assert len(set(prompts)) == 16
    # words() counts one token per word, so a chunk never overshoots the target
    assert all(100 <= words(p) <= 200 for p in prompts)
    # the tenants differ from their first words on, so a 256-character hash key separates them too
    assert len({p[:64] for p in prompts}) == 16


def test_tenant_traffic_is_zipf_skewed_and_arrivals_poisson() -> None:
    _, weights, load = schedule(0)
    ranked = sorted(weights, reverse=True)
    assert sum(weights) == pytest.approx(1.0)
    assert ranked[0] / ranked[-1] == pytest.approx(16.0)    # 1/1 against 1/16 at skew 1
    hottest = weights.index(ranked[0])
    share = sum(r.tenant == hottest for r in load) / len(load)
    assert abs(share - ranked[0]) < 0.08
    assert [r.at for r in load] == sorted(r.at for r in load)
    assert load[-1].at / len(load) == pytest.approx(0.5, rel=0.2)   # mean gap 1 / rate


def test_zero_skew_is_uniform() -> None:
    assert tenant_weights(4, 0.0, random.Random(0)) == [0.25] * 4


@pytest.mark.parametrize("bad", [dict(n=0, skew=1.0), dict(n=4, skew=-1.0)])
def test_bad_weights_arguments_are_refused(bad: dict) -> None:
    with pytest.raises(ValueError):
        tenant_weights(rng=random.Random(0), **bad)


def test_the_cli_refuses_an_unknown_strategy(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        prefix_routing.parse_args(["--strategies", "prefix,nope"])
    assert exc.value.code != 0
    assert "nope" in capsys.readouterr().err


def test_repeated_runs_pool_into_one_sample() -> None:
    runs = [{"ttfts": [1.0, 2.0, 9.0], "hit_tokens": 30, "query_tokens": 100},
            {"ttfts": [3.0, 4.0, 5.0], "hit_tokens": 70, "query_tokens": 100}]
    p = prefix_routing.pooled(runs)
    assert p["hit_rate"] == 0.5 and p["requests"] == 6 and p["runs"] == 2
    assert p["ttft_p50"] == 3.5 and p["ttft_p99"] == 9.0 and p["ttft_mean"] == 4.0


@pytest.mark.slow   # 2 engines + a router start: ~4 min at load 13 on 2 cores (each process imports torch)
def test_quick_run_measures_hits_and_ttft_through_the_router(smollm2_dir: Path) -> None:
    out = prefix_routing.run(prefix_routing.parse_args(["--quick"]))
    r = out["results"]["prefix-cache"]
    assert r["requests"] == prefix_routing.QUICK["requests"]
    # 4 tenants already seen in the warm-up, cache big enough for 40 % of them per engine: repeats hit
    assert r["query_tokens"] > 0 and 0.0 < r["hit_rate"] <= 1.0
    assert 0.0 < r["ttft_p50"] <= r["ttft_p99"]
