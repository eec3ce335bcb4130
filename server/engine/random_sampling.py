"""Random draws for a block of rows at once: temperature, top-k, min-p, top-p, then one draw per row.

Row by row, a 64-row decode step spent about as long sampling as computing: top-p sorted the whole
49k-token vocabulary of every row, and the draw (an exponential race) made one random number per token.
Here each filter is one batched op over ``[rows, vocab]``:

- top-p looks for the nucleus among each row's 256 most likely tokens (a partial top-k, not a sort),
  then among its 4,096 for the rows whose nucleus is wider (``NUCLEUS_CANDIDATES``). When the
  candidates' mass reaches ``top_p`` the nucleus is inside them: the kept tokens are the full sort's,
  and the row is drawn from those candidates alone. Only rows flatter than that sort the vocabulary.
- the draw is an inverse-CDF lookup over the kept tokens in token-id order, with one uniform number per
  row from that row's own generator, so a seeded sample's tokens do not depend on what else shares its
  batch.

On CPU the C++ op ``kernels/cpu_sampling.cpp`` does all of this in a few passes over each row (no
softmax, top-k or sort of the block; 90 of a 357 ms step at 256 top-p rows spent here before it). It
keeps the same tokens and draws the same token for the same uniform number, so the torch code below is
both its fallback and the reference it is tested against.

The semantics are vLLM's: temperature first, top-k on the scaled logits, then min-p and top-p on the
probabilities (top-p keeps the smallest prefix of the sorted distribution whose mass reaches ``top_p``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from pagedmodel.kernels import cpu_ops

from .sampling_params import SamplingParams

# candidate set widths tried in turn: a partial top-k of 4,096 still costs a fraction of a full sort
NUCLEUS_CANDIDATES = (256, 4096)


@dataclass
class Candidates:
    """Some rows' truncated distributions: ``probs[j]`` (unnormalised, dropped tokens 0) over the token ids
    ``ids[j]``, or over the whole vocabulary in order when ``ids`` is None."""

    rows: list[int]                 # which rows of the block
    probs: torch.Tensor             # [len(rows), width]
    ids: torch.Tensor | None        # [len(rows), width] int64, or None


OP_LOGITS_DTYPES = (torch.float32, torch.bfloat16)   # the logits dtypes the CPU op reads


def draw(logits: torch.Tensor, params: Sequence[SamplingParams],
         generators: Sequence[torch.Generator | None]) -> list[int]:
    """One token per row of ``logits`` ``[R, vocab]`` (not modified) under each row's params: float32, or
    bfloat16 where the CPU op draws (it widens a row at a time)."""
    op = cpu_ops.sampling() if logits.device.type == "cpu" and logits.dtype in OP_LOGITS_DTYPES else None
    if op is not None:
        return op(logits, *row_params(params, logits.shape[-1]), uniforms(generators, logits.device)).tolist()
    logits = logits.float()   # the torch path truncates in float32 (a no-op for float32 logits)
    tokens = [0] * len(params)
    for group in truncate(logits, params):
        probs, ids = group.probs, group.ids
        if ids is not None:             # the candidates back in token-id order, where the draw counts
            ids, order = ids.sort(dim=-1)
            probs = probs.gather(1, order)
        picked = inverse_cdf(probs, [generators[i] for i in group.rows])
        if ids is not None:
            picked = ids.gather(1, torch.tensor(picked, device=ids.device)[:, None])[:, 0].tolist()
        for i, token in zip(group.rows, picked):
            tokens[i] = token
    return tokens


def row_params(params: Sequence[SamplingParams], vocab: int) -> tuple[torch.Tensor, ...]:
    """The C++ op's per-row vectors: temperature, top-k (0: off), top-p, min-p."""
    return (torch.tensor([p.temperature for p in params], dtype=torch.float32),
            torch.tensor([p.top_k if 0 < p.top_k < vocab else 0 for p in params], dtype=torch.long),
            torch.tensor([p.top_p for p in params], dtype=torch.float32),
            torch.tensor([p.min_p for p in params], dtype=torch.float32))


