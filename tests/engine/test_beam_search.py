"""Beam search decisions (server/engine/beam_search.py) against HF transformers' `generate(num_beams=...)`.

Three layers:
* hand-made logprob tables pin each rule: which candidates survive, which EOS candidates become
  hypotheses, the normalization length, the three early_stopping modes, max_new_tokens finalization;
* a seeded sweep on a tiny random Llama (vocab 64; EOS ids drawn from tokens it likes, so beams finish
  often) compares every returned hypothesis and score with HF over 40 mixes of width, length penalty,
  stopping mode, EOS set and max_new_tokens;
* SmolLM2-135M (fp32): the best sequence (and all W hypotheses) equal HF's for real prompts.

The model-driven runs mirror the engine's loop: one prompt beam at the first step, then the W chosen
beams, the KV cache reordered by each step's parents. They feed the prompt W times into one cache like
HF does, so the logits are bit-identical to HF's and the hypothesis scores must agree to float32 rounding.
"""
from __future__ import annotations

import math
import random

import pytest
import torch

from pagedmodel.server.engine.beam_search import BeamCandidate, BeamHypothesis, BeamSearch

EOS = 0
VOCAB = 8


def logrow(probs: dict[int, float], vocab: int = VOCAB) -> torch.Tensor:
    """A log-softmax row: the given token probabilities, the rest of the mass spread over other tokens."""
    rest = [t for t in range(vocab) if t not in probs]
    left = 1.0 - sum(probs.values())
    assert left > 0 and rest
    p = torch.full((vocab,), left / len(rest), dtype=torch.float64)
    for t, q in probs.items():
        p[t] = q
    return p.log().to(torch.float32)


class TableLM:
    """A fake language model: next-token distribution by generated prefix, a fixed default otherwise."""

    def __init__(self, table: dict[tuple[int, ...], dict[int, float]], default: dict[int, float]):
        self.table = table
        self.default = default

    def __call__(self, prefixes: list[list[int]]) -> torch.Tensor:
        return torch.stack([logrow(self.table.get(tuple(p), self.default)) for p in prefixes])


def drive(bs: BeamSearch, lm: TableLM) -> list[BeamHypothesis]:
    tokens: list[list[int]] = [[]]
    cums = [0.0]
    while True:
        res = bs.step(tokens, cums, lm(tokens))
        if res.done:
            assert res.next_beams == []
            return bs.finalize()
        assert len(res.next_beams) == bs.width
        tokens = [tokens[c.parent] + [c.token_id] for c in res.next_beams]
        cums = [c.cum_logprob for c in res.next_beams]


def f32(x: float) -> float:
    return torch.tensor(x, dtype=torch.float32).item()


def lp(p: float) -> float:
    return math.log(p)


# ---------------------------------------------------------------------------------------------------
# rules, on hand-made tables (width 2, EOS = 0 → 4 candidates per step)
# ---------------------------------------------------------------------------------------------------

def test_candidates_rank_across_beams_and_skip_eos():
    bs = BeamSearch(2, 1.0, False, {EOS}, max_new_tokens=10)
    assert bs.num_candidates == 4
    res = bs.step([[]], [0.0], logrow({1: 0.5, 2: 0.3, EOS: 0.01}).unsqueeze(0))
    assert [(c.parent, c.token_id) for c in res.next_beams] == [(0, 1), (0, 2)]
    # beam 0 (cum log .5) and beam 1 (cum log .3): the best continuations interleave across beams,
    # and beam 1's EOS (ranked 2nd overall) is skipped as a live beam but recorded as a hypothesis
    rows = torch.stack([logrow({3: 0.5, 4: 0.2}), logrow({EOS: 0.9, 5: 0.05})])
    res = bs.step([[1], [2]], [c.cum_logprob for c in res.next_beams], rows)
    assert [(c.parent, c.token_id) for c in res.next_beams] == [(0, 3), (0, 4)]
    assert res.next_beams[0].cum_logprob == pytest.approx(lp(0.5) + lp(0.5), rel=1e-6)
    (hyp,) = bs.hypotheses
    assert hyp.tokens == [2, EOS] and hyp.cum_logprob == pytest.approx(lp(0.3) + lp(0.9), rel=1e-6)
    assert not res.done


