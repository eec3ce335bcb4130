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

Thinking budgets: a sample with ``thinking_token_budget`` has a ``ThinkingBudget`` (thinking_budget.py),
kept here too; once its budget is spent, the token it forces replaces whatever the row drew (grammar,
penalties and bias included), and its logprob is the raw model's, as any chosen token's.

Watermark (--watermark-config): a drawn row of a watermarked request carries its context's seed, and its
token is the keyed Gumbel-max choice (watermark.py) among what the same masks, penalties and truncation
leave, in place of the seeded draw; greedy and beam rows are untouched.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from pagedmodel.kernels import cpu_ops

from .penalties import apply_penalties, needs_penalties
from .random_sampling import draw
from .sampling_params import SamplingParams
from .sequence import SampleState, Sequence, SequenceGroup
from .step_types import ModelRunnerOutput, PromptLogprobs, PromptRanks, SampleResult, SamplerOutput
from .thinking_budget import ThinkingBudget, ThinkingMarkers
from .watermark import ContextHistory, context_of, context_seed, watermark_applies, watermarked_draw
from .watermark_config import WatermarkConfig


log = logging.getLogger("pagedmodel.engine")


@dataclass
class SamplingRow:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None
    banned_token_ids: tuple[int, ...] = ()   # e.g. EOS before min_tokens is reached
    matcher: Any = None                      # xgrammar.GrammarMatcher of a structured-output sample
    forced_token_id: int | None = None       # a spent thinking budget's end-marker token: drawn regardless
    watermark_seed: int | None = None        # the keyed noise's seed for this step's context (watermark.py)


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


