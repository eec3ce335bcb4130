"""The pure parts of tool calling, no server: the Hermes parser (whole and streamed, split at every
position), the streamed reading of required/named outputs, tool validation and the Hermes prompt."""
from __future__ import annotations

import json

import pytest

from pagedmodel.server.api.errors import APIError
from pagedmodel.server.api.tool_choice_output import RequiredStreamer, NamedStreamer, extract_constrained
from pagedmodel.server.api.tool_definitions import (ToolChoice, named_schema, parse_tools, required_schema,
                                                    resolve_tool_choice)
from pagedmodel.server.api.tool_parsers import StreamDelta, get_tool_parser
from pagedmodel.server.api.tool_prompt import prepare_chat

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
SMOL_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def _reassemble(deltas: list[StreamDelta]) -> tuple[str, list[tuple[str, str, str]]]:
    """(content, [(id, name, arguments)]) the way an SDK stream accumulates deltas."""
    content = ""
    calls: dict[int, list[str]] = {}
    for d in deltas:
        content += d.content
        for c in d.tool_calls:
            if c.index not in calls:
                assert c.id is not None and c.name is not None, "a call's first delta names it"
                calls[c.index] = [c.id, c.name, ""]
            else:
                assert c.id is None and c.name is None, "id and name are sent once"
            calls[c.index][2] += c.arguments
    assert sorted(calls) == list(range(len(calls)))
    return content, [tuple(calls[i]) for i in sorted(calls)]   # type: ignore[misc]


HERMES_TEXTS = [
    # (model text, expected calls [(name, args)], expected content)
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     [("get_weather", {"city": "Paris"})], None),
    ('Let me check. <tool_call>{"name": "a", "arguments": {"x": "<b> {not} \\" ]"}}</tool_call>'
     '<tool_call>{"arguments": {"n": [1, {"m": null}]}, "name": "b"}</tool_call> Done.',
     [("a", {"x": "<b> {not} \" ]"}), ("b", {"n": [1, {"m": None}]})], "Let me check.  Done."),
    ('no calls at all, just < and <tool and <tool_cal text', [], "no calls at all, just < and <tool and <tool_cal text"),
    ('<tool_call>{"name": 3}</tool_call> and <tool_call>not json</tool_call>', [],
     '<tool_call>{"name": 3}</tool_call> and <tool_call>not json</tool_call>'),
    ('<tool_call>{"name": "f", "parameters": {"q": "é"}}', [("f", {"q": "é"})], None),   # cut off, but whole JSON
]
CUT_MID_CALL = 'ok <tool_call>{"name": "f", "argu'


@pytest.mark.parametrize("text,calls,content", HERMES_TEXTS + [(CUT_MID_CALL, [], CUT_MID_CALL)])
def test_hermes_extract(text: str, calls: list, content: str | None) -> None:
    got = get_tool_parser("hermes").extract(text)
    assert [(c.name, json.loads(c.arguments)) for c in got.calls] == calls
    assert got.content == content
    assert all(c.id.startswith("chatcmpl-tool-") for c in got.calls)
    assert len({c.id for c in got.calls}) == len(got.calls)


@pytest.mark.parametrize("text,calls,content", HERMES_TEXTS)
def test_hermes_stream_split_at_every_position_matches_extract(text: str, calls: list, content: str | None) -> None:
    for cut in range(len(text) + 1):
        for pieces in ([text[:cut], text[cut:]], [text[:cut]] + list(text[cut:])):
            s = get_tool_parser("hermes").streamer()
            deltas = [s.feed(p) for p in pieces] + [s.finish()]
            got_content, got_calls = _reassemble(deltas)
            assert [(n, json.loads(a)) for _, n, a in got_calls] == calls, (cut, pieces)
            assert (got_content.strip() or None) == content, (cut, got_content)
            assert "<tool_call>" not in got_content or content and "<tool_call>" in content
            assert s.called == bool(calls)


def test_hermes_stream_sends_the_name_before_the_arguments_end() -> None:
    s = get_tool_parser("hermes").streamer()
    d1 = s.feed('Hi <tool_call>{"name": "get_weather", "arguments": {"ci')
    assert d1.content == "Hi " and [(c.name, c.arguments) for c in d1.tool_calls] == [("get_weather", ""),
                                                                                       (None, '{"ci')]
    d2 = s.feed('ty": "Rome"}}</tool')
    assert [c.arguments for c in d2.tool_calls] == ['ty": "Rome"}'] and d2.content == ""
    assert s.feed("_call>").content == "" and s.finish().content == ""


def test_text_without_calls_is_left_as_written() -> None:
    assert get_tool_parser("hermes").extract("  Hello.\n").content == "  Hello.\n"
    assert get_tool_parser("hermes").extract("").content is None


def test_a_call_cut_off_mid_stream_was_already_announced() -> None:
    """A stream cannot take back a name it sent: the cut-off call stays a call (finish_reason says length)."""
    s = get_tool_parser("hermes").streamer()
    content, calls = _reassemble([s.feed(CUT_MID_CALL), s.finish()])
    assert content == "ok " and [(n, a) for _, n, a in calls] == [("f", "")]