def test_cum_logprobs_are_float32_sums():
    bs = BeamSearch(2, 1.0, False, {EOS}, max_new_tokens=10)
    row = logrow({1: 0.37, 2: 0.29})
    res = bs.step([[]], [0.0], row.unsqueeze(0))
    for c in res.next_beams:
        assert c.cum_logprob == f32(c.cum_logprob) == row[c.token_id].item()
    rows = torch.stack([logrow({3: 0.41}), logrow({4: 0.33})])
    res2 = bs.step([[1], [2]], [c.cum_logprob for c in res.next_beams], rows)
    best = res2.next_beams[0]
    expected = (torch.tensor(res.next_beams[best.parent].cum_logprob, dtype=torch.float32)
                + rows[best.parent, best.token_id]).item()
    assert best.cum_logprob == expected


def test_eos_becomes_hypothesis_only_when_ranked_in_top_width():
    # EOS ranked first of 4 candidates: a hypothesis
    bs = BeamSearch(2, 1.0, False, {EOS}, max_new_tokens=10)
    bs.step([[]], [0.0], logrow({EOS: 0.4, 1: 0.3, 2: 0.2}).unsqueeze(0))
    assert [h.tokens for h in bs.hypotheses] == [[EOS]]
    # EOS ranked third (inside the 4 candidates, outside the top 2): a spare only, dropped
    bs = BeamSearch(2, 1.0, False, {EOS}, max_new_tokens=10)
    res = bs.step([[]], [0.0], logrow({1: 0.4, 2: 0.3, EOS: 0.2}).unsqueeze(0))
    assert bs.hypotheses == [] and [c.token_id for c in res.next_beams] == [1, 2]
    # both top candidates EOS: two hypotheses, and the spares (ranks 3-4) continue ("never": not done yet)
    bs = BeamSearch(2, 1.0, "never", {EOS, 7}, max_new_tokens=10)
    assert bs.num_candidates == 6
    res = bs.step([[]], [0.0], logrow({EOS: 0.4, 7: 0.3, 1: 0.1, 2: 0.09}).unsqueeze(0))
    assert sorted(h.tokens for h in bs.hypotheses) == [[EOS], [7]]
    assert [c.token_id for c in res.next_beams] == [1, 2]


@pytest.mark.parametrize("penalty", [1.0, 0.6, 2.0, -0.5, 0.0])
def test_score_normalizes_by_generated_length_including_eos(penalty):
    lm = TableLM({(): {1: 0.9}, (1,): {2: 0.9}, (1, 2): {EOS: 0.8}}, default={3: 0.5})
    bs = BeamSearch(2, penalty, False, {EOS}, max_new_tokens=10)
    drive(bs, lm)
    hyp = next(h for h in bs.hypotheses if h.tokens == [1, 2, EOS])
    assert hyp.cum_logprob == pytest.approx(lp(0.9) + lp(0.9) + lp(0.8), rel=1e-6)
    # three generated tokens, the EOS included, the prompt not counted
    assert hyp.score == pytest.approx(hyp.cum_logprob / 3 ** penalty, rel=1e-6)


# Step 1: EOS (.5) finishes at once; live [1] and [2]. Step 2: [2] continues with 3 (.99) and ranks first;
# [1] ends with EOS (ranked 2nd, so a hypothesis): 2 hypotheses = width. Is it over? [2,3] has
# cum log(.2 * .99) / 2 = -0.81, better than the worst hypothesis log(.25 * .6) / 2 = -0.95.
# Step 3: [2,3] ends with EOS (.9): cum log(.2 * .99 * .9) / 3 = -0.575, the best of all.
STOPPING_LM = TableLM(
    {(): {EOS: 0.5, 1: 0.25, 2: 0.2}, (1,): {EOS: 0.6, 4: 0.1}, (2,): {3: 0.99}, (2, 3): {EOS: 0.9}},
    default={5: 0.5, 6: 0.3, EOS: 0.01},
)


def test_early_stopping_true_stops_at_width_hypotheses():
    bs = BeamSearch(2, 1.0, True, {EOS}, max_new_tokens=10)
    hyps = drive(bs, STOPPING_LM)
    assert bs.num_steps == 2
    assert [h.tokens for h in hyps] == [[EOS], [1, EOS]]


def test_early_stopping_false_continues_while_a_live_beam_can_win():
    bs = BeamSearch(2, 1.0, False, {EOS}, max_new_tokens=10)
    hyps = drive(bs, STOPPING_LM)
    assert [h.tokens for h in hyps] == [[2, 3, EOS], [EOS]]
    assert hyps[0].score == pytest.approx(math.log(0.2 * 0.99 * 0.9) / 3, rel=1e-6)
    assert hyps[1].score == pytest.approx(math.log(0.5), rel=1e-6)
    # after step 3 the best live beam, e.g. [2,3,5], has cum log(.2*.99*.5)/3 = -0.77 < -0.69: stop
    assert bs.num_steps == 3


