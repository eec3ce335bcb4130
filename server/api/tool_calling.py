"""What a chat request's tools mean for one request: the mode its `tool_choice` resolves to, the output
constraint that mode adds to the sampling parameters, and how each choice's text becomes `tool_calls`.

- `none` (or no tools): plain text.
- `auto`: the model writes calls in its own format; the `--tool-call-parser` reads them back.
- `required` / a named function: structured outputs constrain the text to calls (tool_choice_output.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedmodel.server.engine.sampling_params import SamplingParams, SamplingParamsError
from pagedmodel.server.engine.structured_outputs_params import StructuredOutputsParams
from .errors import APIError
from .structured_outputs import with_structured_outputs
from .protocol import DeltaFunctionCall, DeltaMessage, DeltaToolCall, FunctionCall, ToolCall
from .tool_choice_output import constrained_streamer, extract_constrained
from .tool_definitions import FunctionTool, ToolChoice, named_schema, parse_tools, required_schema, resolve_tool_choice
from .tool_parsers import ExtractedToolCalls, StreamDelta, ToolParser, ToolStreamer, get_tool_parser


@dataclass
class ToolPlan:
    tools: list[FunctionTool]
    choice: ToolChoice
    parser: ToolParser | None = None   # set for "auto"
    parallel: bool = True              # the request's parallel_tool_calls

    def constrain(self, params: SamplingParams) -> SamplingParams:
        """The sampling parameters with the output constraint of `required` / named (unchanged otherwise)."""
        if self.choice.mode == "required":
            schema = required_schema(self.tools, self.parallel)
        elif self.choice.mode == "named":
            schema = named_schema(self.tools, self.choice.name or "")
        else:
            return params
        if params.structured_outputs is not None:
            raise APIError(400, "tool_choice 'required' or a named function cannot be combined with "
                                "response_format or structured_outputs", param="tool_choice")
        try:
            return with_structured_outputs(params, StructuredOutputsParams(json=schema, param="tool_choice"))
        except SamplingParamsError as exc:
            raise APIError(400, str(exc), param=exc.param) from None

    def extract(self, text: str) -> ExtractedToolCalls:
        if self.choice.mode in ("required", "named"):
            return extract_constrained(self.choice, text)
        if self.parser is not None:
            return self.parser.extract(text)
        return ExtractedToolCalls([], text)

    def streamer(self) -> ToolStreamer | None:
        if self.choice.mode in ("required", "named"):
            return constrained_streamer(self.choice)
        return self.parser.streamer() if self.parser is not None else None


def plan_tools(raw_tools: list[Any] | None, raw_choice: Any, parser_name: str | None,
               auto_enabled: bool, parallel: bool = True) -> ToolPlan:
    """Validate the request's tools and tool_choice (400s naming the field) into a plan."""
    tools = parse_tools(raw_tools)
    choice = resolve_tool_choice(raw_choice, tools, auto_enabled and parser_name is not None)
    parser = get_tool_parser(parser_name) if choice.mode == "auto" and parser_name else None
    return ToolPlan(tools, choice, parser, parallel)


def finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's "tool_calls" when an answer that ended by itself is calls; "length" stays "length"."""
    return "tool_calls" if called and reason == "stop" else reason


def response_tool_calls(extracted: ExtractedToolCalls) -> list[ToolCall]:
    return [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in extracted.calls]


def delta_message(d: StreamDelta) -> DeltaMessage:
    calls = [DeltaToolCall(index=c.index, id=c.id, type="function" if c.id else None,
                           function=DeltaFunctionCall(name=c.name, arguments=c.arguments))
             for c in d.tool_calls]
    return DeltaMessage(content=d.content or None, tool_calls=calls or None)