def argmax_logsumexp(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's first argmax and log-sum-exp: the C++ op on CPU (two passes over a row, where
    log_softmax + argmax would write out and re-read the whole matrix), torch ops elsewhere."""
    op = cpu_ops.logits_stats() if logits.device.type == "cpu" else None
    if op is not None:
        return op(logits)
    logits = logits.float()   # the sum in float32 whatever the head's dtype (a no-op for float32)
    best, tokens = logits.max(dim=-1)
    finite = torch.where(torch.isfinite(best), best, torch.zeros_like(best))   # a row of -inf stays -inf, not NaN
    return tokens, finite + (logits - finite[:, None]).exp_().sum(dim=-1).log_()


def _reads_narrow_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> bool:
    """Whether ``sample`` can read a bf16 head's logits as they are: no grammar, penalty or top logprobs
    in any row, every row greedy or drawn by the CPU sampling op, and the CPU ops there to widen each row
    in cache. It then needs only the argmax, the log-sum-exp (in float32), the op's draws and the chosen
    logits, all exact from bf16; anything else gets the float32 copy first (3.9 ms of a 98 ms step at 256
    rows on one core)."""
    if logits.device.type != "cpu" or logits.dtype != torch.bfloat16 or cpu_ops.logits_stats() is None:
        return False
    draws = cpu_ops.sampling() is not None
    return all(row.matcher is None and row.params.logprobs is None and not needs_penalties(row)
               and not row.params.logit_bias and row.params.allowed_token_ids is None
               and (row.params.greedy or (draws and not row.params.use_beam_search)) for row in rows)


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampleResult]:
    """``logits`` is ``[len(rows), vocab]``, float32 or the model's dtype (widened here unless
    ``_reads_narrow_logits``), and is modified (grammar masks; penalties work on a copy). Each stage is
    batched over the rows that need it: one argmax + log-sum-exp pass over the raw logits (the greedy
    tokens of plain rows and every row's logprob normaliser), one penalty pass, one argmax for the greedy
    rows that masks or penalties changed, one truncation and draw for the random ones
    (``random_sampling.py``), one gather for the chosen logprobs and one top-k for the rows that asked for
    top logprobs."""
    if logits.dtype != torch.float32 and not _reads_narrow_logits(logits, rows):
        logits = logits.float()
    raw_argmax, logsumexp = argmax_logsumexp(logits)
    tops = _top_logprobs(logits, logsumexp, rows)           # before the grammar masks change logits
    grammar_rows = [i for i, row in enumerate(rows) if row.matcher is not None]
    raw_masked = logits[grammar_rows].clone() if grammar_rows else None   # their logprobs stay the raw model's
    constrained = _apply_grammars(logits, rows)
    raw = logits
    penalised = [i for i, row in enumerate(rows) if needs_penalties(row)]
    if penalised:
        index = torch.tensor(penalised, dtype=torch.long, device=logits.device)
        penalties = apply_penalties(logits.index_select(0, index), [rows[i] for i in penalised])
        logits = logits.index_put((index,), penalties)
    biased = [i for i, row in enumerate(rows) if row.params.logit_bias]
    if biased:
        logits = _with_logit_bias(logits, rows, biased)
    restricted = [i for i, row in enumerate(rows) if row.params.allowed_token_ids is not None]
    if restricted:
        logits = _with_allowed_tokens(logits, rows, restricted)
    tokens: list[int] = [0] * len(rows)
    greedy = [i for i, row in enumerate(rows) if row.params.greedy or row.params.use_beam_search]
    changed = set(constrained) | set(penalised) | set(biased) | set(restricted)
    plain = [i for i in greedy if i not in changed]
    if plain:
        for i, token in zip(plain, raw_argmax[plain].tolist() if len(plain) < len(rows) else raw_argmax.tolist()):
            tokens[i] = token
    if len(plain) < len(greedy):
        rest = [i for i in greedy if i in changed]
        for i, token in zip(rest, logits[rest].argmax(dim=-1).tolist()):
            tokens[i] = token
    drawn = [i for i, row in enumerate(rows) if not (row.params.greedy or row.params.use_beam_search)]
    marked = [i for i in drawn if rows[i].watermark_seed is not None]
    if marked:
        drawn = [i for i in drawn if rows[i].watermark_seed is None]
        block = logits.index_select(0, torch.tensor(marked, dtype=torch.long, device=logits.device))
        picked = watermarked_draw(block, [rows[i].params for i in marked], [rows[i].watermark_seed for i in marked])
        for i, token in zip(marked, picked):
            tokens[i] = token
    if drawn:
        block = logits   # draw() leaves it as it is: the copy is for blocks with other rows only
        if len(drawn) < len(rows):
            block = logits.index_select(0, torch.tensor(drawn, dtype=torch.long, device=logits.device))
        picked = draw(block, [rows[i].params for i in drawn], [rows[i].generator for i in drawn])
        for i, token in zip(drawn, picked):
            tokens[i] = token
    forced = {i for i, row in enumerate(rows) if row.forced_token_id is not None}
    for i in forced:   # after the draw, so a seeded row's generator advances as on any other step
        tokens[i] = rows[i].forced_token_id
    for i in constrained:
        if rows[i].matcher.accept_token(tokens[i]):
            continue
        if i in forced:   # the grammar did not allow the forced marker: it goes on from where it was
            continue
        log.warning("grammar rejected token %d; the sample continues unconstrained", tokens[i])   # all masked
        rows[i].matcher = None
    if not rows:
        return []
    index = torch.tensor(tokens, dtype=torch.long, device=raw.device)
    chosen_logits = raw.gather(1, index[:, None])[:, 0]
    if raw_masked is not None:
        chosen_logits[grammar_rows] = raw_masked.gather(1, index[grammar_rows][:, None])[:, 0]
    chosen = (chosen_logits - logsumexp).tolist()
    return [SampleResult(tokens[i], chosen[i], _with_chosen(top, tokens[i], chosen[i]))
            for i, top in enumerate(tops)]


def _with_logit_bias(logits: torch.Tensor, rows: list[SamplingRow], biased: list[int]) -> torch.Tensor:
    """A copy of ``logits`` with each biased row's ``logit_bias`` added (after grammar masks and penalties,
    before the draw, as vLLM does); the logprobs stay the raw model's. Ids past the logits are skipped:
    the server refuses them, and an offline caller's typo must not crash the batch."""
    width = logits.shape[-1]
    pairs = [(i, t, b) for i in biased for t, b in rows[i].params.logit_bias.items() if t < width]
    if not pairs:
        return logits
    r = torch.tensor([p[0] for p in pairs], dtype=torch.long, device=logits.device)
    t = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=logits.device)
    b = torch.tensor([p[2] for p in pairs], dtype=logits.dtype, device=logits.device)
    return logits.index_put((r, t), logits[r, t] + b)