def test_early_stopping_never_with_positive_penalty_assumes_max_length():
    # the same table: at step 3 the best live beam's cum (-2.3) over max_new_tokens (10) beats -0.69,
    # so "never" keeps going where False stopped
    bs = BeamSearch(2, 1.0, "never", {EOS}, max_new_tokens=10)
    hyps = drive(bs, STOPPING_LM)
    assert bs.num_steps > 3
    assert [h.tokens for h in hyps][:2] == [[2, 3, EOS], [EOS]]


@pytest.mark.parametrize("penalty", [0.0, -1.0])
def test_early_stopping_never_without_positive_penalty_is_false(penalty):
    steps = {}
    for mode in (False, "never"):
        bs = BeamSearch(2, penalty, mode, {EOS}, max_new_tokens=10)
        hyps = drive(bs, STOPPING_LM)
        steps[mode] = (bs.num_steps, hyps)
    assert steps[False] == steps["never"]


def test_max_new_tokens_finishes_the_top_width_candidates():
    lm = TableLM({(): {1: 0.6, 2: 0.3}, (1,): {3: 0.7, EOS: 0.2}, (2,): {EOS: 0.1, 4: 0.8}}, default={5: 0.5})
    bs = BeamSearch(2, 1.0, False, {EOS}, max_new_tokens=2)
    hyps = drive(bs, lm)
    assert bs.num_steps == 2 and bs.done
    # candidates at step 2: [1,3] .42, [2,4] .24, [1,0] .12, ...; only the top 2 become hypotheses,
    # finished or not, normalized by 2
    assert [h.tokens for h in hyps] == [[1, 3], [2, 4]]
    assert [h.score for h in hyps] == pytest.approx([math.log(0.42) / 2, math.log(0.24) / 2], rel=1e-6)


def test_max_new_tokens_one():
    bs = BeamSearch(3, 1.0, False, {EOS}, max_new_tokens=1)
    res = bs.step([[]], [0.0], logrow({4: 0.5, EOS: 0.3, 2: 0.1, 1: 0.05}).unsqueeze(0))
    assert res.done and res.next_beams == []
    assert [h.tokens for h in bs.finalize()] == [[4], [EOS], [2]]


def test_finalize_orders_by_normalized_score_not_cum_logprob():
    # [EOS] at step 1: cum log(.5) = -0.69, score -0.69 (lp 1). [1,3,EOS]: cum log(.45 * .8 * .9) = -1.13,
    # worse in cum but score -0.38: first. With lp 0 the cum order wins instead.
    lm = TableLM({(): {EOS: 0.5, 1: 0.45}, (1,): {3: 0.8}, (1, 3): {EOS: 0.9}}, default={5: 0.9})
    hyps = drive(BeamSearch(2, 1.0, False, {EOS}, max_new_tokens=6), lm)
    assert [h.tokens for h in hyps] == [[1, 3, EOS], [EOS]]
    assert hyps[0].cum_logprob < hyps[1].cum_logprob and hyps[0].score > hyps[1].score
    hyps0 = drive(BeamSearch(2, 0.0, False, {EOS}, max_new_tokens=6), lm)
    assert [h.tokens for h in hyps0][0] == [EOS]
    assert all(a.score >= b.score for a, b in zip(hyps0, hyps0[1:]))


def test_only_width_best_hypotheses_are_kept():
    # EOS is the best continuation of every beam at every step: many finish, two are kept
    lm = TableLM({}, default={EOS: 0.5, 1: 0.2, 2: 0.2})
    bs = BeamSearch(2, 0.0, "never", {EOS}, max_new_tokens=5)
    hyps = drive(bs, lm)
    assert len(hyps) == 2
    assert [h.tokens for h in hyps] == [[EOS], [1, EOS]]


def test_finalize_live_beams_when_cut_short():
    bs = BeamSearch(2, 1.0, False, {EOS}, max_new_tokens=10)
    res = bs.step([[]], [0.0], logrow({1: 0.5, 2: 0.3}).unsqueeze(0))
    with pytest.raises(RuntimeError, match="not done"):
        bs.finalize()
    hyps = bs.finalize([[1], [2]], [c.cum_logprob for c in res.next_beams])
    assert [h.tokens for h in hyps] == [[1], [2]]
    assert hyps[0] == BeamHypothesis([1], res.next_beams[0].cum_logprob, res.next_beams[0].cum_logprob)
    assert bs.done and bs.finalize() == hyps
    with pytest.raises(RuntimeError, match="done"):
        bs.step([[1], [2]], [0.0, 0.0], torch.zeros(2, VOCAB))


