"""thinking_token_budget: the pure state machine (thinking_budget.py), --reasoning-config's parsing, and the
engine forcing the end marker after exactly `budget` thinking tokens on the tiny random Llama (SmolLM2's
tokenizer: <think> and </think> are three tokens each), across sampling, n > 1, grammars, penalties,
chunked prefill and both kinds of preemption."""
from __future__ import annotations

import pytest

from pagedmodel.server.engine.args import ConfigError, EngineArgs
from pagedmodel.server.engine.input_processor import InvalidRequestError
from pagedmodel.server.engine.llm_engine import LLMEngine
from pagedmodel.server.engine.reasoning_config import ReasoningConfig
from pagedmodel.server.engine.sampling_params import SamplingParams, SamplingParamsError
from pagedmodel.server.engine.structured_outputs_params import StructuredOutputsParams
from pagedmodel.server.engine.thinking_budget import Phase, ThinkingBudget, ThinkingMarkers

S, E = (90, 91), (80, 81, 82)   # start and end markers of the unit tests
MARKERS = ThinkingMarkers(S, E, E)
CONFIG = {"reasoning_start_str": "<think>", "reasoning_end_str": "</think>"}


def run(budget: ThinkingBudget, n: int, draw: int = 7) -> list[int]:
    """``n`` steps: the forced token when there is one, else ``draw``."""
    out = []
    for _ in range(n):
        token = budget.forced_token if budget.forced_token is not None else draw
        budget.advance(token)
        out.append(token)
    return out


def thinking_span(ids: list[int], start: list[int], end: list[int]) -> int | None:
    """Tokens between the last start marker and the first end marker after it (vLLM's test's measure)."""
    last = max((i for i in range(len(ids) - len(start) + 1) if ids[i:i + len(start)] == start), default=None)
    if last is None:
        return None
    after = last + len(start)
    for j in range(after, len(ids) - len(end) + 1):
        if ids[j:j + len(end)] == end:
            return j - after
    return len(ids) - after


# ---- the state machine ---------------------------------------------------------------------------
@pytest.mark.parametrize("budget", [0, 1, 4])
def test_a_prompt_that_opens_thinking_gets_budget_tokens_then_the_end_marker(budget: int) -> None:
    out = run(ThinkingBudget(MARKERS, budget, [1, 2, *S]), budget + 5)
    assert out == [7] * budget + list(E) + [7, 7]


def test_thinking_tokens_already_in_the_prompt_count() -> None:
    assert run(ThinkingBudget(MARKERS, 4, [1, *S, 5, 5, 5]), 5) == [7, *E, 7]
    assert run(ThinkingBudget(MARKERS, 2, [1, *S, 5, 5, 5]), 4) == [*E, 7]   # over budget already: end at once


def test_a_prompt_that_closed_thinking_forces_nothing_until_the_model_opens_it() -> None:
    b = ThinkingBudget(MARKERS, 2, [1, *S, 5, *E, 3])
    assert run(b, 5) == [7] * 5
    for t in S:
        b.advance(t)
    assert b.phase is Phase.THINKING
    assert run(b, 6) == [7, 7, *E, 7]


def test_the_model_closing_thinking_itself_stops_the_count_and_a_new_section_gets_a_fresh_budget() -> None:
    b = ThinkingBudget(MARKERS, 5, [*S])
    for t in (7, *E):
        b.advance(t)
    assert b.phase is Phase.ANSWERING and run(b, 6) == [7] * 6
    for t in S:
        b.advance(t)
    assert run(b, 8) == [7] * 5 + list(E)


def test_a_start_marker_inside_thinking_renews_nothing() -> None:
    b = ThinkingBudget(MARKERS, 4, [*S])
    for t in S:   # two thinking tokens that happen to spell the start marker
        b.advance(t)
    assert run(b, 5) == [7, 7, *E]


def test_a_marker_split_between_prompt_and_output_is_found() -> None:
    b = ThinkingBudget(MARKERS, 1, [1, S[0]])
    b.advance(S[1])
    assert run(b, 4) == [7, *E]


def test_sync_feeds_each_output_token_once() -> None:
    b = ThinkingBudget(MARKERS, 2, [1, *S])
    ids = [1, *S]
    for _ in range(3):
        ids.append(b.forced_token or 7)
        b.sync(ids, 3)
        b.sync(ids, 3)   # a second look at the same tokens changes nothing
    assert ids[3:] == [7, 7, E[0]] and b.forced_token == E[1]


