"""The row-by-row sampling reference (the sampler's old code) that the batched torch path
(tests/engine/test_batched_sampling.py) and the CPU op (tests/kernels/test_cpu_sampling.py) are held to."""
from __future__ import annotations

import random

import torch

from pagedmodel.server.engine.sampling_params import SamplingParams


def reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row's normalised probabilities after temperature, top-k, min-p and top-p (by a full sort);
    0 for the dropped tokens."""
    logits = logits / p.temperature
    if 0 < p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.min_p > 0:
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
        probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        drop = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= p.top_p
        drop[0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return torch.softmax(logits, dim=-1)


def random_params(rng: random.Random) -> SamplingParams:
    """A random draw's parameters, every filter and penalty sometimes on."""
    return SamplingParams(temperature=rng.choice([0.3, 0.7, 1.0, 1.5, 8.0]), top_p=rng.choice([1.0, 0.95, 0.8, 0.3]),
                          top_k=rng.choice([-1, 0, 1, 5, 50, 400]), min_p=rng.choice([0.0, 0.0, 0.05, 0.2]),
                          repetition_penalty=rng.choice([1.0, 1.0, 1.3, 0.8]),
                          presence_penalty=rng.choice([0.0, 0.5, -0.4]), frequency_penalty=rng.choice([0.0, 0.2]))
