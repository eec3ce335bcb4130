"""What the engine hands back per request and step: text and tokens (whole, new, or once at the end, as the
request's output kind asks), finish state, timings; and, whatever the kind, each request's progress."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field


class RequestOutputKind(enum.Enum):
    """What each of a request's outputs holds (vLLM's kinds): the API streams DELTA and answers the rest
    FINAL_ONLY, so no step copies a request's whole output; CUMULATIVE is the engine's default."""

    CUMULATIVE = 0   # every output: all text, tokens and logprobs so far
    DELTA = 1        # every output: only what is new since the previous one (a sample with nothing new is left out)
    FINAL_ONLY = 2   # one output, when the request finishes, whole


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    # one dict per generated token: {token_id: logprob}, chosen token included; None unless asked for
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None   # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None   # the stop string or stop token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0   # prompt tokens served from the prefix cache
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_token_ranks: list[int | None] = field(default_factory=list)   # beside prompt_logprobs (None: first)


@dataclass(frozen=True)
class RequestProgress:
    """One request's news in one step, whatever its output kind (metrics read these, not the outputs)."""

    request_id: str
    new_tokens: int               # tokens appended this step, over all its samples
    finished: bool
    metrics: RequestMetrics
    num_prompt_tokens: int
    output_lengths: tuple[int, ...] = ()   # when finished: each reported sample's token count
    finish_reason: str | None = None       # when finished: the first reported sample's
