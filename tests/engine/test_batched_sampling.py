"""The batched penalties, truncation and draw against a row-by-row reference (the sampler's old code).

The reference applies each row's penalties and filters on its own, with a full sort for top-p; the
batched path must keep exactly the same tokens and give them the same probabilities, on mixed blocks
where every row has different parameters, including the rows where top-p's candidate shortcut does not
hold (flat distributions) and must fall back to the full sort.
"""
from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from pagedmodel.server.engine import random_sampling
from pagedmodel.server.engine.penalties import apply_penalties
from pagedmodel.server.engine.random_sampling import inverse_cdf, truncate
from pagedmodel.server.engine.sampler import SamplingRow, sample
from pagedmodel.server.engine.sampling_params import SamplingParams
from sampling_reference import random_params, reference_probs

VOCAB = 2000


@pytest.fixture(autouse=True)
def _seeded_torch():
    torch.manual_seed(0)    # the random logits are the same on every run


def reference_penalties(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    p = row.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(row.prompt_token_ids) | set(row.output_token_ids)), dtype=torch.long)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and row.output_token_ids:
        out = torch.tensor(row.output_token_ids, dtype=torch.long)
        counts = torch.zeros_like(logits).scatter_add_(0, out, torch.ones_like(out, dtype=logits.dtype))
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    if row.banned_token_ids:
        logits[list(row.banned_token_ids)] = float("-inf")
    return logits


def truncated_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """``truncate``'s groups laid back out as one dense ``[rows, vocab]`` block of (unnormalised) probabilities."""
    dense = torch.zeros_like(logits)
    for group in truncate(logits, params):
        rows = torch.tensor(group.rows, dtype=torch.long)
        dense[rows] = group.probs if group.ids is None else dense[rows].scatter(1, group.ids, group.probs)
    return dense


def random_rows(rng: random.Random, n: int) -> list[SamplingRow]:
    rows = []
    for i in range(n):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 40))]
        output = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 30))]
        banned = tuple(rng.sample(range(VOCAB), rng.choice([0, 0, 2])))
        rows.append(SamplingRow(random_params(rng), prompt, output, torch.Generator().manual_seed(i), banned))
    return rows


def test_penalties_match_the_row_by_row_reference():
    rng = random.Random(1)
    rows = random_rows(rng, 48)
    logits = torch.randn(len(rows), VOCAB) * 3
    got = apply_penalties(logits.clone(), rows)
    for i, row in enumerate(rows):
        want = reference_penalties(logits[i].clone(), row)
        torch.testing.assert_close(got[i], want, rtol=0, atol=1e-6)
    assert not torch.equal(got, logits)     # the rows' penalties did change something


@pytest.mark.parametrize("seed", range(4))
def test_truncation_keeps_the_reference_tokens_with_the_reference_probabilities(seed: int):
    rng = random.Random(seed)
    rows = random_rows(rng, 40)
    # some rows peaked (the nucleus is among the candidates), some flat (scale 0.01: the fallback sort)
    scale = torch.tensor([rng.choice([0.01, 1.0, 4.0]) for _ in rows])[:, None]
    logits = torch.randn(len(rows), VOCAB) * scale
    got = truncated_probs(logits, [row.params for row in rows])
    for i, row in enumerate(rows):
        want = reference_probs(logits[i], row.params)
        assert torch.equal(got[i] > 0, want > 0), (i, row.params)
        torch.testing.assert_close(got[i] / got[i].sum(), want, rtol=1e-4, atol=1e-7)


