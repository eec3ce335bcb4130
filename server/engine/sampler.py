"""Turns a batch of next-token logits into tokens: penalties, temperature, top-k/top-p/min-p, seeded draws.

Each sequence draws from its own torch.Generator, so a seeded request produces the same tokens whatever
else shares its batch. Logprobs are those of the raw model distribution (before temperature and
truncation), as vLLM reports them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling_params import SamplingParams


@dataclass
class SamplingRow:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None
    banned_token_ids: tuple[int, ...] = ()   # e.g. EOS before min_tokens is reached


@dataclass
class SampleResult:
    token_id: int
    logprob: float
    top_logprobs: dict[int, float] | None   # chosen token + the top-k, when logprobs were asked for


def _apply_penalties(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    p = row.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(row.prompt_token_ids) | set(row.output_token_ids)),
                            dtype=torch.long, device=logits.device)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and row.output_token_ids:
        out = torch.tensor(row.output_token_ids, dtype=torch.long, device=logits.device)
        counts = torch.zeros_like(logits).scatter_add_(0, out, torch.ones_like(out, dtype=logits.dtype))
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    if row.banned_token_ids:
        logits[list(row.banned_token_ids)] = float("-inf")
    return logits


def _truncate(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.min_p > 0:
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
        probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop = before >= p.top_p          # keep the smallest prefix whose mass reaches top_p
        drop[0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def _needs_processing(row: SamplingRow) -> bool:
    p = row.params
    return bool(p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty or row.banned_token_ids)


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampleResult]:
    """``logits`` is ``[len(rows), vocab]`` float32. Plain greedy rows (no penalties, no banned
    tokens) share one argmax, and every row's chosen logprob is one gather: per-row work is left
    to the rows that need it (penalties, seeded draws, top logprobs)."""
    logprobs = torch.log_softmax(logits, dim=-1)
    tokens: list[int] = [0] * len(rows)
    plain = [i for i, row in enumerate(rows)
             if (row.params.greedy or row.params.use_beam_search) and not _needs_processing(row)]
    if plain:
        picked = logits[plain].argmax(dim=-1) if len(plain) < len(rows) else logits.argmax(dim=-1)
        for i, token in zip(plain, picked.tolist()):
            tokens[i] = token
    plain_set = set(plain)
    for i, row in enumerate(rows):
        if i in plain_set:
            continue
        p = row.params
        x = _apply_penalties(logits[i].clone(), row) if _needs_processing(row) else logits[i]
        if p.greedy or p.use_beam_search:
            tokens[i] = int(torch.argmax(x))
        else:
            x = _truncate(x / p.temperature, p)
            probs = torch.softmax(x, dim=-1)
            # exponential race: argmax(p / E), E ~ Exp(1), draws token i with probability p_i
            noise = torch.empty_like(probs).exponential_(generator=row.generator)
            tokens[i] = int(torch.argmax(probs / noise))
    index = torch.tensor(tokens, dtype=torch.long, device=logits.device)
    chosen = logprobs.gather(1, index[:, None])[:, 0].tolist() if rows else []
    results = []
    for i, row in enumerate(rows):
        token, top = tokens[i], None
        if row.params.logprobs is not None:
            top = {token: chosen[i]}
            if row.params.logprobs > 0:
                vals, ids = torch.topk(logprobs[i], row.params.logprobs)
                top.update({int(t): float(v) for t, v in zip(ids, vals)})
        results.append(SampleResult(token, chosen[i], top))
    return results
