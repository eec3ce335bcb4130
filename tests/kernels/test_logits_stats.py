"""The sampler's per-row argmax + log-sum-exp (kernels/cpu_logits_stats.cpp and its torch fallback)
against torch.argmax and torch.logsumexp."""
from __future__ import annotations

import pytest
import torch

from pagedmodel.server.engine.sampler import argmax_logsumexp


@pytest.mark.parametrize("vocab", [1, 7, 16, 17, 1000, 49152])
def test_matches_torch_on_random_rows(op_mode, vocab):
    logits = torch.randn(9, vocab, generator=torch.Generator().manual_seed(vocab)) * 8
    tokens, lse = argmax_logsumexp(logits.clone())
    assert tokens.tolist() == logits.argmax(dim=-1).tolist()
    torch.testing.assert_close(lse, torch.logsumexp(logits, dim=-1), rtol=1e-6, atol=1e-5)


def test_ties_go_to_the_first_index_like_torch_argmax(op_mode):
    logits = torch.zeros(6, 100)
    logits[0, [5, 40, 90]] = 3.0          # same lane group apart, and across lanes
    logits[1, [17, 33]] = 2.0             # same lane (17 % 16 == 33 % 16)
    logits[2, [98, 99]] = 1.0             # in the tail past the last full 16
    logits[3, [3, 99]] = 1.0              # one in the lanes, one in the tail
    logits[4] = -torch.inf                # a row with nothing allowed: no NaN, a log-sum-exp of -inf
    tokens, lse = argmax_logsumexp(logits.clone())
    expected = logits.argmax(dim=-1).tolist()
    assert [t for i, t in enumerate(tokens.tolist()) if i != 4] == [t for i, t in enumerate(expected) if i != 4] \
        == [5, 17, 98, 3, 0]
    assert 0 <= tokens[4].item() < 100 and lse[4].item() == -torch.inf
    torch.testing.assert_close(lse[[0, 1, 2, 3, 5]], torch.logsumexp(logits[[0, 1, 2, 3, 5]], dim=-1))


def test_rows_far_below_their_max_underflow_cleanly(op_mode):
    logits = torch.full((2, 300), -1000.0)
    logits[0, 7] = 50.0
    logits[1, :] = torch.linspace(-500, 0, 300)
    tokens, lse = argmax_logsumexp(logits.clone())
    assert tokens.tolist() == [7, 299]
    torch.testing.assert_close(lse, torch.logsumexp(logits, dim=-1))


@pytest.mark.parametrize("vocab", [1, 17, 1000, 49152])
def test_bf16_rows_give_what_their_float32_copy_gives(op_mode, vocab):
    """A bf16 head's logits, read as they are (each row widened in cache), against the float32 copy the
    sampler used to make: the same tokens and bit for bit the same log-sum-exp."""
    logits = (torch.randn(5, vocab, generator=torch.Generator().manual_seed(vocab)) * 8).bfloat16()
    logits[3, vocab // 2] = logits[3].max()   # a tie in bf16: the first index still wins
    tokens, lse = argmax_logsumexp(logits)
    wide_tokens, wide_lse = argmax_logsumexp(logits.float())
    assert lse.dtype == torch.float32
    assert tokens.tolist() == wide_tokens.tolist() == logits.float().argmax(dim=-1).tolist()
    assert torch.equal(lse, wide_lse)


def test_bf16_logits_of_a_non_contiguous_view(op_mode):
    logits = (torch.randn(8, 300, generator=torch.Generator().manual_seed(3)) * 4).bfloat16()[::2]
    tokens, lse = argmax_logsumexp(logits)
    assert tokens.tolist() == logits.float().argmax(dim=-1).tolist()
    torch.testing.assert_close(lse, torch.logsumexp(logits.float(), dim=-1))
