"""Structured outputs on the real SmolLM2: every constrained output matches its schema / regex / choice / grammar,
unconstrained rows of a mixed batch are untouched, and bad specs are refused before they hold anything."""
from __future__ import annotations

import json
import re
from concurrent.futures import Future

import jsonschema
import pytest

from pagedmodel.server.engine.grammar_compiler import GrammarError
from pagedmodel.server.engine.llm import LLM
from pagedmodel.server.engine.sampling_params import SamplingParams, SamplingParamsError
from pagedmodel.server.engine.structured_outputs_params import StructuredOutputsParams as SO

NAME = {"type": "string", "maxLength": 12}
# (prompt, schema): held out from any tuning; strings and arrays are bounded so greedy output always closes
SCHEMAS: list[tuple[str, dict]] = [
    ("Describe a person.", {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0,
                            "maximum": 120}}, "required": ["name", "age"], "additionalProperties": False}),
    ("Rate this movie from 1 to 5.", {"type": "object", "properties": {"rating": {"type": "integer", "minimum": 1,
                                      "maximum": 5}}, "required": ["rating"]}),
    ("Is water wet?", {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"]}),
    ("Pick a primary color.", {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
                               "required": ["color"]}),
    ("List three fruits.", {"type": "object", "properties": {"fruits": {"type": "array", "items": NAME,
                            "minItems": 1, "maxItems": 3}}, "required": ["fruits"]}),
    ("Give a US zip code.", {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                             "required": ["zip"]}),
    ("Describe a city and its country.", {"type": "object", "properties": {"city": NAME, "country": {
        "type": "object", "properties": {"name": NAME, "code": {"type": "string", "pattern": "^[A-Z]{2}$"}},
        "required": ["name", "code"], "additionalProperties": False}}, "required": ["city", "country"]}),
    ("Give a temperature in Celsius.", {"type": "object", "properties": {"celsius": {"type": "number"}},
                                        "required": ["celsius"]}),
    ("Name a book and its year.", {"type": "object", "properties": {"title": NAME, "year": {
        "type": "integer", "minimum": 1400, "maximum": 2030}}, "required": ["title", "year"]}),
    ("Give a list of small numbers.", {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                                       "minItems": 2, "maxItems": 4}),
    ("What is the status of the server?", {"type": "object", "properties": {"status": {
        "enum": ["up", "down", "degraded"]}, "code": {"type": "integer", "minimum": 100, "maximum": 599}},
        "required": ["status", "code"]}),
    ("Describe a dog.", {"type": "object", "properties": {"breed": NAME, "good": {"type": "boolean"},
                         "legs": {"const": 4}}, "required": ["breed", "good", "legs"]}),
    ("Give a hex color.", {"type": "object", "properties": {"hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}},
                           "required": ["hex"]}),
    ("Make a todo item.", {"type": "object", "properties": {"task": NAME, "done": {"type": "boolean"},
                           "tags": {"type": "array", "items": {"enum": ["home", "work"]}, "maxItems": 2}},
                           "required": ["task", "done", "tags"], "additionalProperties": False}),
    ("Give a point on a plane.", {"type": "object", "properties": {"x": {"type": "integer", "minimum": -10,
                                  "maximum": 10}, "y": {"type": "integer", "minimum": -10, "maximum": 10}},
                                  "required": ["x", "y"]}),
    ("Name one planet.", {"type": "string", "enum": ["Mercury", "Venus", "Earth", "Mars"]}),
    ("Say a short greeting.", {"type": "object", "properties": {"greeting": {"type": "string", "minLength": 2,
                               "maxLength": 16}}, "required": ["greeting"]}),
    ("Describe an order.", {"type": "object", "properties": {"id": {"type": "string", "pattern": "^ORD-[0-9]{3}$"},
                            "items": {"type": "array", "items": {"type": "object", "properties": {
                                "sku": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                                "required": ["sku", "qty"], "additionalProperties": False},
                            "minItems": 1, "maxItems": 1}}, "required": ["id", "items"]}),
    ("Give a version number.", {"type": "object", "properties": {"major": {"type": "integer", "minimum": 0,
                                "maximum": 99}, "minor": {"type": "integer", "minimum": 0, "maximum": 99}},
                                "required": ["major", "minor"]}),
    ("Is it a weekday or the weekend?", {"type": "object", "properties": {"kind": {"enum": ["weekday", "weekend"]},
                                         "day": {"enum": ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"]}},
                                         "required": ["kind", "day"]}),
    ("Give a username and an email.", {"type": "object", "properties": {
        "user": {"type": "string", "pattern": "^[a-z]{3,8}$"},
        "email": {"type": "string", "pattern": "^[a-z]{2,6}@[a-z]{2,6}\\.com$"}}, "required": ["user", "email"]}),
    ("Give a matrix of bits.", {"type": "array", "items": {"type": "array", "items": {"enum": [0, 1]},
                                "minItems": 2, "maxItems": 2}, "minItems": 2, "maxItems": 2}),
]


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    return LLM(str(smollm2_dir), device="cpu", max_model_len=512, enforce_eager=True)


def chat(llm: LLM, question: str) -> str:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": question + " Answer in JSON."}],
                                             tokenize=False, add_generation_prompt=True)


def greedy(spec: SO | None, max_tokens: int = 64, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=spec, **kw)


def assert_idle(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert not llm.engine.has_unfinished_requests() and stats.num_blocks_free == stats.num_blocks_total


def test_every_schema_output_parses_and_validates(llm):
    # the schema given as a dict for half of them, as JSON text for the other half
    params = [greedy(SO(json=schema if i % 2 else json.dumps(schema))) for i, (_, schema) in enumerate(SCHEMAS)]
    outs = llm.generate([chat(llm, q) for q, _ in SCHEMAS], params)
    for (question, schema), out in zip(SCHEMAS, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (question, c.text)
        jsonschema.validate(json.loads(c.text), schema)
    assert_idle(llm)


def test_choice_regex_and_grammar(llm):
    grammar = 'root ::= "(" num " " op " " num ")"\nnum ::= [1-9]\nop ::= "+" | "-"'
    specs = [SO(choice=["yes", "no", "maybe so"]), SO(regex=r"[0-9]{4}-[0-9]{2}-[0-9]{2}"),
             SO(grammar=grammar), SO(choice=['say "hi"', "back\\slash"])]
    prompts = ["Is the sky green?", "When did the war end? Give a date.", "Write a sum.", "Greet me."]
    outs = llm.generate([chat(llm, p) for p in prompts], [greedy(s, max_tokens=24) for s in specs])
    texts = [o.outputs[0].text for o in outs]
    assert texts[0] in ("yes", "no", "maybe so")
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", texts[1])
    assert re.fullmatch(r"\([1-9] [+-] [1-9]\)", texts[2])
    assert texts[3] in ('say "hi"', "back\\slash")
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)


def test_unconstrained_rows_of_a_mixed_batch_are_untouched(llm):
    plain = [chat(llm, "Tell me about the sea."), chat(llm, "Name a famous painter.")]
    free = greedy(None, max_tokens=8, ignore_eos=True)
    alone = llm.generate(plain, free)
    mixed = llm.generate([plain[0], chat(llm, SCHEMAS[0][0]), plain[1], chat(llm, SCHEMAS[3][0])],
                         [free, greedy(SO(json=SCHEMAS[0][1]), max_tokens=8), free,
                          greedy(SO(json=SCHEMAS[3][1]), max_tokens=8)])
    assert [o.outputs[0].token_ids for o in alone] == [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids]
    assert mixed[1].outputs[0].text.startswith('{"name": "')   # the constraint did act on its own row


def test_each_of_n_samples_has_its_own_matcher(llm):
    schema = SCHEMAS[14][1]
    (out,) = llm.generate([chat(llm, SCHEMAS[14][0])], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=32,
                                                                      structured_outputs=SO(json=schema)))
    texts = [c.text for c in out.outputs]
    for text in texts:
        jsonschema.validate(json.loads(text), schema)
    assert len(set(texts)) > 1   # sampled, not four copies of one matcher's path


def test_max_tokens_cut_reports_length_and_ignore_eos_still_ends(llm):
    spec = SO(json=SCHEMAS[0][1])
    cut, ended = llm.generate([chat(llm, SCHEMAS[0][0])] * 2, [greedy(spec, max_tokens=5),
                                                              greedy(spec, ignore_eos=True)])
    assert cut.outputs[0].finish_reason == "length" and len(cut.outputs[0].token_ids) == 5
    assert ended.outputs[0].finish_reason == "stop"
    jsonschema.validate(json.loads(ended.outputs[0].text), SCHEMAS[0][1])


@pytest.mark.parametrize("spec, message", [
    (SO(regex="a(b"), "invalid regex"), (SO(grammar="root ::= missing"), "invalid grammar"),
    (SO(json={"type": "wat"}), "invalid JSON schema")])
def test_a_spec_that_does_not_compile_raises_and_holds_nothing(llm, spec, message):
    with pytest.raises(SamplingParamsError, match=message) as info:
        llm.generate([chat(llm, "hi"), chat(llm, "there")], [greedy(None), greedy(spec)])
    assert info.value.param == "structured_outputs"
    assert_idle(llm)


@pytest.mark.parametrize("kwargs, param", [
    (dict(regex="a", choice=["a"]), "structured_outputs"), (dict(), "structured_outputs"),
    (dict(choice=[]), "structured_outputs"), (dict(json="{not json"), "structured_outputs"),
    (dict(json_object="yes"), "structured_outputs"), (dict(regex="", param="guided_regex"), "guided_regex")])
def test_malformed_specs_name_their_field(kwargs, param):
    with pytest.raises(SamplingParamsError) as info:
        SO(**kwargs)
    assert info.value.param == param


def test_beam_search_and_min_tokens_do_not_combine_with_a_grammar():
    with pytest.raises(SamplingParamsError, match="beam search"):
        SamplingParams(use_beam_search=True, n=2, temperature=0, structured_outputs=SO(json_object=True))
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(min_tokens=2, structured_outputs=SO(json_object=True))
    assert info.value.param == "min_tokens"


def test_a_schema_compiles_once(llm):
    grammars = llm.engine.grammars
    first = grammars.compile(SO(json={"type": "object", "properties": {"k": {"type": "integer"}}}))
    again = grammars.compile(SO(json='{"type": "object", "properties": {"k": {"type": "integer"}}}',
                                param="response_format"))
    assert first is again


def test_a_request_waits_for_its_grammar_without_holding_up_others(llm, monkeypatch):
    """The engine admits a request once its grammar is compiled; a late compile error ends it "abort".
    (Also the json_object form: any JSON object.)"""
    engine = llm.engine
    pending: list[Future] = [Future(), Future()]
    specs = iter(pending)
    monkeypatch.setattr(engine.grammars, "compile", lambda spec, _seen={}: _seen.setdefault(id(spec), next(specs)))
    good, bad = SO(json_object=True), SO(regex="x")
    engine.add_request("so-waits", chat(llm, "Describe a car."), greedy(good, max_tokens=40))
    engine.add_request("so-fails", chat(llm, "hi"), greedy(bad))
    engine.add_request("so-plain", chat(llm, "hi"), greedy(None, max_tokens=3, ignore_eos=True))
    finished = {}
    while "so-plain" not in finished:   # the plain request finishes while both grammars are still pending
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert set(finished) == {"so-plain"}
    monkeypatch.undo()
    pending[0].set_result(engine.grammars.result(good))
    pending[1].set_exception(GrammarError("invalid regex: test"))
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert finished["so-fails"].outputs[0].finish_reason == "abort"
    # the request ran under its grammar once it compiled: a whole object if the model closed it within
    # max_tokens, else an object's beginning (whether it closes is the model's verbosity, which moves
    # with bf16 rounding; grammar conformance itself is tested above)
    waited = finished["so-waits"].outputs[0]
    if waited.finish_reason == "stop":
        assert isinstance(json.loads(waited.text), dict)
    else:
        assert waited.finish_reason == "length" and waited.text.lstrip().startswith("{")
        assert len(waited.token_ids) == 40
    assert_idle(llm)
