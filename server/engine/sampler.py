"""Turns a step's logits into tokens: penalties, temperature, top-k/top-p/min-p, seeded draws, beam steps.

``Sampler.sample`` takes the model runner's output and returns results keyed by sequence (and beam
decisions keyed by request); it changes no sequence: the scheduler's ``update_from_output`` applies them.
Each sample draws from its own torch.Generator, so a seeded request produces the same tokens whatever
else shares its batch. Logprobs are those of the raw model distribution (before temperature and
truncation), as vLLM reports them.

Structured outputs: a constrained sample has its own grammar matcher (xgrammar), kept here with the
other per-sample state. Each step fills one token bitmask for the constrained rows only, applies it to
those rows of the batch's logits at once (before penalties, temperature and the draw; after the
logprobs, which stay the raw model's), and advances each matcher by the token drawn.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .beam_group import BeamDecision, BeamGroup
from .sampling_params import SamplingParams
from .sequence import Sequence, SequenceGroup

if TYPE_CHECKING:
    from .model_runner import ModelRunnerOutput

log = logging.getLogger("pagedmodel.engine")


@dataclass
class SamplingRow:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None
    banned_token_ids: tuple[int, ...] = ()   # e.g. EOS before min_tokens is reached
    matcher: Any = None                      # xgrammar.GrammarMatcher of a structured-output sample


@dataclass
class SampleResult:
    token_id: int
    logprob: float
    top_logprobs: dict[int, float] | None   # chosen token + the top-k, when logprobs were asked for


def _apply_penalties(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    p = row.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(row.prompt_token_ids) | set(row.output_token_ids)),
                            dtype=torch.long, device=logits.device)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and row.output_token_ids:
        out = torch.tensor(row.output_token_ids, dtype=torch.long, device=logits.device)
        counts = torch.zeros_like(logits).scatter_add_(0, out, torch.ones_like(out, dtype=logits.dtype))
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    if row.banned_token_ids:
        logits[list(row.banned_token_ids)] = float("-inf")
    return logits


def _truncate(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.min_p > 0:
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
        probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop = before >= p.top_p          # keep the smallest prefix whose mass reaches top_p
        drop[0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def _needs_processing(row: SamplingRow) -> bool:
    p = row.params
    return bool(p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty or row.banned_token_ids)


def _apply_grammars(logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
    """Mask, in place, what each constrained row's grammar forbids next; returns those rows."""
    constrained = [i for i, row in enumerate(rows) if row.matcher is not None]
    if not constrained:
        return constrained
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(rows), logits.shape[-1])
    matchers = [rows[i].matcher for i in constrained]
    if len(matchers) == 1:
        matchers[0].fill_next_token_bitmask(bitmask, constrained[0])
    else:
        xgr.BatchGrammarMatcher().batch_fill_next_token_bitmask(matchers, bitmask, constrained)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=constrained)
    return constrained


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampleResult]:
    """``logits`` is ``[len(rows), vocab]`` float32 and is modified (grammar masks). Plain greedy rows
    (no penalties, no banned tokens) share one argmax, and every row's chosen logprob is one gather:
    per-row work is left to the rows that need it (penalties, seeded draws, top logprobs)."""
    logprobs = torch.log_softmax(logits, dim=-1)
    constrained = _apply_grammars(logits, rows)
    tokens: list[int] = [0] * len(rows)
    plain = [i for i, row in enumerate(rows)
             if (row.params.greedy or row.params.use_beam_search) and not _needs_processing(row)]
    if plain:
        picked = logits[plain].argmax(dim=-1) if len(plain) < len(rows) else logits.argmax(dim=-1)
        for i, token in zip(plain, picked.tolist()):
            tokens[i] = token
    plain_set = set(plain)
    for i, row in enumerate(rows):
        if i in plain_set:
            continue
        p = row.params
        x = _apply_penalties(logits[i].clone(), row) if _needs_processing(row) else logits[i]
        if p.greedy or p.use_beam_search:
            tokens[i] = int(torch.argmax(x))
        else:
            x = _truncate(x / p.temperature, p)
            probs = torch.softmax(x, dim=-1)
            # exponential race: argmax(p / E), E ~ Exp(1), draws token i with probability p_i
            noise = torch.empty_like(probs).exponential_(generator=row.generator)
            tokens[i] = int(torch.argmax(probs / noise))
    for i in constrained:
        if not rows[i].matcher.accept_token(tokens[i]):   # only if every token was masked: nothing can follow
            log.warning("grammar rejected token %d; the sample continues unconstrained", tokens[i])
            rows[i].matcher = None
    index = torch.tensor(tokens, dtype=torch.long, device=logits.device)
    chosen = logprobs.gather(1, index[:, None])[:, 0].tolist() if rows else []
    results = []
    for i, row in enumerate(rows):
        token, top = tokens[i], None
        if row.params.logprobs is not None:
            top = {token: chosen[i]}
            if row.params.logprobs > 0:
                vals, ids = torch.topk(logprobs[i], row.params.logprobs)
                top.update({int(t): float(v) for t, v in zip(ids, vals)})
        results.append(SampleResult(token, chosen[i], top))
    return results