def _with_allowed_tokens(logits: torch.Tensor, rows: list[SamplingRow], restricted: list[int]) -> torch.Tensor:
    """A copy of ``logits`` where each restricted row's tokens outside its ``allowed_token_ids`` are -inf
    (with logit_bias, before the draw); ids past the logits are skipped, as logit_bias's are."""
    width = logits.shape[-1]
    mask = torch.full((len(restricted), width), float("-inf"), dtype=logits.dtype, device=logits.device)
    for j, i in enumerate(restricted):
        ids = [t for t in rows[i].params.allowed_token_ids if t < width]
        mask[j, ids] = 0
    index = torch.tensor(restricted, dtype=torch.long, device=logits.device)
    return logits.index_put((index,), logits.index_select(0, index) + mask)


def _named_logprobs(logits: torch.Tensor, logsumexp: torch.Tensor, rows: list[SamplingRow],
                    out: list[dict[int, float] | None]) -> None:
    """Rows with ``logprob_token_ids``: those tokens' raw logprobs, in place of a top-k."""
    width = logits.shape[-1]
    for i, row in enumerate(rows):
        ids = [t for t in row.params.logprob_token_ids or [] if t < width]
        if row.params.logprob_token_ids is not None:
            values = (logits[i, ids] - logsumexp[i]).tolist() if ids else []
            out[i] = dict(zip(ids, values))


def _top_logprobs(logits: torch.Tensor, logsumexp: torch.Tensor,
                  rows: list[SamplingRow]) -> list[dict[int, float] | None]:
    """Per row: None, or the row's top ``logprobs`` tokens of the raw distribution (one top-k for all), or
    the tokens it named (``logprob_token_ids``)."""
    out: list[dict[int, float] | None] = [None] * len(rows)
    _named_logprobs(logits, logsumexp, rows, out)
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None and out[i] is None]
    k = max((rows[i].params.logprobs for i in wanted), default=0)
    if k:
        top = torch.topk(logits[wanted], k, dim=-1)
        values = (top.values - logsumexp[wanted][:, None]).tolist()
        for j, (i, ids) in enumerate(zip(wanted, top.indices.tolist())):
            n = rows[i].params.logprobs
            out[i] = dict(zip(ids[:n], values[j][:n]))
    for i in wanted:
        if out[i] is None:
            out[i] = {}
    return out


def _with_chosen(top: dict[int, float] | None, token: int, logprob: float) -> dict[int, float] | None:
    """The chosen token first, then the top-k (vLLM's order for a sampled token's logprobs entry)."""
    if top is None:
        return None
    entry = {token: logprob}
    entry.update((t, v) for t, v in top.items() if t != token)
    return entry