@pytest.mark.parametrize("kwargs, match", [
    (dict(width=0), "width"),
    (dict(width=True), "width"),
    (dict(length_penalty=float("nan")), "length_penalty"),
    (dict(length_penalty="1"), "length_penalty"),
    (dict(early_stopping="always"), "early_stopping"),
    (dict(early_stopping=1), "early_stopping"),
    (dict(eos_token_ids={-1}), "eos_token_ids"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=None), "max_new_tokens"),
])
def test_bad_parameters_are_rejected(kwargs, match):
    args = dict(width=2, length_penalty=1.0, early_stopping=False, eos_token_ids={EOS}, max_new_tokens=4) | kwargs
    with pytest.raises(ValueError, match=match):
        BeamSearch(**args)


def test_bad_step_inputs_are_rejected():
    bs = BeamSearch(2, 1.0, False, {EOS}, max_new_tokens=4)
    with pytest.raises(ValueError, match="expects 1 beams"):
        bs.step([[], []], [0.0, 0.0], torch.zeros(2, VOCAB))
    with pytest.raises(ValueError, match="generated tokens"):
        bs.step([[5]], [0.0], torch.zeros(1, VOCAB))
    with pytest.raises(ValueError, match="vocab"):
        bs.step([[]], [0.0], torch.zeros(1, 3))
    with pytest.raises(ValueError, match=r"\[1, vocab\]"):
        bs.step([[]], [0.0], torch.zeros(VOCAB))
    with pytest.raises(ValueError, match="NaN"):
        bs.step([[]], [0.0], torch.full((1, VOCAB), float("nan")))
    with pytest.raises(RuntimeError, match="no step"):
        bs.finalize([[], []], [0.0, 0.0])
    res = bs.step([[]], [0.0], logrow({1: 0.5}).unsqueeze(0))
    assert not bs.done and res.next_beams[0] == BeamCandidate(0, 1, res.next_beams[0].cum_logprob)
    with pytest.raises(ValueError, match="expects 2 beams"):
        bs.step([[1]], [0.0], torch.zeros(1, VOCAB))
    with pytest.raises(ValueError, match=r"\[2, vocab\]"):
        bs.step([[1], [2]], [0.0, 0.0], torch.zeros(3, VOCAB))


# ---------------------------------------------------------------------------------------------------
# against HF generate
# ---------------------------------------------------------------------------------------------------

@torch.no_grad()
def beam_search_with_model(model, prompt: list[int], bs: BeamSearch) -> list[BeamHypothesis]:
    """The engine's loop with an HF model as the forward pass (KV cache reordered by each step's parents)."""
    from transformers import DynamicCache

    width = bs.width
    cache = DynamicCache(config=model.config)
    ids = torch.tensor([prompt] * width)   # as HF: W prompt copies, so the logits are bit-identical to its own
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache, use_cache=True, logits_to_keep=1)
    tokens: list[list[int]] = [[]]
    cums = [0.0]
    while True:
        logprobs = torch.log_softmax(out.logits[:, -1, :].float(), dim=-1)
        res = bs.step(tokens, cums, logprobs[: len(tokens)])
        if res.done:
            return bs.finalize()
        cache.reorder_cache(torch.tensor([c.parent for c in res.next_beams]))
        tokens = [tokens[c.parent] + [c.token_id] for c in res.next_beams]
        cums = [c.cum_logprob for c in res.next_beams]
        length = len(prompt) + len(tokens[0])
        out = model(input_ids=torch.tensor([[c.token_id] for c in res.next_beams]),
                    attention_mask=torch.ones(width, length, dtype=torch.long), cache=cache, use_cache=True,
                    position_ids=torch.full((width, 1), length - 1), logits_to_keep=1)


@torch.no_grad()
def hf_beam_search(model, prompt: list[int], width: int, penalty: float, early_stopping, eos: set[int],
                   max_new_tokens: int, pad: int) -> list[tuple[list[int], float]]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width, num_return_sequences=width,
                         do_sample=False, length_penalty=penalty, early_stopping=early_stopping,
                         max_new_tokens=max_new_tokens, eos_token_id=sorted(eos), pad_token_id=pad,
                         return_dict_in_generate=True, output_scores=True)
    return [(seq[len(prompt):], score) for seq, score in zip(out.sequences.tolist(), out.sequences_scores.tolist())]


def assert_same_as_hf(mine: list[BeamHypothesis], hf: list[tuple[list[int], float]], pad: int) -> None:
    assert len(mine) == len(hf)
    for h, (seq, score) in zip(mine, hf):
        # HF pads the shorter hypotheses to the longest returned one
        assert seq == h.tokens + [pad] * (len(seq) - len(h.tokens))
        assert h.score == pytest.approx(score, rel=1e-6, abs=1e-7)