def uniforms(generators: Sequence[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """One uniform number in [0, 1) per row, from the row's own generator (the global one if None)."""
    return torch.stack([torch.rand((), generator=g, device=device) if g is not None else torch.rand((), device=device)
                        for g in generators])


def truncate(logits: torch.Tensor, params: Sequence[SamplingParams]) -> list[Candidates]:
    """The rows' distributions after temperature, top-k, min-p and top-p: a row with top-p keeps only the
    candidates of the first ``NUCLEUS_CANDIDATES`` width that holds its nucleus (else the sorted vocabulary);
    the others keep the vocabulary in order."""
    device, dtype = logits.device, logits.dtype
    vocab = logits.shape[-1]
    temperature = torch.tensor([p.temperature for p in params], dtype=dtype, device=device)[:, None]
    x = logits / temperature
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(top_k):
        x = _top_k(x, top_k)
    probs = torch.softmax(x, dim=-1)
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=dtype, device=device)[:, None]
        x = x.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
        probs = torch.softmax(x, dim=-1)
    nucleus = [i for i, p in enumerate(params) if p.top_p < 1.0]
    whole = [i for i, p in enumerate(params) if p.top_p >= 1.0]
    groups = [Candidates(whole, probs[whole], None)] if whole else []
    top_p = {i: params[i].top_p for i in nucleus}
    for width in NUCLEUS_CANDIDATES:    # the smallest candidate set that holds each row's nucleus
        if not nucleus:
            break
        mass = torch.tensor([top_p[i] for i in nucleus], dtype=dtype, device=device)
        values, order = torch.topk(probs[nucleus], min(width, vocab), dim=-1)   # most likely first
        inside = (values.sum(dim=-1) >= mass).tolist()
        near = [j for j, ok in enumerate(inside) if ok]
        if near:
            kept = values[near] * _prefix_keep(values[near], mass[near])
            groups.append(Candidates([nucleus[j] for j in near], kept, order[near]))
        nucleus = [i for i, ok in zip(nucleus, inside) if not ok]
    if nucleus:                         # flatter than the widest candidate set: sort the whole vocabulary
        mass = torch.tensor([top_p[i] for i in nucleus], dtype=dtype, device=device)
        values, order = torch.sort(probs[nucleus], dim=-1, descending=True)
        groups.append(Candidates(nucleus, values * _prefix_keep(values, mass), order))
    return groups


def _top_k(x: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    """Each row's logits below its k-th largest set to -inf (k = 0: the row is left alone)."""
    k = torch.tensor(top_k, dtype=torch.long, device=x.device)
    values = torch.topk(x, max(top_k), dim=-1).values
    kth = values.gather(1, (k - 1).clamp(min=0)[:, None])
    kth = kth.masked_fill((k == 0)[:, None], float("-inf"))
    return x.masked_fill(x < kth, float("-inf"))


def _prefix_keep(sorted_probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """For probabilities sorted descending: keep a token while the mass before it is below ``top_p``
    (so the first token always stays)."""
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    keep = before < top_p[:, None]
    keep[:, 0] = True
    return keep


def inverse_cdf(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> list[int]:
    """One index per row drawn in proportion to ``probs`` (rows need not sum to 1; zeros are never drawn):
    the first index whose cumulative mass reaches ``u x total`` with ``u`` uniform in (0, 1]."""
    u = uniforms(generators, probs.device).to(probs.dtype)
    cdf = torch.cumsum(probs, dim=-1)
    target = (1.0 - u) * cdf[:, -1]                     # 1 - u is in (0, 1]: a zero-mass head is never hit
    picked = torch.searchsorted(cdf, target[:, None]).clamp_(max=probs.shape[-1] - 1)
    return picked[:, 0].tolist()