def test_top_p_widens_its_candidates_then_sorts_when_they_hold_too_little(monkeypatch):
    monkeypatch.setattr(random_sampling, "NUCLEUS_CANDIDATES", (8, 64))
    logits = torch.zeros(3, VOCAB)                      # row 0 uniform: 64 candidates hold 64 / 2000 of the mass
    logits[1, :4] = torch.tensor([20.0, 19.9, 19.8, 19.7])      # peaked: a nucleus inside the first 8
    logits[2, :30] = 20.0 - 0.01 * torch.arange(30.0)           # 30 likely tokens: beyond 8 candidates, inside 64
    params = [SamplingParams(top_p=0.5), SamplingParams(top_p=0.45), SamplingParams(top_p=0.5)]
    groups = truncate(logits, params)
    assert sorted((g.rows, g.probs.shape[-1]) for g in groups) == [([0], VOCAB), ([1], 8), ([2], 64)]
    got = truncated_probs(logits, params)
    assert int((got[0] > 0).sum()) == VOCAB // 2        # the full sort's answer
    assert int((got[1] > 0).sum()) == 2                 # 0.29 + 0.26 reaches 0.45
    assert 14 <= int((got[2] > 0).sum()) <= 16          # about half of the 30 reach 0.5
    for i, p in enumerate(params):
        assert torch.equal(got[i] > 0, reference_probs(logits[i], p) > 0)


def test_inverse_cdf_follows_the_distribution_and_never_draws_a_zero():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2, 0.0]] * 4000) * 0.7    # unnormalised rows are fine
    gens = [torch.Generator().manual_seed(i) for i in range(len(probs))]
    counts = Counter(inverse_cdf(probs, gens))
    assert set(counts) == {1, 3, 4}
    for token, p in ((1, 0.5), (3, 0.3), (4, 0.2)):
        assert abs(counts[token] / 4000 - p) < 0.03, counts


def test_a_seeded_row_draws_the_same_tokens_whatever_shares_its_block():
    rng = random.Random(7)
    rows = random_rows(rng, 12)
    logits = torch.randn(len(rows), VOCAB) * 2

    def alone(i: int) -> int:
        row = rows[i]
        fresh = SamplingRow(row.params, row.prompt_token_ids, row.output_token_ids,
                            torch.Generator().manual_seed(100 + i), row.banned_token_ids)
        return sample(logits[i:i + 1].clone(), [fresh])[0].token_id

    together = [SamplingRow(r.params, r.prompt_token_ids, r.output_token_ids, torch.Generator().manual_seed(100 + i),
                            r.banned_token_ids) for i, r in enumerate(rows)]
    tokens = [res.token_id for res in sample(logits.clone(), together)]
    assert tokens == [alone(i) for i in range(len(rows))]


def test_mixed_block_greedy_rows_and_top_logprobs():
    logits = torch.randn(6, VOCAB)
    rows = [SamplingRow(SamplingParams(temperature=0, logprobs=3), [], [], None),
            SamplingRow(SamplingParams(temperature=0.8, top_p=0.9, logprobs=1), [], [],
                        torch.Generator().manual_seed(0)),
            SamplingRow(SamplingParams(temperature=0, repetition_penalty=2.0), [int(logits[2].argmax())], [], None),
            SamplingRow(SamplingParams(temperature=1.0, logprobs=0), [], [], torch.Generator().manual_seed(1)),
            SamplingRow(SamplingParams(temperature=0, min_tokens=1), [], [], None,
                        banned_token_ids=(int(logits[4].argmax()),)),
            SamplingRow(SamplingParams(temperature=0.5), [], [], torch.Generator().manual_seed(2))]
    raw = torch.log_softmax(logits, dim=-1)
    res = sample(logits.clone(), rows)
    assert res[0].token_id == int(logits[0].argmax())
    assert list(res[0].top_logprobs) == torch.topk(raw[0], 3).indices.tolist()
    assert len(res[1].top_logprobs) in (1, 2) and res[1].token_id in res[1].top_logprobs
    assert res[2].token_id != int(logits[2].argmax())             # the repeated best token was penalised
    assert res[3].top_logprobs == {res[3].token_id: pytest.approx(float(raw[3, res[3].token_id]))}
    assert res[4].token_id == int(torch.topk(logits[4], 2).indices[1])   # the banned best token is skipped
    assert res[5].top_logprobs is None
    for i, r in enumerate(res):
        assert r.logprob == pytest.approx(float(raw[i, r.token_id]))   # raw model logprobs, whatever the filters