class Sampler:
    """The step's draws. It keeps no per-request state: each sample's generator, grammar matcher, thinking
    budget and watermark history live on its request (``SequenceGroup.sample_states``), made here at the
    sample's first draw, and go with the request."""

    def __init__(self, device: torch.device, eos_token_ids: set[int], thinking: ThinkingMarkers | None = None,
                 watermark: WatermarkConfig | None = None):
        self.device = device
        self.watermark = watermark
        self.eos_token_ids = eos_token_ids   # shared with the stop checker
        self.thinking = thinking             # None: no reasoning config, and no request may ask for a budget

    def sample(self, out: ModelRunnerOutput) -> SamplerOutput:
        result = SamplerOutput()
        rows: list[SamplingRow] = []
        owners: list[int] = []
        row_logits: list[int] = []
        for i, s in enumerate(out.sampled):
            group, seq = s.group, s.seq
            if group.beams is not None:
                if group.beams.offer(seq, out.logits[i]):
                    result.beams[group.request_id] = group.beams.decide()
                continue
            indices = [seq.index]
            if seq.num_output_tokens == 0 and len(group.seqs) < group.params.best_of:
                indices += range(len(group.seqs), group.params.best_of)   # samples forked off this prompt
            for index in indices:
                rows.append(self._row(group, seq, index))
                owners.append(seq.seq_id)
                row_logits.append(i)
        if rows:
            if row_logits == list(range(out.logits.shape[0])):   # one row per sequence, the usual step
                logits = out.logits   # sample() may mask it in place: nothing reads it after this
            else:
                rows_at = torch.tensor(row_logits, dtype=torch.long, device=out.logits.device)
                logits = out.logits.index_select(0, rows_at)
            for seq_id, sampled in zip(owners, sample(logits, rows)):
                result.samples.setdefault(seq_id, []).append(sampled)
        for seq_id, (s, logprobs) in out.prompt_logprobs.items():
            result.prompt_logprobs[seq_id] = (s.start, *_prompt_entries(s.seq.token_ids, s.start, logprobs,
                                                                         s.group.params.prompt_logprobs))
        return result

    def _row(self, group: SequenceGroup, seq: Sequence, index: int) -> SamplingRow:
        """The row for sample ``index`` drawn from ``seq``'s logits (a fork-to-be shares its parent's tokens)."""
        p = group.params
        state = group.sample_states.get(index)
        if state is None:
            state = group.sample_states[index] = SampleState()
        if not p.greedy and state.generator is None:
            state.generator = torch.Generator(device=self.device)
            state.generator.manual_seed((group.seed + 1_000_003 * index) % 2**63)
        if group.grammar is not None and state.matcher is None:
            import xgrammar as xgr

            state.matcher = xgr.GrammarMatcher(group.grammar)
        banned: tuple[int, ...] = ()
        if seq.num_output_tokens < p.min_tokens:
            banned = tuple(sorted((set() if p.ignore_eos else self.eos_token_ids) | set(p.stop_token_ids)))
        return SamplingRow(p, group.prompt_token_ids, seq.output_token_ids, state.generator if not p.greedy else None,
                           banned, state.matcher, forced_token_id=self._forced_token(group, seq, state),
                           watermark_seed=self._watermark_seed(group, seq, state))

    def _forced_token(self, group: SequenceGroup, seq: Sequence, state: SampleState) -> int | None:
        """The end-marker token the sample must take now, when its thinking budget is spent."""
        budget = group.params.thinking_token_budget
        if budget is None or self.thinking is None:
            return None
        if state.budget is None or state.budget.seen > seq.num_output_tokens:   # new, or its tokens went (never, today)
            state.budget = ThinkingBudget(self.thinking, budget, group.prompt_token_ids)
        state.budget.sync(seq.token_ids, seq.num_prompt_tokens)
        return state.budget.forced_token

    def _watermark_seed(self, group: SequenceGroup, seq: Sequence, state: SampleState) -> int | None:
        """The seed of this step's keyed noise, or None for an ordinary draw: an unwatermarked request, or a
        context this sample already drew from (its noise would repeat its token and its evidence)."""
        config = self.watermark
        if config is None or not watermark_applies(config, group.params):
            return None
        if state.history is None:
            state.history = ContextHistory(config, group.prompt_token_ids)
        output = seq.output_token_ids
        if state.history.repeated(output):
            return None
        return context_seed(config.key, context_of(output, config.context_width))


def _prompt_entries(token_ids: list[int], start: int, logprobs: torch.Tensor,
                    k: int | None) -> tuple[PromptLogprobs, PromptRanks]:
    """Row j (position start + j) scores prompt token start + 1 + j: its logprob, plus the top ``k``; and
    the token's rank (1 + how many tokens are more likely), which vLLM's prompt_logprobs report."""
    targets = torch.tensor(token_ids[start + 1:start + 1 + len(logprobs)], device=logprobs.device)
    chosen_t = logprobs.gather(1, targets[:, None])
    ranks = (1 + (logprobs > chosen_t).sum(dim=1)).tolist()
    chosen = chosen_t[:, 0].tolist()
    top = torch.topk(logprobs, k) if k else None
    entries = []
    for j, (token, lp) in enumerate(zip(targets.tolist(), chosen)):
        entry = {token: lp}
        if top is not None:
            entry.update({int(t): float(v) for t, v in zip(top.indices[j].tolist(), top.values[j].tolist())})
        entries.append(entry)
    return entries, ranks
