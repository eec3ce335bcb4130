"""Sampling: distribution, truncation, penalties, logprobs, and seeded reproducibility in any batch."""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from pagedmodel.server.engine.args import EngineArgs
from pagedmodel.server.engine.llm_engine import LLMEngine
from pagedmodel.server.engine.sampler import SamplingRow, sample
from pagedmodel.server.engine.sampling_params import SamplingParams


def draw(logits: list[float], n: int, **params) -> Counter:
    gen = torch.Generator().manual_seed(0)
    row = SamplingRow(SamplingParams(**params), [], [], gen)
    x = torch.tensor([logits], dtype=torch.float32)
    return Counter(sample(x, [row])[0].token_id for _ in range(n))


def test_samples_follow_the_distribution():
    probs = [0.5, 0.3, 0.2]
    counts = draw([math.log(p) for p in probs], 4000, temperature=1.0)
    for token, p in enumerate(probs):
        assert abs(counts[token] / 4000 - p) < 0.03, counts


def test_temperature_sharpens():
    logits = [math.log(p) for p in (0.5, 0.3, 0.2)]
    cold = draw(logits, 2000, temperature=0.25)
    assert cold[0] / 2000 > 0.85


def test_top_k_top_p_min_p_truncate():
    logits = [math.log(p) for p in (0.4, 0.3, 0.2, 0.1)]
    assert set(draw(logits, 500, top_k=2)) == {0, 1}
    assert set(draw(logits, 500, top_p=0.65)) == {0, 1}      # 0.4 + 0.3 reaches 0.65
    assert set(draw(logits, 500, top_p=0.01)) == {0}
    assert set(draw(logits, 500, min_p=0.6)) == {0, 1}        # keeps p >= 0.24
    assert draw(logits, 50, top_k=1) == Counter({0: 50})


def test_penalties_change_the_choice():
    logits = torch.tensor([[2.0, 1.9, 0.0]])
    base = SamplingParams(temperature=0)
    assert sample(logits, [SamplingRow(base, [], [], None)])[0].token_id == 0
    rep = SamplingParams(temperature=0, repetition_penalty=1.2)
    assert sample(logits, [SamplingRow(rep, [0], [], None)])[0].token_id == 1  # 2.0/1.2 < 1.9
    pres = SamplingParams(temperature=0, presence_penalty=0.5)
    assert sample(logits, [SamplingRow(pres, [], [0], None)])[0].token_id == 1
    freq = SamplingParams(temperature=0, frequency_penalty=0.05)
    assert sample(logits, [SamplingRow(freq, [], [0], None)])[0].token_id == 0   # 2.0 - 0.05 > 1.9
    assert sample(logits, [SamplingRow(freq, [], [0, 0, 0], None)])[0].token_id == 1
    assert sample(logits, [SamplingRow(base, [], [], None, banned_token_ids=(0,))])[0].token_id == 1


def test_logprobs_are_raw_log_softmax():
    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0]])
    res = sample(logits, [SamplingRow(SamplingParams(temperature=0, logprobs=2), [], [], None)])[0]
    ref = torch.log_softmax(logits[0], -1)
    assert res.token_id == 1
    assert math.isclose(res.logprob, float(ref[1]), rel_tol=1e-6)
    assert set(res.top_logprobs) == {1, 2}
    assert math.isclose(res.top_logprobs[2], float(ref[2]), rel_tol=1e-6)



def _bf16_rows(kinds: list[str]) -> list[SamplingRow]:
    params = {"greedy": SamplingParams(temperature=0), "logprobs": SamplingParams(temperature=0, logprobs=3),
              "penalty": SamplingParams(temperature=0, repetition_penalty=1.3),
              "random": SamplingParams(temperature=0.8, top_p=0.9, seed=5)}
    return [SamplingRow(params[k], [1, 2, 3], [4, 5], torch.Generator().manual_seed(i) if k == "random" else None)
            for i, k in enumerate(kinds)]


@pytest.mark.parametrize("kinds", [["greedy"] * 6, ["greedy", "logprobs", "penalty", "random", "greedy"],
                                   ["random"] * 5, ["greedy", "random", "random", "greedy"]])
def test_bf16_logits_sample_like_their_float32_copy(kinds, monkeypatch):
    """A bf16 head's logits reach the sampler as they are (model_runner: compute_logits(float32=False)):
    greedy rows and rows the CPU op draws are read in bf16, anything else is widened first; either way the
    tokens, logprobs and top logprobs are exactly what the float32 copy gives."""
    logits = (torch.randn(len(kinds), 3000, generator=torch.Generator().manual_seed(1)) * 6).bfloat16()
    widened = []
    real_float = torch.Tensor.float
    monkeypatch.setattr(torch.Tensor, "float", lambda t: widened.append(t.shape) or real_float(t))
    narrow = sample(logits.clone(), _bf16_rows(kinds))
    monkeypatch.undo()
    # the whole block is copied to float32 only when some row needs it (a penalty, top logprobs)
    assert (logits.shape in widened) == bool({"logprobs", "penalty"} & set(kinds)), widened
    wide = sample(logits.float(), _bf16_rows(kinds))
    assert [(r.token_id, r.logprob, r.top_logprobs) for r in narrow] == [(r.token_id, r.logprob, r.top_logprobs) for r in wide]
    assert all(math.isfinite(r.logprob) and r.logprob <= 0 for r in narrow)

def _outputs(engine: LLMEngine) -> dict:
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = [c.token_ids for c in o.outputs]
    return done


def test_seeded_n3_is_reproducible_whatever_shares_the_batch(wordlevel_llama_dir):
    def engine():
        return LLMEngine(EngineArgs(model=str(wordlevel_llama_dir), device="cpu", block_size=8, max_model_len=256))

    params = SamplingParams(n=3, temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    alone = engine()
    alone.add_request("x", list(range(3, 20)), params)
    ref = _outputs(alone)["x"]
    assert len(ref) == 3 and len({tuple(t) for t in ref}) > 1, "three samples should differ"

    crowded = engine()
    crowded.add_request("noise1", list(range(100, 150)), SamplingParams(temperature=0.8, max_tokens=20, seed=1))
    crowded.step()
    crowded.add_request("x", list(range(3, 20)), params)
    crowded.add_request("noise2", list(range(200, 230)), SamplingParams(n=2, temperature=1.0, max_tokens=7))
    assert _outputs(crowded)["x"] == ref
