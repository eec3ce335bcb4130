"""The gumbel watermark (--watermark-config): the keyed noise, the draw it makes, which steps carry it, the
detector, and an engine whose sampled text the detector finds while the same engine's unwatermarked text,
another key's text and greedy text it does not."""
from __future__ import annotations

import math
import random

import pytest
import torch

from pagedmodel.server.engine.args import ConfigError, EngineArgs
from pagedmodel.server.engine.llm_engine import LLMEngine
from pagedmodel.server.engine.sampling_params import SamplingParams, SamplingParamsError
from pagedmodel.server.engine.structured_outputs_params import StructuredOutputsParams
from pagedmodel.server.engine.watermark import (ContextHistory, context_of, context_seed, gumbel_choice,
                                                token_uniform, uniforms, watermarked_draw)
from pagedmodel.server.engine.watermark_config import WatermarkConfig, parse_watermark_config
from pagedmodel.server.engine.watermark_detector import detect_watermark, gamma_survival

KEY = 42


# ---- the keyed noise -------------------------------------------------------------------------------
def test_tensor_uniforms_are_the_reference_prf_and_inside_0_1():
    seeds = [context_seed(KEY, (-1, -1, 3, 4)), context_seed(2**64 - 1, (7, 8, 9, 10))]
    tokens = torch.arange(0, 60000, 7)
    u = uniforms(seeds, tokens)
    for r, s in enumerate(seeds):
        for j in range(0, len(tokens), 211):
            assert u[r, j].item() == token_uniform(s, int(tokens[j]))
    assert 0 < u.min().item() and u.max().item() < 1
    assert abs(u.mean().item() - 0.5) < 0.01          # 17k values: a biased PRF would be far off


def test_context_seed_depends_on_key_every_context_token_and_order():
    base = context_seed(KEY, (1, 2, 3, 4))
    assert base == context_seed(KEY, (1, 2, 3, 4))
    others = {context_seed(KEY + 1, (1, 2, 3, 4)), context_seed(KEY, (1, 2, 3, 5)), context_seed(KEY, (2, 1, 3, 4)),
              context_seed(KEY, (-1, 2, 3, 4)), context_seed(KEY, (1, 2, 3))}
    assert base not in others and len(others) == 5


def test_context_is_the_last_generated_tokens_padded():
    assert context_of([], 3) == (-1, -1, -1)
    assert context_of([5], 3) == (-1, -1, 5)
    assert context_of([1, 2, 3, 4, 5], 3) == (3, 4, 5)


