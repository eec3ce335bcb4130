"""What every tool-call parser produces: whole calls (a finished answer) and the deltas of a stream."""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Protocol


def make_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ParsedToolCall:
    name: str
    arguments: str   # JSON text of the arguments object
    id: str = field(default_factory=make_tool_call_id)


@dataclass
class ExtractedToolCalls:
    calls: list[ParsedToolCall]
    content: str | None   # what is left of the text once the calls are taken out (None when nothing)


@dataclass
class ToolCallDelta:
    """One piece of a streamed call: its first delta carries id and name, later ones argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class StreamDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)

    def extend(self, other: "StreamDelta") -> "StreamDelta":
        self.content += other.content
        self.tool_calls += other.tool_calls
        return self


class ToolStreamer(Protocol):
    """Per choice: fed the new text of each step, returns what the client may see now."""

    def feed(self, text: str) -> StreamDelta: ...

    def finish(self) -> StreamDelta: ...

    @property
    def called(self) -> bool: ...


class ToolParser(Protocol):
    """A model's own tool-call format (`--tool-call-parser`)."""

    def extract(self, text: str) -> ExtractedToolCalls: ...

    def streamer(self) -> ToolStreamer: ...