def test_unknown_parser_names_the_known_ones() -> None:
    with pytest.raises(KeyError, match="hermes"):
        get_tool_parser("nope")


REQUIRED_TEXT = '[{"name": "a", "arguments": {"x": "],}"}}, {"name": "b", "arguments": {}}]'


def test_required_output_whole_and_streamed_at_every_split() -> None:
    whole = extract_constrained(ToolChoice("required"), REQUIRED_TEXT)
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == [("a", {"x": "],}"}), ("b", {})]
    assert whole.content is None
    for cut in range(len(REQUIRED_TEXT) + 1):
        s = RequiredStreamer()
        content, calls = _reassemble([s.feed(REQUIRED_TEXT[:cut]), s.feed(REQUIRED_TEXT[cut:]), s.finish()])
        assert content == "" and [(n, json.loads(a)) for _, n, a in calls] == [("a", {"x": "],}"}), ("b", {})]
    cut_off = extract_constrained(ToolChoice("required"), REQUIRED_TEXT[:30])
    assert cut_off.calls == [] and cut_off.content == REQUIRED_TEXT[:30]
    # cut by max_tokens after the first call: the finished call is kept
    first = extract_constrained(ToolChoice("required"), REQUIRED_TEXT[:-20])
    assert [(c.name, json.loads(c.arguments)) for c in first.calls] == [("a", {"x": "],}"})]
    assert first.content is None


def test_named_output_is_the_arguments() -> None:
    whole = extract_constrained(ToolChoice("named", "f"), '{"q": 1}')
    assert [(c.name, c.arguments) for c in whole.calls] == [("f", '{"q": 1}')]
    s = NamedStreamer("f")
    content, calls = _reassemble([s.feed('{"q"'), s.feed(": 1}"), s.finish()])
    assert content == "" and [(n, a) for _, n, a in calls] == [("f", '{"q": 1}')]


@pytest.mark.parametrize("tools,param", [
    ([{"type": "retrieval"}], "tools[0].type"),
    ([{"type": "function"}], "tools[0].function"),
    ([{"type": "function", "function": {"name": "has space"}}], "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "x" * 65}}], "tools[0].function.name"),
    ([WEATHER, {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                             "properties": {"a": {"type": 5}}}}}],
     "tools[1].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
     "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "description": 7}}], "tools[0].function.description"),
    ([WEATHER, WEATHER], "tools[1].function.name"),
])
def test_bad_tool_definitions_name_the_field(tools: list, param: str) -> None:
    with pytest.raises(APIError) as e:
        parse_tools(tools)
    assert e.value.status == 400 and e.value.param == param


@pytest.mark.parametrize("choice,auto,param", [
    ({"type": "function", "function": {"name": "missing"}}, True, "tool_choice"),
    ("auto", False, "tool_choice"),
    ("sometimes", True, "tool_choice"),
    ({"type": "function"}, True, "tool_choice"),
])
def test_bad_tool_choice(choice: object, auto: bool, param: str) -> None:
    with pytest.raises(APIError) as e:
        resolve_tool_choice(choice, parse_tools([WEATHER]), auto)
    assert e.value.status == 400 and e.value.param == param


def test_tool_choice_modes_and_schemas() -> None:
    tools = parse_tools([WEATHER, {"type": "function", "function": {"name": "now"}}])
    assert resolve_tool_choice(None, tools, True).mode == "auto"
    assert resolve_tool_choice(None, [], False).mode == "none"
    assert resolve_tool_choice("none", tools, False).mode == "none"
    named = resolve_tool_choice({"type": "function", "function": {"name": "now"}}, tools, False)
    assert (named.mode, named.name) == ("named", "now")
    assert named_schema(tools, "get_weather") == WEATHER["function"]["parameters"]
    schema = required_schema(tools)
    assert schema["minItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    assert schema["items"]["anyOf"][1]["properties"]["name"] == {"type": "string", "const": "now"}


def test_template_without_tools_gets_them_as_hermes_text() -> None:
    tools = parse_tools([WEATHER])
    msgs = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
            {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    out, extra = prepare_chat(msgs, tools, SMOL_TEMPLATE)
    assert extra == {}
    assert out[0]["role"] == "system" and '"name": "get_weather"' in out[0]["content"]
    assert "<tool_call>" in out[0]["content"]      # the format is explained
    assert out[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert out[3]["content"] == "<tool_response>\nsunny\n</tool_response>"
    assert all("tool_calls" not in m for m in out)
    again, _ = prepare_chat(msgs, parse_tools([WEATHER]), SMOL_TEMPLATE)
    assert again == out                              # stable: same request, same prompt
    sys_first, _ = prepare_chat([{"role": "system", "content": "Be brief."}, msgs[0]], tools, SMOL_TEMPLATE)
    assert sys_first[0]["content"].startswith("Be brief.\n\n") and len(sys_first) == 2


def test_template_that_reads_tools_gets_them_as_kwargs() -> None:
    template = "{{ tools }}{% for m in messages %}{{ m.tool_calls }}{% endfor %}"
    msgs = [{"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function",
                                                                 "function": {"name": "f", "arguments": {}}}]}]
    out, extra = prepare_chat(msgs, parse_tools([WEATHER]), template)
    assert out == msgs and extra == {"tools": [WEATHER]}