# ---- the draw --------------------------------------------------------------------------------------
def test_gumbel_choice_is_a_draw_from_the_distribution():
    """Over many contexts (many seeds) the choice follows p: the Gumbel-max trick is exact."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logp = probs.log().expand(4000, 4)
    seeds = [context_seed(KEY, (i,)) for i in range(4000)]
    counts = torch.bincount(torch.tensor(gumbel_choice(logp, seeds)), minlength=4).double() / 4000
    assert torch.allclose(counts, probs.double(), atol=0.03), counts


def test_gumbel_choice_is_fixed_by_key_and_context_and_never_picks_a_masked_token():
    logp = torch.log_softmax(torch.randn(64, 300, generator=torch.Generator().manual_seed(0)), dim=-1)
    logp[:, ::2] = float("-inf")                     # what a grammar mask leaves: only odd tokens
    seeds = [context_seed(KEY, (i, i + 1)) for i in range(64)]
    first = gumbel_choice(logp, seeds)
    assert first == gumbel_choice(logp.clone(), seeds)
    assert all(t % 2 == 1 for t in first)
    other = gumbel_choice(logp, [context_seed(KEY + 1, (i, i + 1)) for i in range(64)])
    assert sum(a != b for a, b in zip(first, other)) > 40


def test_watermarked_draw_keeps_the_truncation():
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(1)) * 3
    params = [SamplingParams(top_k=5), SamplingParams(top_p=0.5), SamplingParams(min_p=0.5)]
    for s in range(30):
        picked = watermarked_draw(logits, params, [context_seed(KEY, (s, r)) for r in range(3)])
        assert picked[0] in logits[0].topk(5).indices.tolist()
        probs = logits[2].softmax(-1)
        assert probs[picked[2]] >= 0.5 * probs.max()


# ---- which steps carry it ----------------------------------------------------------------------------
def config(**kw) -> WatermarkConfig:
    return parse_watermark_config({"key": KEY, "context_width": 2, **kw})


def test_single_turn_dedup_skips_a_context_seen_in_the_output():
    h = ContextHistory(config(), prompt_token_ids=[7, 8])
    assert not h.repeated([])                    # (-1, -1): first use
    assert not h.repeated([1])
    assert not h.repeated([1, 2])
    assert not h.repeated([1, 2, 3])
    assert h.repeated([1, 2, 3, 1, 2])          # (1, 2) preceded position 2
    assert not h.repeated([1, 2, 3, 1, 2, 9])


def test_dedup_history_window_and_none():
    h = ContextHistory(config(deduplicate_contexts_max_history=2), [])
    assert h.repeated([1, 2, 5, 1, 2]) is False   # (1, 2) was 3 positions back: outside the window
    assert ContextHistory(config(deduplicate_contexts="none"), []).repeated([1, 2, 1, 2]) is False
    assert ContextHistory(config(), []).repeated([1, 2, 1, 2]) is True


def test_scope_all_searches_the_prompt_and_frees_the_first_tokens():
    h = ContextHistory(config(deduplicate_contexts="all"), [4, 5, 6])
    assert h.repeated([]) and h.repeated([9])    # padded contexts: drawn without the watermark
    assert h.repeated([4, 5])                    # (4, 5) preceded the prompt's 6
    assert not h.repeated([4, 5, 8])


# ---- the detector ------------------------------------------------------------------------------------
def simulate(key: int, n: int, rng: random.Random, vocab: int = 200, width: int = 4) -> list[int]:
    """Text a watermarked sampler writes from random (flat-ish) distributions."""
    out: list[int] = []
    for _ in range(n):
        logp = torch.log_softmax(torch.tensor([rng.gauss(0, 1) for _ in range(vocab)]), dim=-1)
        out += gumbel_choice(logp[None], [context_seed(key, context_of(out, width))])
    return out


def test_detector_tells_watermarked_from_plain_and_from_another_key():
    rng = random.Random(0)
    marked = simulate(KEY, 80, rng)
    assert detect_watermark(marked, KEY).is_watermarked
    for trial in range(20):
        plain = [rng.randrange(200) for _ in range(80)]
        assert not detect_watermark(plain, KEY).is_watermarked or trial < 0
    assert not detect_watermark(marked, KEY + 1).is_watermarked
    assert not detect_watermark(marked, KEY, context_width=3).is_watermarked


def test_detector_dedups_repeated_contexts_and_checks_its_inputs():
    loop = [5, 6, 7, 8] * 10
    assert detect_watermark(loop, KEY).num_scored_tokens == 8          # the padded starts, then one cycle
    assert detect_watermark(loop, KEY, deduplicate_contexts=False).num_scored_tokens == 40
    empty = detect_watermark([], KEY)
    assert empty.num_scored_tokens == 0 and empty.p_value == 1.0 and not empty.is_watermarked
    for bad in ({"key": -1}, {"key": True}, {"context_width": 0}, {"p_value_threshold": 1.0}):
        with pytest.raises(ValueError):
            detect_watermark([1, 2], **{"key": KEY, **bad})
    with pytest.raises(ValueError, match="token ids"):
        detect_watermark([1, -2], KEY)


def test_gamma_survival_is_the_gamma_tail():
    assert gamma_survival(1.0, 1) == pytest.approx(math.exp(-1))
    assert gamma_survival(2.0, 2) == pytest.approx(3 * math.exp(-2))
    assert gamma_survival(0.0, 5) == 1.0 and gamma_survival(3.0, 0) == 1.0
    assert 0 < gamma_survival(6000.0, 4000) < 1e-100                   # no overflow at thousands of tokens


# ---- the config ----------------------------------------------------------------------------------
@pytest.mark.parametrize("value,message", [
    ('{"key": 1, "bogus": 2}', "unknown field(s) 'bogus'"),
    ('{"algorithm": "gumbel"}', 'needs "key"'),
    ("{not json", "not valid JSON"),
    ("[1]", "must be a JSON object"),
    ('{"key": -1}', "key must be an integer from 0 to 2**64-1"),
    ('{"key": 18446744073709551616}', "key must be an integer"),
    ('{"key": "42"}', "key must be an integer"),
    ('{"key": 1, "algorithm": "kgw"}', "algorithm must be one of 'gumbel'"),
    ('{"key": 1, "algorithm": "dual_key_gumbel"}', "dual_key_gumbel' is not served"),
    ('{"key": 1, "prf": "philox"}', "prf 'philox' is not served"),
    ('{"key": 1, "context_width": 0}', "context_width must be an integer from 1 to 64"),
    ('{"key": 1, "context_width": true}', "context_width must be an integer"),
    ('{"key": 1, "deduplicate_contexts": "some"}', "deduplicate_contexts must be one of"),
    ('{"key": 1, "deduplicate_contexts_max_history": 0}', "must be a positive integer or null"),
    ('{"key": 1, "alpha": 2}', "alpha must be a number in [0, 1]"),
    ('{"key": 1, "allow_target_only_watermarking": "yes"}', "must be true or false"),
])
def test_bad_configs_are_refused_naming_the_field(value, message):
    with pytest.raises(ConfigError) as info:
        EngineArgs(watermark_config=value)
    assert message in str(info.value)


def test_good_configs_parse_and_the_key_stays_out_of_reprs():
    c = EngineArgs(watermark_config='{"algorithm": "gumbel", "key": 987654321}').watermark()
    assert c.key == 987654321 and c.context_width == 4 and c.deduplicate_contexts == "single_turn"
    assert "987654321" not in repr(c) and "987654321" not in c.describe()
    full = parse_watermark_config({"key": 2**64 - 1, "context_width": 8, "deduplicate_contexts": "all",
                                   "deduplicate_contexts_max_history": None, "prf": "splitmix64", "alpha": 0.3,
                                   "allow_target_only_watermarking": True})
    assert full.deduplicate_contexts_max_history is None and full.context_width == 8
    assert EngineArgs().watermark() is None
    with pytest.raises(SamplingParamsError, match="watermarking"):
        SamplingParams(watermarking="yes")


# ---- the engine --------------------------------------------------------------------------------------
def engine(model_dir, **watermark) -> LLMEngine:
    wm = {"key": KEY, **watermark} if watermark.get("key", KEY) is not None else None
    return LLMEngine(EngineArgs(model=str(model_dir), device="cpu", block_size=8, max_model_len=256,
                                watermark_config=wm))


def run(e: LLMEngine, prompts: dict[str, list[int]], params: SamplingParams) -> dict[str, list[list[int]]]:
    for rid, prompt in prompts.items():
        e.add_request(rid, prompt, params)
    done: dict[str, list[list[int]]] = {}
    while e.has_unfinished_requests():
        for out in e.step():
            if out.finished:
                done[out.request_id] = [list(c.token_ids) for c in out.outputs]
    return done


PROMPTS = {f"r{i}": list(range(3 + i, 20 + i)) for i in range(3)}


@pytest.fixture(scope="module")
def marked_engine(wordlevel_llama_dir):
    return engine(wordlevel_llama_dir)


def test_engine_text_carries_the_watermark_and_is_fixed_by_key_not_seed(marked_engine, wordlevel_llama_dir):
    sampled = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, seed=1)
    a = run(marked_engine, PROMPTS, sampled)
    b = run(marked_engine, PROMPTS, SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, seed=999))
    assert a == b                                                        # the key, not the seed, draws
    for [tokens] in a.values():
        assert detect_watermark(tokens, KEY).is_watermarked
        assert not detect_watermark(tokens, KEY + 1).is_watermarked
    other = run(engine(wordlevel_llama_dir, key=KEY + 1), PROMPTS, sampled)
    assert other != a and all(not detect_watermark(t, KEY).is_watermarked for [t] in other.values())


def test_opted_out_and_greedy_requests_are_the_unwatermarked_engines(marked_engine, wordlevel_llama_dir):
    plain = engine(wordlevel_llama_dir, key=None)
    opted = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True, seed=5, watermarking=False)
    assert run(marked_engine, PROMPTS, opted) == run(plain, PROMPTS, opted)
    for [t] in run(plain, PROMPTS, opted).values():
        assert not detect_watermark(t, KEY).is_watermarked
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    assert run(marked_engine, PROMPTS, greedy) == run(plain, PROMPTS, greedy)


def test_watermark_composes_with_a_grammar_penalties_and_logprobs(marked_engine):
    """The grammar's mask, penalties and bias apply before the keyed choice: the output still matches, and
    the logprobs are still the raw model's."""
    so = StructuredOutputsParams(regex="(t[3-9]){12}")   # tokens t3..t9 (no other token is a prefix of a match)
    params = SamplingParams(temperature=1.0, max_tokens=40, structured_outputs=so, seed=3, logprobs=2,
                            presence_penalty=0.5, repetition_penalty=1.2)
    for rid, prompt in PROMPTS.items():
        marked_engine.add_request(rid, prompt, params)
    outs = {}
    while marked_engine.has_unfinished_requests():
        for out in marked_engine.step():
            if out.finished:
                outs[out.request_id] = out.outputs[0]
    for o in outs.values():
        assert len(o.token_ids) >= 12 and all(3 <= t <= 9 for t in o.token_ids[:12]), o.token_ids
        assert len(o.logprobs) == len(o.token_ids) and all(len(lp) >= 2 for lp in o.logprobs)
    # seven choices a step is a weak signal per token; the three answers together still show the key
    joined = sum((o.token_ids for o in outs.values()), [])
    assert detect_watermark(joined, KEY, deduplicate_contexts=False).p_value < \
        detect_watermark(joined, KEY + 1, deduplicate_contexts=False).p_value


