"""The records one engine step passes along, as plain data in a leaf module:

    Scheduler.schedule() -> SchedulerOutput -> ModelRunner.execute() -> ModelRunnerOutput
    -> Sampler.sample() -> SamplerOutput (SampleResult per sequence, BeamDecision per beam request)
    -> Scheduler.update_from_output() -> StepUpdate -> OutputProcessor

Each producer builds its record and each consumer reads it; neither imports the other for its type, so the
scheduler (pure Python) loads no torch and the step's modules form no import loop. Tensors appear only as
annotations here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from .beam_search import BeamHypothesis
    from .lora.adapter import LoRAAdapter
    from .sequence import Sequence, SequenceGroup


@dataclass
class ScheduledSequence:
    group: SequenceGroup
    seq: Sequence
    num_new_tokens: int
    start: int = field(init=False)       # first position computed this step
    samples: bool = field(init=False)    # this step computes the last known token: its logits give the next
    block_ids: list[int] = field(default_factory=list)   # the sequence's block table, set by schedule()
    lora_slot: int | None = None         # the slot holding its LoRA adapter's weights (None: base model)

    def __post_init__(self) -> None:
        self.start = self.seq.num_computed_tokens
        self.samples = self.start + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, cpu), done first
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)   # (cpu, device), done second
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)      # copy-on-write, done third
    lora_loads: list[tuple[int, LoRAAdapter]] = field(default_factory=list)  # (slot, adapter) to load first
    preempted: list[SequenceGroup] = field(default_factory=list)
    swapped_out: list[SequenceGroup] = field(default_factory=list)
    swapped_in: list[SequenceGroup] = field(default_factory=list)
    admitted: list[SequenceGroup] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class ModelRunnerOutput:
    sampled: list[ScheduledSequence]   # the sequences whose next token is drawn: row i of logits is sampled[i]'s
    logits: torch.Tensor               # [len(sampled), vocab], float32 or the head's dtype (the sampler widens)
    # seq_id -> (its scheduled entry, log-softmax rows from its first position): prompts that asked for
    # prompt logprobs; row j scores prompt token start + 1 + j
    prompt_logprobs: dict[int, tuple[ScheduledSequence, torch.Tensor]] = field(default_factory=dict)


@dataclass
class SampleResult:
    token_id: int
    logprob: float
    top_logprobs: dict[int, float] | None   # chosen token + the top-k, when logprobs were asked for


@dataclass
class BeamDecision:
    """One beam step of one request. ``next_beams``: (parent, token, cumulative logprob) in the new beams'
    order, a parent listed more than once is forked; ``hypotheses`` is set (and ``next_beams`` empty) when
    the search is done."""

    next_beams: list[tuple[Sequence, int, float]]
    hypotheses: list[BeamHypothesis] | None = None
    eos_token_ids: frozenset[int] = frozenset()


PromptLogprobs = list[dict[int, float]]   # one {token: logprob, top-k...} per scored prompt token
PromptRanks = list[int]                   # per scored prompt token: its rank in the distribution (1 = top)


@dataclass
class SamplerOutput:
    # seq_id -> its new token; a request's first sample with best_of > 1 has best_of results, one per
    # sample: the first is the sequence's own, the others go to the forks update_from_output makes
    samples: dict[int, list[SampleResult]] = field(default_factory=dict)
    beams: dict[str, BeamDecision] = field(default_factory=dict)                   # request_id -> beam step
    prompt_logprobs: dict[int, tuple[int, PromptLogprobs, PromptRanks]] = field(default_factory=dict)
    # seq_id -> (first scored position, entries, the prompt tokens' ranks)


@dataclass
class StepUpdate:
    """What ``update_from_output`` changed: the output processor's input."""

    touched: dict[str, SequenceGroup] = field(default_factory=dict)   # requests with news, in step order
    new_token_counts: dict[int, int] = field(default_factory=dict)    # seq_id -> tokens appended this step
    finished_beams: dict[str, BeamDecision] = field(default_factory=dict)  # request_id -> final beam decision
