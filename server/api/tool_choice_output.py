"""The output of `tool_choice: "required"` or a named function, which structured outputs constrain:
a JSON array of `{"name", "arguments"}` objects (required) or the named function's arguments object itself.
Read whole (a finished answer) or as a stream of `tool_calls` deltas.
"""
from __future__ import annotations

import json

from .tool_call_scan import scan_call_array
from .tool_definitions import ToolChoice
from .tool_parsers.base import ExtractedToolCalls, ParsedToolCall, StreamDelta, ToolCallDelta, make_tool_call_id
from .tool_parsers.call_deltas import CallDeltas


def _complete_items(text: str) -> list[object]:
    """The call objects of the array: all of them, or those complete before max_tokens cut it off
    (a small model may repeat a call until the limit; the calls it finished are still valid)."""
    try:
        items = json.loads(text)
        return items if isinstance(items, list) else []
    except ValueError:
        pass
    out: list[object] = []
    for scan in scan_call_array(text) or []:
        if scan.complete:
            try:
                out.append({"name": scan.name, "arguments": json.loads(scan.arguments)})
            except ValueError:
                break
    return out


def extract_constrained(choice: ToolChoice, text: str) -> ExtractedToolCalls:
    """The calls of a finished constrained answer; text with no complete call stays content."""
    if choice.mode == "named":
        assert choice.name is not None
        return ExtractedToolCalls([ParsedToolCall(choice.name, text)], None)
    calls = [ParsedToolCall(it["name"], json.dumps(it["arguments"], ensure_ascii=False))
             for it in _complete_items(text)
             if isinstance(it, dict) and isinstance(it.get("name"), str) and isinstance(it.get("arguments"), dict)]
    return ExtractedToolCalls(calls, None) if calls else ExtractedToolCalls([], text or None)


class NamedStreamer:
    """The whole output is the arguments: the first delta names the function, every later one extends it."""

    def __init__(self, name: str):
        self.name = name
        self._id: str | None = None

    @property
    def called(self) -> bool:
        return self._id is not None

    def feed(self, text: str) -> StreamDelta:
        if self._id is None:
            self._id = make_tool_call_id()
            return StreamDelta(tool_calls=[ToolCallDelta(0, id=self._id, name=self.name, arguments=text)])
        return StreamDelta(tool_calls=[ToolCallDelta(0, arguments=text)] if text else [])

    def finish(self) -> StreamDelta:
        return self.feed("") if self._id is None else StreamDelta()


class RequiredStreamer:
    """The array of calls, rescanned as it grows; each call announced once its name is complete."""

    def __init__(self) -> None:
        self._text = ""
        self._deltas = CallDeltas()

    @property
    def called(self) -> bool:
        return self._deltas.count > 0

    def feed(self, text: str) -> StreamDelta:
        self._text += text
        out = StreamDelta()
        for i, scan in enumerate(scan_call_array(self._text) or []):
            out.tool_calls += self._deltas.update(i, scan)
        return out

    def finish(self) -> StreamDelta:
        return StreamDelta()


def constrained_streamer(choice: ToolChoice) -> NamedStreamer | RequiredStreamer:
    return NamedStreamer(choice.name) if choice.mode == "named" and choice.name else RequiredStreamer()
