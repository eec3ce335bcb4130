"""--reasoning-parser as units: how qwen3 and deepseek_r1 split a whole answer into reasoning and content
(vLLM 0.33's rules), that a stream fed token by token or in any two or three pieces gives the same parts
without ever releasing a marker or a piece of one, and where a request's output starts."""
from __future__ import annotations

from pathlib import Path

import pytest

from pagedmodel.server.api.reasoning import (REASONING_PARSERS, StartMode, ThinkSplitter, check_reasoning_parser,
                                             plan_reasoning, split_text)

QWEN3, R1 = REASONING_PARSERS["qwen3"], REASONING_PARSERS["deepseek_r1"]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'

# (output, qwen3's (reasoning, content), deepseek_r1's)
CASES = [
    ("This is a reasoning section</think>This is the rest",
     ("This is a reasoning section", "This is the rest"), ("This is a reasoning section", "This is the rest")),
    ("<think>This is a reasoning section</think>This is the rest",
     ("This is a reasoning section", "This is the rest"), ("This is a reasoning section", "This is the rest")),
    ("This is a reasoning section</think>", ("This is a reasoning section", None), ("This is a reasoning section", None)),
    ("<think>reasoning</think>", ("reasoning", None), ("reasoning", None)),
    # no end marker: the output was cut off while thinking, so all of it is reasoning
    ("This is the rest", ("This is the rest", None), ("This is the rest", None)),
    ("<think>This is a reasoning section", ("This is a reasoning section", None), ("This is a reasoning section", None)),
    ("<think>This is a reasoning\nsection</think>This is the rest\nThat",
     ("This is a reasoning\nsection", "This is the rest\nThat"), ("This is a reasoning\nsection", "This is the rest\nThat")),
    # qwen3: a tool call ends thinking and stays in the content for the tool parser; deepseek_r1 has no such rule
    ("I need to read the file.\n\n" + CALL, ("I need to read the file.\n\n", CALL), ("I need to read the file.\n\n" + CALL, None)),
    ("<think>Let me list it.</think>" + CALL, ("Let me list it.", CALL), ("Let me list it.", CALL)),
    # qwen3 drops a repeated end marker; deepseek_r1 keeps what follows its first one as it is
    ("Reasoning here.</think>Content here.</think>More content.",
     ("Reasoning here.", "Content here.More content."), ("Reasoning here.", "Content here.</think>More content.")),
    ("", (None, None), (None, None)),
    ("</think>", (None, None), (None, None)),
    ("</think>Only an answer", (None, "Only an answer"), (None, "Only an answer")),
]


@pytest.mark.parametrize("output,qwen3,r1", CASES)
def test_whole_answers_split_as_vllm_does(output: str, qwen3: tuple, r1: tuple) -> None:
    assert split_text(QWEN3, output) == qwen3
    assert split_text(R1, output) == r1


def _stream(fmt, pieces: list[str], mode: StartMode = StartMode.THINKING) -> tuple[str | None, str | None, list]:
    splitter, deltas = ThinkSplitter(fmt, mode), []
    for p in pieces:
        deltas.append(splitter.feed(p))
    deltas.append(splitter.finish())
    reasoning = "".join(d.reasoning for d in deltas)
    content = "".join(d.content for d in deltas)
    return reasoning or None, content or None, deltas


@pytest.mark.parametrize("output", [c[0] for c in CASES])
@pytest.mark.parametrize("fmt", [QWEN3, R1], ids=["qwen3", "deepseek_r1"])
def test_any_two_or_three_pieces_stream_to_the_whole_answers_parts(fmt, output: str) -> None:
    whole = split_text(fmt, output)
    n = len(output)
    for i in range(n + 1):
        for j in range(i, n + 1, 3):   # every first cut, every third second cut: both markers get split
            reasoning, content, deltas = _stream(fmt, [output[:i], output[i:j], output[j:]])
            assert (reasoning, content) == whole, (i, j)
            leak = "</th" if "</think>" not in (whole[1] or "") else "<think"   # deepseek_r1 keeps a late one
            assert not any("<think" in d.reasoning or leak in d.content for d in deltas), (i, j)


@pytest.mark.parametrize("fmt", [QWEN3, R1], ids=["qwen3", "deepseek_r1"])
def test_character_by_character_never_releases_part_of_a_marker(fmt) -> None:
    output = "<think>Two plus two.\nSo four.</think>It is 4."
    reasoning, content, deltas = _stream(fmt, list(output))
    assert (reasoning, content) == ("Two plus two.\nSo four.", "It is 4.")
    released = [d.reasoning + d.content for d in deltas]
    assert not any(set(p) & set("</>") for p in released)   # no "<", "/" or ">" of a marker ever went out
    assert "".join(released) == "Two plus two.\nSo four.It is 4."


