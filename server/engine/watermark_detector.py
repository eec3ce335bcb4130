"""Scoring text for the gumbel watermark: given the key, how unlikely are these tokens without it?

Each token's context (the ``context_width`` tokens before it, -1-padded, as generation used) gives its
``u`` (watermark.py); its score is ``-log(1 - u)``, Exp(1)-distributed for text the key did not choose and
larger for text it did (the chosen token is the one whose ``u`` beat ``p``). The sum over n tokens is then
Gamma(n, 1) under "not watermarked", which gives an exact p-value. A token whose context already occurred
is not scored (deduplicated): generation drew it without the watermark, or its noise would repeat
evidence already counted.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from .watermark import PAD, context_seed, token_uniform

DEFAULT_P_VALUE_THRESHOLD = 0.01


@dataclass(frozen=True)
class WatermarkDetection:
    score: float            # sum of the scored tokens' -log(1 - u); about num_scored_tokens without watermark
    p_value: float          # P(score this high | not watermarked)
    num_scored_tokens: int
    is_watermarked: bool    # p_value <= the threshold


def detect_watermark(token_ids: Sequence[int], key: int, context_width: int = 4,
                     p_value_threshold: float = DEFAULT_P_VALUE_THRESHOLD,
                     deduplicate_contexts: bool = True) -> WatermarkDetection:
    """Score generated ``token_ids`` (the answer alone, no prompt) for the watermark of ``key``."""
    if isinstance(key, bool) or not isinstance(key, int) or not 0 <= key <= 2**64 - 1:
        raise ValueError("key must be an integer from 0 to 2**64-1")
    if isinstance(context_width, bool) or not isinstance(context_width, int) or context_width < 1:
        raise ValueError(f"context_width must be a positive integer, got {context_width!r}")
    if not 0 < p_value_threshold < 1:
        raise ValueError(f"p_value_threshold must be in (0, 1), got {p_value_threshold!r}")
    prefix = [PAD] * context_width
    seen: set[tuple[int, ...]] = set()
    score, scored = 0.0, 0
    for token in token_ids:
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(f"token ids must be non-negative integers, got {token!r}")
        context = tuple(prefix[-context_width:])
        prefix.append(token)
        if deduplicate_contexts:
            if context in seen:
                continue
            seen.add(context)
        score += -math.log1p(-token_uniform(context_seed(key, context), token))
        scored += 1
    p_value = gamma_survival(score, scored)
    return WatermarkDetection(score, p_value, scored, scored > 0 and p_value <= p_value_threshold)


def gamma_survival(score: float, shape: int) -> float:
    """P(Gamma(shape, 1) >= score) for an integer shape: e^-s sum_{k<shape} s^k / k!, summed in log space
    so thousands of tokens neither overflow nor underflow before the end."""
    if shape <= 0 or score <= 0:
        return 1.0
    log_s = math.log(score)
    terms = [k * log_s - math.lgamma(k + 1) for k in range(shape)]
    top = max(terms)
    log_sum = top + math.log(sum(math.exp(t - top) for t in terms))
    return min(1.0, math.exp(min(0.0, log_sum - score)))
