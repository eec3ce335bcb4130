"""Splitting a model's text into its thinking part and its answer, by the markers that delimit thinking.

One splitter serves whole answers and streams alike: a whole answer is one feed and a finish, so a
stream's pieces always add up to what the same text gives unstreamed. Text that may be the start of a
marker is held back until the next piece says whether it is one, so a marker split across tokens or
deltas is never sent, in part or whole.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


@dataclass(frozen=True)
class ThinkFormat:
    """How one model family marks its thinking."""

    name: str
    start: str = "<think>"
    end: str = "</think>"
    # Markers that end thinking without the end marker and belong to the answer (Qwen3 may go straight from
    # thinking to a <tool_call>: the tool parser must still see it).
    implicit_ends: tuple[str, ...] = ()
    # An end marker after thinking has ended is dropped (Qwen3's parser absorbs a repeated </think>).
    drop_late_end: bool = False
    # The chat template's turn opener: a prompt whose last turn already closed thinking (Qwen3 with
    # enable_thinking false renders an empty <think></think>) starts the answer outside thinking.
    turn_start: str | None = None


class StartMode(Enum):
    """Where the first generated token stands."""

    THINKING = "thinking"   # the template opened thinking (or the model opens it): text is thinking until the end
    ANSWER_MAY_THINK = "answer_may_think"   # text is answer unless a start marker opens thinking first


@dataclass
class Split:
    """What one piece of text adds to each part."""

    reasoning: str = ""
    content: str = ""

    def __add__(self, other: "Split") -> "Split":
        return Split(self.reasoning + other.reasoning, self.content + other.content)


class ThinkSplitter:
    """Per choice: fed the new text of each step, returns the reasoning and content it may release now."""

    def __init__(self, fmt: ThinkFormat, mode: StartMode = StartMode.THINKING):
        self.fmt = fmt
        self.thinking = mode is StartMode.THINKING
        self.thought = self.thinking   # thinking has begun (it ends at most once)
        self._held = ""

    def feed(self, text: str) -> Split:
        buf, out = self._held + text, Split()
        self._held = ""
        while buf:
            markers = self._markers()
            hit = _earliest(buf, markers)
            if hit is None:
                keep = _partial_suffix(buf, markers)
                self._emit(out, buf[:len(buf) - keep])
                self._held = buf[len(buf) - keep:]
                break
            at, marker = hit
            self._emit(out, buf[:at])
            buf = self._take_marker(buf[at:], marker)
        return out

    def finish(self) -> Split:
        """The held text, now known to be no marker (the output ended in the middle of one)."""
        out = Split()
        self._emit(out, self._held)
        self._held = ""
        return out

    def _markers(self) -> tuple[str, ...]:
        f = self.fmt
        if self.thinking:
            return (f.start, f.end, *f.implicit_ends)
        if not self.thought:
            return (f.start,)
        return (f.end,) if f.drop_late_end else ()

    def _take_marker(self, rest: str, marker: str) -> str:
        """Act on the marker that starts ``rest``; return what is left to read."""
        f = self.fmt
        if marker == f.start and not self.thinking:   # only before any thinking: opens it
            self.thinking = self.thought = True
        elif self.thinking and marker in f.implicit_ends:
            self.thinking = False
            return rest   # the marker belongs to the answer: read it again as content
        elif self.thinking and marker == f.end:
            self.thinking = False
        # a start marker inside thinking, a late end marker: dropped
        return rest[len(marker):]

    def _emit(self, out: Split, text: str) -> None:
        if self.thinking:
            out.reasoning += text
        else:
            out.content += text


def _earliest(buf: str, markers: tuple[str, ...]) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for m in markers:
        at = buf.find(m)
        if at >= 0 and (best is None or at < best[0]):
            best = (at, m)
    return best


def _partial_suffix(buf: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of ``buf`` that is the beginning of a marker (held for the next piece)."""
    longest = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(buf)), longest, -1):
            if buf.endswith(m[:n]):
                longest = n
                break
    return longest


def split_text(fmt: ThinkFormat, text: str, mode: StartMode = StartMode.THINKING) -> tuple[str | None, str | None]:
    """A whole answer as (reasoning, content), None for an empty part (as vLLM returns them)."""
    s = ThinkSplitter(fmt, mode)
    out = s.feed(text) + s.finish()
    return out.reasoning or None, out.content or None