def test_a_lone_angle_bracket_is_held_only_until_it_cannot_be_a_marker() -> None:
    s = ThinkSplitter(QWEN3)
    assert s.feed("a <").reasoning == "a "   # "<" may open </think>
    assert s.feed("b").reasoning == "<b"     # it did not
    assert s.feed("</thi").reasoning == ""
    out = s.feed("nk>x <")
    assert (out.reasoning, out.content) == ("", "x ")   # after thinking, qwen3 still watches for </think>
    assert s.finish().content == "<"         # the output ended: what was held is text


def test_token_by_token_with_a_real_tokenizer(server_model_dir: Path) -> None:
    """SmolLM2's tokenizer has no <think> token: the markers arrive in several tokens, as from such a model."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(server_model_dir)
    output = "<think>The user greets me. I greet back.</think>Hello! How can I help?"
    ids = tok(output, add_special_tokens=False).input_ids
    pieces = [tok.decode(ids[:k + 1])[len(tok.decode(ids[:k])):] for k in range(len(ids))]
    assert "".join(pieces) == output and not any("<think>" in p or "</think>" in p for p in pieces)
    for fmt in (QWEN3, R1):
        reasoning, content, _ = _stream(fmt, pieces)
        assert (reasoning, content) == ("The user greets me. I greet back.", "Hello! How can I help?")


def test_output_that_may_open_thinking_is_answer_unless_it_does() -> None:
    """Structured outputs hold from the first token here, so such output is the answer unless it opens thinking."""
    mode = StartMode.ANSWER_MAY_THINK
    assert _stream(QWEN3, ['{"a": 1}'], mode)[:2] == (None, '{"a": 1}')
    assert _stream(QWEN3, ["<thi", "nk>x</thi", "nk>y"], mode)[:2] == ("x", "y")
    assert _stream(R1, ["a <think>b</think>c"], mode)[:2] == ("b", "a c")
    assert _stream(R1, ["x</think>y"], mode)[:2] == (None, "x</think>y")   # no start marker: all answer


QWEN_PROMPT = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_where_a_requests_output_starts() -> None:
    assert plan_reasoning(None, QWEN_PROMPT) is None
    plan = plan_reasoning("qwen3", QWEN_PROMPT)
    assert plan is not None and plan.mode is StartMode.THINKING and plan.include
    assert plan_reasoning("qwen3", QWEN_PROMPT, constrained=True).mode is StartMode.ANSWER_MAY_THINK
    assert not plan_reasoning("deepseek_r1", "<｜Assistant｜><think>\n", include=False).include
    # Qwen3 with enable_thinking false: the whole output is the answer (vLLM's rule)
    assert plan_reasoning("qwen3", QWEN_PROMPT, template_kwargs={"enable_thinking": False}) is None
    assert plan_reasoning("qwen3", QWEN_PROMPT, template_kwargs={"enable_thinking": True}) is not None
    for off in (0, None, ""):   # as vLLM's qwen3 parser reads the flag: any false value turns thinking off
        assert plan_reasoning("qwen3", QWEN_PROMPT, template_kwargs={"enable_thinking": off}) is None
    # ... and so when the template closed thinking in the prompt's last turn (what enable_thinking false renders)
    assert plan_reasoning("qwen3", QWEN_PROMPT + "<think>\n\n</think>\n\n") is None
    # an earlier turn's thinking does not count, nor an opened block
    history = "<|im_start|>assistant\n<think>a</think>b<|im_end|>\n" + QWEN_PROMPT
    assert plan_reasoning("qwen3", history) is not None
    assert plan_reasoning("qwen3", QWEN_PROMPT + "<think>\n") is not None


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1", None])
def test_served_names_pass(name: str | None) -> None:
    check_reasoning_parser(name)


@pytest.mark.parametrize("name,kind", [("mistral", "vLLM's reasoning parser"), ("granite", "vLLM's reasoning parser"),
                                       ("qwen", "reasoning parser")])
def test_other_names_are_refused_naming_the_served_ones(name: str, kind: str) -> None:
    with pytest.raises(ValueError) as err:
        check_reasoning_parser(name)
    served = "served: deepseek_r1, qwen3"
    assert str(err.value) == f"--reasoning-parser {name}: {kind} '{name}' is not served here; {served}"
