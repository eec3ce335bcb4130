"""The CPU sampling op (kernels/cpu_sampling.cpp) against the row-by-row reference and the torch path.

It must keep exactly the tokens the reference keeps (temperature, top-k, min-p, top-p by a full sort),
with the same probabilities, on peaked rows and on flat ones (where the nucleus is thousands of tokens
wide), and draw the token the inverse CDF over those kept tokens in id order gives for the row's
uniform number: the token the torch path (random_sampling.draw without the op) draws from the same
generator.
"""
from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from pagedmodel.kernels import cpu_ops
from pagedmodel.server.engine import random_sampling
from pagedmodel.server.engine.sampling_params import SamplingParams
from sampling_reference import random_params, reference_probs


@pytest.fixture
def op():
    found = cpu_ops.sampling()
    if found is None:
        pytest.fail(f"the CPU ops are not loaded: {cpu_ops.load_error()}")
    return found


def run(op, logits: torch.Tensor, params: list[SamplingParams], u: torch.Tensor, kept: torch.Tensor | None = None):
    return op(logits, *random_sampling.row_params(params, logits.shape[-1]), u, kept).tolist()


def inverse_cdf_float64(kept: torch.Tensor, u: float) -> int:
    cdf = torch.cumsum(kept.double(), dim=0)
    return int(torch.searchsorted(cdf, (1.0 - u) * cdf[-1]))


@pytest.mark.parametrize("vocab", [2000, 49152])
@pytest.mark.parametrize("seed", range(3))
def test_keeps_the_reference_tokens_and_draws_by_inverse_cdf(op, vocab: int, seed: int):
    rng = random.Random(seed)
    params = [random_params(rng) for _ in range(24)]
    gen = torch.Generator().manual_seed(seed)
    scale = torch.tensor([rng.choice([0.01, 1.0, 4.0, 12.0]) for _ in params])[:, None]   # flat to peaked
    logits = torch.randn(len(params), vocab, generator=gen) * scale
    logits[0, :5] = -torch.inf                                                           # banned tokens
    u = torch.rand(len(params), generator=gen)
    kept = torch.full_like(logits, -1.0)
    tokens = run(op, logits, params, u, kept)
    widths = []
    for i, p in enumerate(params):
        want = reference_probs(logits[i], p)
        # the same tokens, but for the op's zero below e^-87 (torch's softmax goes on to ~1e-45)
        keep, sure = kept[i] > 0, want > 1e-30
        assert torch.equal(keep & sure, sure) and not (keep & (want == 0)).any(), (i, p)
        torch.testing.assert_close(kept[i] / kept[i].sum(), want, rtol=1e-4, atol=1e-7)
        assert tokens[i] == inverse_cdf_float64(kept[i], float(u[i])), (i, p)
        assert want[tokens[i]] > 0
        widths.append(int((want > 0).sum()))
    assert min(widths) == 1 and max(widths) > vocab // 4     # some rows keep one token, some most of them


@pytest.mark.parametrize("seed", range(2))
def test_bf16_logits_draw_what_their_float32_copy_draws(op, seed: int):
    """bf16 rows are widened one at a time inside the op: the same kept terms and tokens as the copy's."""
    rng = random.Random(seed)
    params = [random_params(rng) for _ in range(16)]
    gen = torch.Generator().manual_seed(seed)
    scale = torch.tensor([rng.choice([0.01, 1.0, 4.0, 12.0]) for _ in params])[:, None]
    logits = (torch.randn(len(params), 49152, generator=gen) * scale).bfloat16()
    u = torch.rand(len(params), generator=gen)
    kept_narrow, kept_wide = torch.zeros(logits.shape), torch.zeros(logits.shape)
    assert run(op, logits, params, u, kept_narrow) == run(op, logits.float(), params, u, kept_wide)
    assert torch.equal(kept_narrow, kept_wide)


def test_nucleus_ties_are_kept_in_token_order(op):
    logits = torch.zeros(2, 64)
    logits[0, [3, 9, 20, 40]] = 5.0       # four equal tokens of 0.227 each: the mass before the 3rd is 0.454
    logits[1, 10:30] = 2.0                # twenty of 0.0385: the mass before the 12th is 0.424
    params = [SamplingParams(top_p=0.5), SamplingParams(top_p=0.4)]
    kept = torch.zeros_like(logits)
    run(op, logits, params, torch.zeros(2), kept)
    assert (kept[0] > 0).nonzero()[:, 0].tolist() == [3, 9, 20]
    assert (kept[1] > 0).nonzero()[:, 0].tolist() == list(range(10, 21))
    for i, p in enumerate(params):        # the reference keeps as many (which of the ties is its sort's choice)
        assert int((reference_probs(logits[i], p) > 0).sum()) == int((kept[i] > 0).sum())


def test_draws_follow_the_kept_distribution(op):
    logits = torch.log(torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2, 1e-9]]).repeat(4000, 1))
    params = [SamplingParams(temperature=1.0, top_p=0.99)] * len(logits)
    counts = Counter(run(op, logits, params, torch.rand(len(logits), generator=torch.Generator().manual_seed(3))))
    assert set(counts) == {1, 3, 4}                       # zeros never, and top-p dropped the 1e-9
    for token, p in ((1, 0.5), (3, 0.3), (4, 0.2)):
        assert abs(counts[token] / 4000 - p) < 0.03, counts


def test_the_torch_path_draws_the_same_tokens_from_the_same_generators(op, monkeypatch):
    rng = random.Random(11)
    params = [random_params(rng) for _ in range(200)]
    gen = torch.Generator().manual_seed(11)
    scale = torch.tensor([rng.choice([0.05, 1.0, 4.0]) for _ in params])[:, None]
    logits = torch.randn(len(params), 3000, generator=gen) * scale

    def tokens() -> list[int]:
        generators = [torch.Generator().manual_seed(100 + i) for i in range(len(params))]
        return random_sampling.draw(logits, params, generators)

    with_op = tokens()
    monkeypatch.setenv(cpu_ops.OPS_ENV, "off")
    with_torch = tokens()
    differ = [i for i, (a, b) in enumerate(zip(with_op, with_torch)) if a != b]
    # float32 sums in another order may move a uniform number that falls within ~1e-7 of a boundary
    assert len(differ) <= 1, differ
    assert len(set(with_op)) > 50                         # they are draws, not one token


def test_bad_inputs_are_refused(op):
    logits = torch.zeros(3, 10)
    good = random_sampling.row_params([SamplingParams()] * 3, 10)
    with pytest.raises(RuntimeError, match="one value per row"):
        op(logits, good[0][:2], *good[1:], torch.zeros(3))
    with pytest.raises(RuntimeError, match="float32 or bfloat16 CPU"):
        op(logits.double(), *good, torch.zeros(3))
    with pytest.raises(RuntimeError, match="temperature must be positive"):
        op(logits, torch.zeros(3), *good[1:], torch.zeros(3))
    with pytest.raises(RuntimeError, match="kept_out"):
        op(logits, *good, torch.zeros(3), torch.zeros(3, 9))
