"""The multi-tenant chat workload of benchmarks/prefix_routing.py: pure and seeded, so every routing
strategy replays exactly the same requests at exactly the same moments.

Each tenant has one long system prompt (its own instructions, 1-2k tokens); every request is that
prompt plus a short user turn. Tenant popularity is Zipf-like (weight 1 / rank^skew over a seeded
shuffle of the tenants): a few tenants carry most of the traffic and a long tail is rare, as in a
shared serving cluster, rather than the flat mix that would make every tenant equally cacheable.
Arrivals are Poisson at a fixed mean rate.
"""
from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

WORDS = ("harbor ledger invoice tenant policy clause shipment audit quarterly region warehouse forecast "
         "customer refund escalation priority contract renewal discount compliance review vendor summary "
         "incident outage latency rollback deploy cluster replica schema migration index partition").split()


@dataclass(frozen=True)
class Request:
    at: float          # seconds after the start of its phase
    tenant: int        # index into the system prompts
    user: str          # the user turn


def system_prompts(count_tokens: Callable[[str], int], n: int, min_tokens: int, max_tokens: int,
                   rng: random.Random) -> list[str]:
    """n distinct system prompts, each between min_tokens and max_tokens long by `count_tokens`."""
    if n < 1 or not 0 < min_tokens <= max_tokens:
        raise ValueError("need n >= 1 and 0 < min_tokens <= max_tokens")
    out = []
    for tenant in range(n):
        target = rng.randint(min_tokens, max_tokens)
        words = f"You are the assistant of tenant {tenant}. Follow these operating rules.".split()
        while (deficit := target - count_tokens(" ".join(words))) > 0:
            # every word is at least one token: adding a third of the deficit converges without overshooting much
            words.extend(rng.choice(WORDS) for _ in range(max(1, deficit // 3)))
        out.append(" ".join(words))
    return out


def tenant_weights(n: int, skew: float, rng: random.Random) -> list[float]:
    """Traffic share per tenant: 1 / rank^skew (skew 0: uniform), ranks shuffled, normalised to 1."""
    if n < 1 or skew < 0:
        raise ValueError("need n >= 1 and skew >= 0")
    ranks = list(range(1, n + 1))
    rng.shuffle(ranks)
    raw = [1.0 / r ** skew for r in ranks]
    total = sum(raw)
    return [w / total for w in raw]


def requests(n: int, rate: float, weights: list[float], rng: random.Random) -> list[Request]:
    """n requests: Poisson arrivals at `rate` per second, tenants drawn by `weights`."""
    if n < 0 or rate <= 0:
        raise ValueError("need n >= 0 and rate > 0")
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        tenant = rng.choices(range(len(weights)), weights)[0]
        user = f"Question {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 20))) + "?"
        out.append(Request(t, tenant, user))
    return out
