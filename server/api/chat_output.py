"""How one chat choice's text becomes its message: with --reasoning-parser the thinking part is split off
first, and only the rest (the answer) goes to the tool-call parser, as in vLLM; whole answers and streams."""
from __future__ import annotations

from .protocol import DeltaMessage
from .reasoning import ReasoningPlan, Split, ThinkSplitter
from .tool_calling import ToolPlan, delta_message
from .tool_parsers import ExtractedToolCalls, ToolStreamer


def split_choice(text: str, tools: ToolPlan, reasoning: ReasoningPlan | None) -> tuple[str | None, ExtractedToolCalls]:
    """(reasoning, the answer's content and tool calls) of a finished choice."""
    if reasoning is None:
        return None, tools.extract(text)
    splitter = reasoning.splitter()
    part = splitter.feed(text) + splitter.finish()
    extracted = tools.extract(part.content)
    if not extracted.content:
        extracted.content = None   # vLLM's: an answer that was all thinking has null content
    return part.reasoning or None, extracted


class ChoiceStream:
    """Per streamed choice: each step's new text as a delta of reasoning, content and tool calls."""

    def __init__(self, tools: ToolPlan, reasoning: ReasoningPlan | None):
        self.tools: ToolStreamer | None = tools.streamer()
        self.splitter: ThinkSplitter | None = reasoning.splitter() if reasoning is not None else None
        self.reasoning_text = ""   # all of it so far, for usage's reasoning_tokens

    @property
    def called(self) -> bool:
        return self.tools is not None and self.tools.called

    def step(self, text: str, finished: bool) -> DeltaMessage:
        """``finished``: the choice's last text; whatever the parsers still held back is released with it."""
        if self.splitter is None:
            part = Split(content=text)
        else:
            part = self.splitter.feed(text)
            if finished:
                part = part + self.splitter.finish()
            self.reasoning_text += part.reasoning
        if self.tools is None:
            # without a reasoning parser the text passes as it is (an empty step too: it may carry logprobs)
            content = part.content if self.splitter is None else part.content or None
            return DeltaMessage(content=content, reasoning=part.reasoning or None)
        news = self.tools.feed(part.content)
        delta = delta_message(news.extend(self.tools.finish()) if finished else news)
        delta.reasoning = part.reasoning or None
        return delta
