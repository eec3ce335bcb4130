"""What `--reasoning-parser` means for one chat request: where its output starts (thinking or answer),
whether the client gets the reasoning back (`include_reasoning`), and a splitter per choice."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .families import REASONING_PARSERS
from .think_markers import StartMode, ThinkFormat, ThinkSplitter


@dataclass(frozen=True)
class ReasoningPlan:
    fmt: ThinkFormat
    mode: StartMode
    include: bool   # the request's include_reasoning: false drops the reasoning (and what would reveal it)

    def splitter(self) -> ThinkSplitter:
        return ThinkSplitter(self.fmt, self.mode)


def plan_reasoning(parser_name: str | None, prompt_text: str, *, include: bool = True,
                   template_kwargs: Mapping[str, Any] | None = None,
                   constrained: bool = False) -> ReasoningPlan | None:
    """None without a parser, or when the prompt itself closed thinking: the output is all answer then."""
    if parser_name is None:
        return None
    fmt = REASONING_PARSERS[parser_name]
    if fmt.turn_start is not None and _thinking_off(fmt, prompt_text, template_kwargs or {}):
        return None
    # A structured-output grammar holds from the first token here, so the model writes no thinking unless the
    # grammar itself has the markers: such output is answer until a start marker says otherwise.
    mode = StartMode.ANSWER_MAY_THINK if constrained else StartMode.THINKING
    return ReasoningPlan(fmt, mode, include)


def _thinking_off(fmt: ThinkFormat, prompt_text: str, template_kwargs: Mapping[str, Any]) -> bool:
    """Qwen3's rule: enable_thinking false, or a last turn whose prompt already closed its thinking block."""
    if not template_kwargs.get("enable_thinking", True):   # vLLM's parser reads any false value (0, null) so
        return True
    last_turn = prompt_text.rsplit(fmt.turn_start or "", 1)[-1]
    return last_turn.rfind(fmt.end) > last_turn.rfind(fmt.start) if fmt.end in last_turn else False