# ---- --reasoning-config ---------------------------------------------------------------------------
@pytest.mark.parametrize("text, message", [
    ('{"reasoning_start_str": "<think>", "foo": 1}', "unknown key(s) foo"),
    ('{"reasoning_start_str": 5}', "reasoning_start_str must be a string, got 5"),
    ("[1]", "must be a JSON object"),
    ("{nope", "is not valid JSON"),
])
def test_a_bad_reasoning_config_is_a_config_error(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EngineArgs(reasoning_config=text)


def test_reasoning_config_strings_come_from_the_parser_when_left_empty(smollm2_dir) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    think, end = tok.encode("<think>", add_special_tokens=False), tok.encode("</think>", add_special_tokens=False)
    assert ReasoningConfig().markers(tok) is None   # nothing names the markers: budgets are off
    auto = ReasoningConfig().with_parser("qwen3", "<think>", "</think>").markers(tok)
    assert (list(auto.start), list(auto.end)) == (think, end)
    phrase = ReasoningConfig(reasoning_end_str="Enough.</think>").with_parser("qwen3", "<think>", "</think>")
    m = phrase.markers(tok)
    assert list(m.natural_end) == end and list(m.end) == tok.encode("Enough.</think>", add_special_tokens=False)
    with pytest.raises(ConfigError, match="must differ"):
        ReasoningConfig(reasoning_start_str="<think>", reasoning_end_str="<think>").markers(tok)
    with pytest.raises(ConfigError, match="resolved by `pagedmodel serve`"):
        ReasoningConfig(reasoning_parser="qwen3").markers(tok)


@pytest.mark.parametrize("value", [-2, 1.5, True, "5"])
def test_a_bad_budget_is_refused_naming_the_field(value: object) -> None:
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(thinking_token_budget=value)
    assert err.value.param == "thinking_token_budget"


def test_budget_minus_one_is_unlimited_and_beam_search_is_refused() -> None:
    assert SamplingParams(thinking_token_budget=-1).thinking_token_budget is None
    with pytest.raises(SamplingParamsError, match="beam search"):
        SamplingParams(use_beam_search=True, n=2, thinking_token_budget=3)


# ---- the engine -----------------------------------------------------------------------------------
def _engine(model_dir, **kw) -> LLMEngine:
    kw = {"device": "cpu", "dtype": "float32", "max_model_len": 256, "block_size": 16,
          "num_gpu_blocks_override": 128, "reasoning_config": CONFIG, **kw}
    return LLMEngine(EngineArgs(model=str(model_dir), **kw))


def _generate(engine: LLMEngine, prompts: list[str], params: SamplingParams) -> list[tuple[list[int], list[list[int]]]]:
    ids = [engine.tokenizer(p).input_ids for p in prompts]
    for i, p in enumerate(ids):
        engine.add_request(f"r{i}", p, params)
    done: dict[str, list[list[int]]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [o.token_ids for o in out.outputs]
        engine.scheduler.block_manager.check_invariants()
    return [(p, done[f"r{i}"]) for i, p in enumerate(ids)]


PROMPTS = ["Hello there\n<think>", "What is two and two?\n<think>", "Tell me a story\n<think>",
           "Why is the sky blue?\n<think>"]


@pytest.fixture(scope="module")
def engine(tiny_llama_dir) -> LLMEngine:
    return _engine(tiny_llama_dir)


def _assert_spans(engine: LLMEngine, results, budget: int) -> None:
    start = engine.tokenizer.encode("<think>", add_special_tokens=False)
    end = engine.tokenizer.encode("</think>", add_special_tokens=False)
    for prompt, outputs in results:
        for out in outputs:
            assert thinking_span(prompt + out, start, end) == budget, out
            assert out[budget:budget + len(end)] == end   # the model's random weights never end thinking first


@pytest.mark.parametrize("budget", [0, 1, 5])
def test_greedy_output_thinks_exactly_the_budget(engine: LLMEngine, budget: int) -> None:
    results = _generate(engine, PROMPTS, SamplingParams(temperature=0, max_tokens=budget + 8, ignore_eos=True,
                                                        thinking_token_budget=budget))
    _assert_spans(engine, results, budget)


def test_each_of_n_samples_has_its_own_budget(engine: LLMEngine) -> None:
    params = SamplingParams(temperature=1.0, seed=7, n=3, best_of=4, max_tokens=12, ignore_eos=True,
                            thinking_token_budget=4)
    _assert_spans(engine, _generate(engine, PROMPTS[:2], params), 4)


def test_the_end_marker_is_forced_over_penalties_bias_and_a_grammar(engine: LLMEngine) -> None:
    end = engine.tokenizer.encode("</think>", add_special_tokens=False)
    ban = {t: -100.0 for t in end}   # the bias alone would make the marker impossible
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, thinking_token_budget=2,
                            repetition_penalty=2.0, presence_penalty=2.0, logit_bias=ban)
    _assert_spans(engine, _generate(engine, PROMPTS[:2], params), 2)
    grammar = SamplingParams(temperature=0, max_tokens=10, thinking_token_budget=2,
                             structured_outputs=StructuredOutputsParams(regex="[a-z]{1,40}"))
    (prompt, [out]), = _generate(engine, PROMPTS[:1], grammar)
    assert out[2:5] == end
    after = engine.tokenizer.decode(out[5:])
    assert after and all("a" <= c <= "z" for c in after)   # the grammar holds again after the forced marker


@pytest.mark.parametrize("engine_kw", [
    {"max_num_batched_tokens": 4},                                    # chunked prefill
    # preempted: prefilled again from its tokens, or swapped out and back
    {"num_gpu_blocks_override": 6, "max_model_len": 48, "preemption_mode": "recompute"},
    {"num_gpu_blocks_override": 6, "max_model_len": 48, "preemption_mode": "swap"},
])
def test_budgets_hold_across_chunked_prefill_and_preemption(tiny_llama_dir, engine: LLMEngine, engine_kw) -> None:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, thinking_token_budget=9)
    want = _generate(engine, PROMPTS, params)
    other = _engine(tiny_llama_dir, **engine_kw)
    got = _generate(other, PROMPTS, params)
    if "num_gpu_blocks_override" in engine_kw:
        s = other.scheduler
        assert s.num_preemptions > 0
        assert (s.num_swap_outs > 0) == (engine_kw["preemption_mode"] == "swap")
    assert got == want
    _assert_spans(engine, got, 9)


def test_a_budget_without_markers_is_refused_and_holds_nothing(tiny_llama_dir) -> None:
    plain = _engine(tiny_llama_dir, reasoning_config=None)
    with pytest.raises(InvalidRequestError, match="--reasoning-parser or --reasoning-config") as err:
        plain.add_request("x", [1, 2, 3], SamplingParams(thinking_token_budget=3))
    assert err.value.param == "thinking_token_budget"
    assert not plain.has_unfinished_requests()
    assert plain.scheduler.block_manager.num_free_blocks == plain.scheduler.block_manager.num_blocks
