"""Repetition, presence and frequency penalties and banned tokens, for a block of rows at once.

The rows' token ids are flattened once into (row, token) index pairs, so the whole block costs a few
scatters however many rows ask for penalties; the semantics are vLLM's: the repetition penalty covers
prompt and output tokens (positive logits divided, negative multiplied), presence and frequency
penalties count output tokens only, and banned tokens (EOS before ``min_tokens``) get ``-inf``.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import torch

from .sampling_params import SamplingParams


class PenaltyRow(Protocol):
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    banned_token_ids: tuple[int, ...]


def needs_penalties(row: PenaltyRow) -> bool:
    p = row.params
    return bool(p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty or row.banned_token_ids)


def _pairs(token_lists: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) for every token of every row, as two flat int64 tensors."""
    rows = [r for r, tokens in enumerate(token_lists) for _ in range(len(tokens))]
    tokens = [t for tokens in token_lists for t in tokens]
    return (torch.tensor(rows, dtype=torch.long, device=device), torch.tensor(tokens, dtype=torch.long, device=device))


def apply_penalties(logits: torch.Tensor, rows: Sequence[PenaltyRow]) -> torch.Tensor:
    """``logits`` ``[len(rows), vocab]`` with every row's penalties applied, in place; returned for chaining.
    Only the penalised (row, token) entries are read and written: the cost follows the rows' token
    counts, not rows x vocabulary."""
    device, dtype = logits.device, logits.dtype
    repeating = [row.prompt_token_ids + row.output_token_ids if row.params.repetition_penalty != 1.0 else []
                 for row in rows]
    if any(repeating):
        rep = torch.tensor([row.params.repetition_penalty for row in rows], dtype=dtype, device=device)
        r, t = _pairs(repeating, device)
        vals, factor = logits[r, t], rep[r]
        # a token seen twice is written twice with the same value: both come from the unpenalised logit
        logits[r, t] = torch.where(vals > 0, vals / factor, vals * factor)
    counted = [row.output_token_ids if row.params.presence_penalty or row.params.frequency_penalty else []
               for row in rows]
    if any(counted):
        r, t = _pairs(counted, device)
        keys, counts = torch.unique(r * logits.shape[-1] + t, return_counts=True)
        r, t = keys // logits.shape[-1], keys % logits.shape[-1]
        freq = torch.tensor([row.params.frequency_penalty for row in rows], dtype=dtype, device=device)
        pres = torch.tensor([row.params.presence_penalty for row in rows], dtype=dtype, device=device)
        logits[r, t] -= freq[r] * counts.to(dtype) + pres[r]
    if any(row.banned_token_ids for row in rows):
        r, t = _pairs([row.banned_token_ids for row in rows], device)
        logits[r, t] = float("-inf")
    return logits