PromptLogprobs = list[dict[int, float]]   # one {token: logprob, top-k...} per scored prompt token


@dataclass
class SamplerOutput:
    # seq_id -> its new token; a request's first sample with best_of > 1 has best_of results, one per
    # sample: the first is the sequence's own, the others go to the forks update_from_output makes
    samples: dict[int, list[SampleResult]] = field(default_factory=dict)
    beams: dict[str, BeamDecision] = field(default_factory=dict)                   # request_id -> beam step
    prompt_logprobs: dict[int, tuple[int, PromptLogprobs]] = field(default_factory=dict)  # seq_id -> (first
    # scored position, entries)


class Sampler:
    """Per-request sampling state (seeded generators, beam searches) and the step's draws."""

    def __init__(self, device: torch.device, eos_token_ids: set[int]):
        self.device = device
        self.eos_token_ids = eos_token_ids   # shared with the stop checker
        self._generators: dict[tuple[str, int], torch.Generator] = {}   # (request, sample index)
        self._beams: dict[str, BeamGroup] = {}
        self._grammars: dict[str, Any] = {}                    # request -> xgrammar.CompiledGrammar
        self._matchers: dict[tuple[str, int], Any] = {}        # (request, sample index) -> GrammarMatcher

    def add_beam_search(self, beams: BeamGroup) -> None:
        self._beams[beams.group.request_id] = beams

    def add_grammar(self, group: SequenceGroup, compiled: Any) -> None:
        """Constrain every sample of ``group`` by ``compiled``; each sample gets its own matcher."""
        self._grammars[group.request_id] = compiled

    def drop(self, group: SequenceGroup) -> None:
        """Forget a finished or aborted request's state."""
        self._beams.pop(group.request_id, None)
        self._grammars.pop(group.request_id, None)
        for index in range(group.params.best_of):
            self._generators.pop((group.request_id, index), None)
            self._matchers.pop((group.request_id, index), None)

    def sample(self, out: "ModelRunnerOutput") -> SamplerOutput:
        result = SamplerOutput()
        rows: list[SamplingRow] = []
        owners: list[int] = []
        row_logits: list[int] = []
        for i, s in enumerate(out.sampled):
            group, seq = s.group, s.seq
            beams = self._beams.get(group.request_id)
            if beams is not None:
                if beams.offer(seq, out.logits[i]):
                    result.beams[group.request_id] = beams.decide()
                continue
            indices = [seq.index]
            if seq.num_output_tokens == 0 and len(group.seqs) < group.params.best_of:
                indices += range(len(group.seqs), group.params.best_of)   # samples forked off this prompt
            for index in indices:
                rows.append(self._row(group, seq, index))
                owners.append(seq.seq_id)
                row_logits.append(i)
        if rows:
            index = torch.tensor(row_logits, dtype=torch.long, device=out.logits.device)
            for seq_id, sampled in zip(owners, sample(out.logits.index_select(0, index), rows)):
                result.samples.setdefault(seq_id, []).append(sampled)
        for seq_id, (s, logprobs) in out.prompt_logprobs.items():
            entries = _prompt_entries(s.seq.token_ids, s.start, logprobs, s.group.params.prompt_logprobs)
            result.prompt_logprobs[seq_id] = (s.start, entries)
        return result

    def _row(self, group: SequenceGroup, seq: Sequence, index: int) -> SamplingRow:
        """The row for sample ``index`` drawn from ``seq``'s logits (a fork-to-be shares its parent's tokens)."""
        p = group.params
        gen = None
        if not p.greedy:
            gen = self._generators.get((group.request_id, index))
            if gen is None:
                gen = torch.Generator(device=self.device)
                gen.manual_seed((group.seed + 1_000_003 * index) % 2**63)
                self._generators[(group.request_id, index)] = gen
        banned: tuple[int, ...] = ()
        if seq.num_output_tokens < p.min_tokens:
            banned = tuple(sorted((set() if p.ignore_eos else self.eos_token_ids) | set(p.stop_token_ids)))
        return SamplingRow(p, group.prompt_token_ids, seq.output_token_ids, gen, banned,
                           self._matcher(group.request_id, index))

    def _matcher(self, request_id: str, index: int) -> Any:
        compiled = self._grammars.get(request_id)
        if compiled is None:
            return None
        matcher = self._matchers.get((request_id, index))
        if matcher is None:
            import xgrammar as xgr

            matcher = self._matchers[(request_id, index)] = xgr.GrammarMatcher(compiled)
        return matcher


def _prompt_entries(token_ids: list[int], start: int, logprobs: torch.Tensor, k: int | None) -> PromptLogprobs:
    """Row j (position start + j) scores prompt token start + 1 + j: its logprob, plus the top ``k``."""
    targets = torch.tensor(token_ids[start + 1:start + 1 + len(logprobs)], device=logprobs.device)
    chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
    top = torch.topk(logprobs, k) if k else None
    entries = []
    for j, (token, lp) in enumerate(zip(targets.tolist(), chosen)):
        entry = {token: lp}
        if top is not None:
            entry.update({int(t): float(v) for t, v in zip(top.indices[j].tolist(), top.values[j].tolist())})
        entries.append(entry)
    return entries
