"""Thinking-token budgets (vLLM's ``thinking_token_budget``): cap how many tokens one thinking section holds.

A sequence is *thinking* from the end of a start marker (``<think>``'s token ids) to the start of an end
marker; the prompt may open a section (a template that ends with ``<think>``) or the model may. Every token
after the start marker counts, the prompt's own included, so the count is what a reader finds between the
last start marker and the first end marker after it. When the count reaches the budget, the end marker's
tokens are forced, one per step, whatever the sampler (grammar, penalties, bias) would have drawn; after
the last one the sequence is answering again, and a later start marker opens a new section with a fresh
budget.

Pure logic over token ids: the sampler owns one ``ThinkingBudget`` per sample and asks it, each step, for
the token to force. The budget is re-read from the sequence's own tokens (``sync``), so it holds across
chunked prefill, preemption (the tokens are kept) and forks (each sample has its own).
"""
from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ThinkingMarkers:
    """Token ids that open thinking, that are forced to close it, and that close it when the model writes
    them itself (the parser's end marker; the forced end may add a transition phrase before it)."""

    start: tuple[int, ...]
    end: tuple[int, ...]
    natural_end: tuple[int, ...]

    def __post_init__(self) -> None:
        if not (self.start and self.end and self.natural_end):
            raise ValueError("thinking markers must each be at least one token")


class Phase(enum.Enum):
    ANSWERING = "answering"   # outside thinking: waiting for a start marker
    THINKING = "thinking"     # counting thinking tokens
    ENDING = "ending"         # the budget is spent: forcing the end marker, token by token


def last_index(haystack: Sequence[int], needle: Sequence[int]) -> int:
    """Where ``needle`` last starts in ``haystack``; -1 when it does not occur."""
    n = len(needle)
    target = list(needle)
    for i in range(len(haystack) - n, -1, -1):
        if list(haystack[i:i + n]) == target:
            return i
    return -1


class ThinkingBudget:
    """One sample's thinking state: fed each token the sequence gets, it says which token to force next."""

    def __init__(self, markers: ThinkingMarkers, budget: int, prompt_token_ids: Sequence[int]):
        if budget < 0:
            raise ValueError(f"a thinking budget is a non-negative token count, got {budget}")
        self.markers = markers
        self.budget = budget
        self.phase = Phase.ANSWERING
        self.count = 0          # thinking tokens in the open section (THINKING)
        self.ending_at = 0      # how many end-marker tokens have been forced (ENDING)
        self.seen = 0           # output tokens fed so far (sync's position)
        self._tail_len = max(len(markers.start), len(markers.end), len(markers.natural_end))
        self._tail: list[int] = list(prompt_token_ids[-self._tail_len:])
        self._open_from_prompt(prompt_token_ids)

    def _open_from_prompt(self, prompt: Sequence[int]) -> None:
        """A prompt whose last start marker has no end marker after it starts the output inside thinking."""
        start = last_index(prompt, self.markers.start)
        if start < 0:
            return
        after = start + len(self.markers.start)
        rest = prompt[after:]
        if last_index(rest, self.markers.natural_end) >= 0 or last_index(rest, self.markers.end) >= 0:
            return
        self._enter_thinking(len(prompt) - after)

    def _enter_thinking(self, count: int) -> None:
        self.phase, self.count = Phase.THINKING, count
        if count >= self.budget:
            self.phase, self.ending_at = Phase.ENDING, 0

    @property
    def forced_token(self) -> int | None:
        """The token the next step must produce, or None when sampling is free."""
        return self.markers.end[self.ending_at] if self.phase is Phase.ENDING else None

    def advance(self, token_id: int) -> None:
        """One token appended to the sequence (drawn or forced)."""
        self._tail.append(token_id)
        del self._tail[:-self._tail_len]
        if self.phase is Phase.ENDING:
            # a token other than the forced one (it cannot happen through the sampler) leaves the budget
            # spent: the marker is forced again from its first token
            self.ending_at = self.ending_at + 1 if token_id == self.markers.end[self.ending_at] else 0
            if self.ending_at == len(self.markers.end):
                self.phase, self.ending_at = Phase.ANSWERING, 0
            return
        if self.phase is Phase.ANSWERING:
            if self._ends_with(self.markers.start):
                self._enter_thinking(0)
        elif self._ends_with(self.markers.natural_end) or self._ends_with(self.markers.end):
            self.phase, self.count = Phase.ANSWERING, 0   # the model closed thinking itself
        else:
            # a start marker written while thinking is thinking text: the section, and its count, go on
            # (as in vLLM), so repeating the marker cannot renew the budget
            self._enter_thinking(self.count + 1)

    def sync(self, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        """Feed the output tokens appended since the last call (``token_ids`` is prompt + output)."""
        total = len(token_ids) - num_prompt_tokens
        for i in range(num_prompt_tokens + self.seen, len(token_ids)):
            self.advance(token_ids[i])
        self.seen = max(self.seen, total)

    def _ends_with(self, marker: tuple[int, ...]) -> bool:
        return len(self._tail) >= len(marker) and tuple(self._tail[-len(marker):]) == marker