@pytest.fixture(scope="module")
def tiny_peaked_llama():
    """A 1-layer random Llama over 64 tokens with large embeddings: peaked, well separated logits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1234)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=63)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(10.0)
    return model


@torch.no_grad()
def likely_tokens(model, prompt: list[int], steps: int = 6, k: int = 3) -> list[int]:
    """The top-k next tokens along a short greedy run: EOS ids drawn from them actually get generated."""
    ids, pool = list(prompt), set()
    for _ in range(steps):
        top = model(torch.tensor([ids])).logits[0, -1].topk(k).indices.tolist()
        pool.update(top)
        ids.append(top[0])
    return sorted(pool)


def test_matches_hf_on_tiny_model_sweep(tiny_peaked_llama):
    rng = random.Random(7)
    stop_kinds = set()
    for i in range(40):
        width = rng.choice([2, 3, 4])
        penalty = rng.choice([-0.5, 0.0, 0.6, 1.0, 1.5, 2.0])
        mode = [True, False, "never"][i % 3]
        prompt = [rng.randrange(1, 63) for _ in range(rng.randint(1, 6))]
        pool = likely_tokens(tiny_peaked_llama, prompt)
        eos = set(rng.sample(pool, min(len(pool), rng.choice([1, 2, 3]))))
        max_new = rng.choice([3, 8, 12])
        case = (width, penalty, mode, eos, prompt, max_new)
        bs = BeamSearch(width, penalty, mode, eos, max_new_tokens=max_new)
        mine = beam_search_with_model(tiny_peaked_llama, prompt, bs)
        hf = hf_beam_search(tiny_peaked_llama, prompt, width, penalty, mode, eos, max_new, pad=63)
        try:
            assert_same_as_hf(mine, hf, pad=63)
        except AssertionError as e:
            raise AssertionError(f"case {case}: {e}") from e
        stop_kinds.add("length" if bs.num_steps == max_new else f"early:{mode}")
    # the sweep exercised every way of ending
    assert stop_kinds == {"length", "early:True", "early:False", "early:never"}


# SmolLM2: (prompt, chat-formatted, length_penalty, early_stopping, extra EOS tokens, max_new_tokens, what the
# case exercises). Six prompts; 4 beams.
SMOLLM2_CASES = [
    ("The capital of France is", False, 1.0, False, [], 12, "length"),
    ("def fibonacci(n):", False, 0.6, True, [], 12, "length"),
    ("What color is grass? Answer in one word.", True, 1.5, True, [], 12, "length"),
    ("What is 2+2? Answer with one number.", True, 1.0, False, [], 14, "eos-early"),
    ("Is the sky blue? Answer yes or no.", True, 0.6, False, [], 12, "eos-best"),
    ("Say hi.", True, 1.5, "never", ["?"], 12, "extra-eos"),
]


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    return tok, model


@pytest.mark.model
@pytest.mark.parametrize("text, chat, penalty, mode, extra_eos, max_new, expect", SMOLLM2_CASES,
                         ids=["france", "fibonacci", "grass", "arithmetic", "sky", "hi"])
def test_matches_hf_generate_on_smollm2(smollm2, text, chat, penalty, mode, extra_eos, max_new, expect):
    tok, model = smollm2
    if chat:
        text = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    prompt = tok(text).input_ids
    eos = {tok.eos_token_id} | {tok.convert_tokens_to_ids(t) for t in extra_eos}
    assert len(eos) == 1 + len(extra_eos)
    bs = BeamSearch(4, penalty, mode, eos, max_new_tokens=max_new)
    mine = beam_search_with_model(model, prompt, bs)
    hf = hf_beam_search(model, prompt, 4, penalty, mode, eos, max_new, pad=tok.eos_token_id)
    assert mine[0].tokens == hf[0][0][: len(mine[0].tokens)]   # the answer, before any padding
    assert_same_as_hf(mine, hf, pad=tok.eos_token_id)
    # the case exercises what it is meant to
    if expect == "length":
        assert bs.num_steps == max_new
    elif expect == "eos-early":
        assert bs.num_steps < max_new and mine[0].tokens[-1] in eos
    elif expect == "eos-best":
        assert mine[0].tokens[-1] in eos
    elif expect == "extra-eos":
        assert any(h.tokens[-1] in eos - {tok.eos_token_id} for h in mine)
    else:
        raise AssertionError(f"unknown expectation {expect!r}")
