"""The scheduler alone, as pure Python: no model, no torch, its decisions read off SchedulerOutput. Running
requests' decodes come before prompt chunks, a step never exceeds its token budget, a long prompt is
prefilled in chunks, admission is first come first served, and update_from_output appends the sampled tokens
and ends a request at max_tokens. (Block accounting under random traffic: test_block_accounting.py.)"""
from __future__ import annotations

from pagedmodel.server.engine.outputs import RequestMetrics
from pagedmodel.server.engine.sampling_params import SamplingParams
from pagedmodel.server.engine.scheduler import Scheduler
from pagedmodel.server.engine.sequence import SequenceGroup
from pagedmodel.server.engine.step_types import SampleResult, SamplerOutput, SchedulerOutput
from pagedmodel.server.engine.stop_checker import StopChecker

BLOCK = 4


def scheduler(num_blocks: int = 64, budget: int = 16, max_num_seqs: int = 8) -> Scheduler:
    # no tokenizer: the stop checker then only counts tokens (no text, no stop strings)
    return Scheduler(num_blocks, BLOCK, max_num_seqs, budget, StopChecker(None, set(), max_model_len=1 << 20))


def request(rid: str, prompt_len: int, max_tokens: int = 4) -> SequenceGroup:
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    return SequenceGroup(rid, None, list(range(1, prompt_len + 1)), params, RequestMetrics(0.0))


def sample_all(sched: Scheduler, out: SchedulerOutput, token: int = 7) -> None:
    """What the model and sampler would hand back: one token for every sequence whose logits were computed."""
    samples = {s.seq.seq_id: [SampleResult(token, -0.5, None)] for s in out.scheduled if s.samples}
    sched.update_from_output(out, SamplerOutput(samples=samples))


def planned(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(s.group.request_id, s.num_new_tokens) for s in out.scheduled]


def test_a_long_prompt_is_prefilled_in_chunks_within_the_budget():
    sched = scheduler(budget=16)
    sched.add(request("long", 40))
    chunks, samples = [], []
    for step in range(3):
        out = sched.schedule(float(step))
        chunks.append(sum(n for _, n in planned(out)))
        samples.append(any(s.samples for s in out.scheduled))
        sample_all(sched, out)
    assert chunks == [16, 16, 8]
    assert samples == [False, False, True]   # logits are drawn from only once the whole prompt is in


def test_decodes_come_before_prompt_chunks_and_the_budget_holds():
    sched = scheduler(budget=10)
    sched.add(request("a", 6))
    sample_all(sched, sched.schedule(0.0))           # a's prompt, then its first token
    sched.add(request("b", 30))
    out = sched.schedule(1.0)
    assert planned(out) == [("a", 1), ("b", 9)]      # a's decode first, then as much of b as fits
    assert sum(n for _, n in planned(out)) <= 10


def test_admission_is_first_come_first_served():
    sched = scheduler(num_blocks=6, budget=64)        # 24 token slots
    for rid, n in (("first", 16), ("big", 20), ("small", 2)):
        sched.add(request(rid, n, max_tokens=2))
    out = sched.schedule(0.0)
    # "big" does not fit beside "first"; "small" would, but it may not pass the request ahead of it
    assert [rid for rid, _ in planned(out)] == ["first"]
    assert [g.request_id for g in sched.waiting] == ["big", "small"]


def test_tokens_are_appended_and_max_tokens_ends_the_request():
    sched = scheduler()
    group = request("r", 5, max_tokens=3)
    sched.add(group)
    for step in range(3):
        sample_all(sched, sched.schedule(float(step)), token=100 + step)
    assert group.seqs[0].output_token_ids == [100, 101, 102]
    assert group.is_finished and group.seqs[0].status.finish_reason == "length"
    assert not sched.running and sched.block_manager.num_free_blocks == 64   # its blocks came back at once
