"""A request (SequenceGroup) and its sequences: the token state the scheduler and engine share."""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .outputs import RequestMetrics
from .sampling_params import SamplingParams

if TYPE_CHECKING:
    from .lora.adapter import LoRAAdapter
    from .prompt_embeds import PromptEmbeds


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH,
                        SequenceStatus.FINISHED_ABORTED)

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.finished else None


_seq_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One token stream. ``num_computed_tokens`` of its tokens have their K/V in the cache."""

    token_ids: list[int]
    num_prompt_tokens: int
    index: int = 0                      # position among the request's samples
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    cumulative_logprob: float = 0.0
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    output_text: str = ""
    stop_reason: int | str | None = None
    # incremental detokenization state (see detokenizer.py)
    prefix_offset: int = 0
    read_offset: int = 0
    # what the output processor has handed out: a DELTA output holds only what lies beyond
    sent_text_len: int = 0
    sent_tokens: int = 0
    sent_finish: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_token(self, token_id: int, logprob: float, top_logprobs: dict[int, float] | None) -> None:
        self.token_ids.append(token_id)
        self.cumulative_logprob += logprob
        if top_logprobs is not None:
            self.output_logprobs.append(top_logprobs)

    def fork(self, index: int) -> "Sequence":
        """A child sharing everything computed so far (its KV blocks are shared by the block manager)."""
        child = Sequence(list(self.token_ids), self.num_prompt_tokens, index=index,
                         num_computed_tokens=self.num_computed_tokens, status=self.status,
                         cumulative_logprob=self.cumulative_logprob,
                         output_logprobs=list(self.output_logprobs), output_text=self.output_text,
                         prefix_offset=self.prefix_offset, read_offset=self.read_offset)
        return child


_arrival_order = itertools.count()


@dataclass(eq=False)
class SampleState:
    """One sample's sampling state, made by the sampler at its first draw and kept on its request (through
    preemption; a fork-to-be of ``best_of`` has its own before its Sequence exists): its seeded generator,
    grammar matcher, thinking budget and watermark history, each None when the request needs none."""

    generator: Any = None   # torch.Generator (seeded per sample)
    matcher: Any = None     # xgrammar.GrammarMatcher
    budget: Any = None      # ThinkingBudget
    history: Any = None     # watermark ContextHistory


@dataclass(eq=False)
class SequenceGroup:
    """One request: its prompt, parameters, sequences (``n``/``best_of`` samples) and timings."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    priority: int = 0                   # as in vLLM: lower value = served earlier
    seed: int = 0                       # the request's seed, or one drawn by the engine
    cache_salt: bytes = b""             # isolates this request's prefix-cache entries (e.g. per tenant)
    lora: LoRAAdapter | None = None     # the adapter it runs under (None: the base model)
    prompt_embeds: PromptEmbeds | None = None   # prompt positions fed embedding rows, not tokens' (prompt_embeds.py)
    seqs: list[Sequence] = field(default_factory=list)
    arrival_seq: int = field(default_factory=lambda: next(_arrival_order))
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, float] | None] | None = None   # filled when params.prompt_logprobs is set
    prompt_token_ranks: list[int | None] = field(default_factory=list)   # beside prompt_logprobs: each token's rank
    prompt_logprobs_sent: bool = False   # a DELTA request's prompt logprobs ride on its first output only
    # the request's own sampling state, which goes with it when it finishes or is aborted
    grammar: Any = None                 # xgrammar.CompiledGrammar of a structured-output request
    beams: Any = None                   # the BeamGroup of a beam-search request
    sample_states: dict[int, SampleState] = field(default_factory=dict)   # per sample index

    def __post_init__(self) -> None:
        if not self.seqs:
            self.seqs = [Sequence(list(self.prompt_token_ids), len(self.prompt_token_ids))]

    @property
    def sort_key(self) -> tuple[int, int]:
        """Queue order: priority first, then arrival (preempted requests keep their place)."""
        return (self.priority, self.arrival_seq)

    def unfinished_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.is_finished]

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)
