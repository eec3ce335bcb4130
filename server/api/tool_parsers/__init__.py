"""Tool-call parsers by `--tool-call-parser` name: each turns a model's own call format into OpenAI
`tool_calls` (whole answers and streams)."""
from __future__ import annotations

from .base import ExtractedToolCalls, ParsedToolCall, StreamDelta, ToolCallDelta, ToolParser, ToolStreamer
from .hermes import HermesToolParser

TOOL_PARSERS: dict[str, type] = {"hermes": HermesToolParser}


def get_tool_parser(name: str) -> ToolParser:
    """The parser registered under `name`; KeyError names the known ones."""
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise KeyError(f"unknown tool-call parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}") from None


__all__ = ["ExtractedToolCalls", "ParsedToolCall", "StreamDelta", "ToolCallDelta", "ToolParser", "ToolStreamer",
           "TOOL_PARSERS", "get_tool_parser"]