def test_n_samples_are_watermarked_each(marked_engine):
    params = SamplingParams(n=3, temperature=1.0, max_tokens=30, ignore_eos=True, seed=2)
    out = run(marked_engine, {"x": PROMPTS["r0"]}, params)["x"]
    assert len(out) == 3 and all(detect_watermark(t, KEY).is_watermarked for t in out)


def test_scope_all_gives_n_samples_different_starts(wordlevel_llama_dir):
    e = engine(wordlevel_llama_dir, deduplicate_contexts="all")
    params = SamplingParams(n=4, temperature=1.0, max_tokens=40, ignore_eos=True, seed=2)
    out = run(e, {"x": PROMPTS["r0"]}, params)["x"]
    assert len({tuple(t) for t in out}) > 1
    assert all(detect_watermark(t, KEY).is_watermarked for t in out)


def test_the_detect_command_reads_the_servers_config_and_token_ids(marked_engine, capsys):
    import json

    from pagedmodel.cli import main

    [tokens] = run(marked_engine, {"c": PROMPTS["r1"]},
                   SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True))["c"]
    ids = ",".join(map(str, tokens))
    assert main(["watermark", "detect", "--watermark-config", f'{{"key": {KEY}}}', "--token-ids", ids]) == 0
    assert json.loads(capsys.readouterr().out)["is_watermarked"] is True
    assert main(["watermark", "detect", "--key", str(KEY + 1), "--token-ids", ids, "--exit-code"]) == 1
    assert json.loads(capsys.readouterr().out)["is_watermarked"] is False
    assert main(["watermark", "detect", "--key", str(KEY), "--token-ids", "1,x"]) == 2
    assert "--token-ids must be integers" in capsys.readouterr().err
