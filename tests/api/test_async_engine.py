"""AsyncEngine ordering guarantees, checked against a recording stand-in engine (no model needed).

The HTTP tests cover behaviour end to end with the real engine; these pin down the loop's contract
exactly: an abort reaches the engine before its next step, the queue limit counts requests added since
the last stats snapshot, adds are all-or-nothing, and a dead loop fails everyone still waiting.
"""
from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import pytest

from pagedmodel.server.api.allocator import HeapTrimmer
from pagedmodel.server.api.async_engine import AsyncEngine, EngineDeadError, QueueFullError, SubRequest
from pagedmodel.server.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedmodel.server.engine.sampling_params import SamplingParams


@dataclass
class _Stats:
    num_waiting: int = 0


class RecordingEngine:
    """Generates one token per step per request, admits nobody when `admit` is False, logs every call."""

    def __init__(self, max_tokens: int = 1000, admit: bool = True):
        self.calls: list[tuple[str, str, float]] = []   # (what, request id, when it started)
        self.tokens: dict[str, list[int]] = {}
        self.requests: dict[str, int] = {}
        self.max_tokens = max_tokens
        self.admit = admit
        self.lock = threading.Lock()
        self.fail_step = False
        self.step_progress = []

    def add_request(self, request_id, prompt, params, *, arrival_time=None, priority=0, cache_salt=None):
        if not prompt.token_ids:   # a ProcessedPrompt (SubRequest.engine_prompt)
            raise ValueError("empty prompt")
        with self.lock:
            self.calls.append(("add", request_id, time.monotonic()))
            self.requests[request_id] = 0
            self.tokens[request_id] = []

    def abort_request(self, request_id):
        with self.lock:
            self.calls.append(("abort", request_id, time.monotonic()))
            self.requests.pop(request_id, None)

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        if self.fail_step:
            raise RuntimeError("device lost")
        with self.lock:
            self.calls.append(("step", "", time.monotonic()))
        time.sleep(0.002)
        with self.lock:
            if not self.admit:
                return []
            outs = []
            for rid in list(self.requests):
                self.requests[rid] += 1
                n = self.requests[rid]
                done = n >= self.max_tokens
                if done:
                    del self.requests[rid]
                # like the real engine: a fresh list per output, never touched again
                self.tokens[rid].append(7)
                outs.append(RequestOutput(rid, None, [1], [CompletionOutput(0, "x" * n, list(self.tokens[rid]),
                                          finish_reason="length" if done else None)], done,
                                          RequestMetrics(time.time())))
            return outs

    def stats(self):
        return _Stats(num_waiting=0 if self.admit else len(self.requests))


def sub(rid: str, prompt: list[int] | None = None) -> list[SubRequest]:
    return [SubRequest(rid, [1, 2] if prompt is None else prompt, SamplingParams(max_tokens=5), 0)]


def test_abort_reaches_the_engine_before_its_next_step() -> None:
    engine = RecordingEngine()
    ae = AsyncEngine(engine)
    ae.start()
    aborted_at: list[float] = []

    async def scenario() -> None:
        group = await ae.add(sub("r1"))
        async for _ in group.outputs():
            break   # one output seen: the request is running
        aborted_at.append(time.monotonic())
        ae.abort(group)
        await asyncio.sleep(0.2)

    try:
        asyncio.run(scenario())
    finally:
        ae.shutdown()
    abort = next(c for c in engine.calls if c[:2] == ("abort", "r1"))
    # only a step already running when abort() was called may come before the engine drops the request
    steps_between = [c for c in engine.calls if c[0] == "step" and aborted_at[0] < c[2] < abort[2]]
    assert steps_between == []
    assert "r1" not in engine.requests


def test_the_heap_is_trimmed_on_the_loop_thread_once_the_engine_goes_idle() -> None:
    engine = RecordingEngine(max_tokens=4)
    trims: list[tuple[str, int]] = []   # (thread name, requests left in the engine at the trim)
    trimmer = HeapTrimmer(lambda: trims.append((threading.current_thread().name, len(engine.requests))),
                          interval_s=3600)
    ae = AsyncEngine(engine, heap_trimmer=trimmer)
    ae.start()

    async def scenario() -> None:
        for rid in ("t1", "t2"):    # two busy periods, each ending idle
            group = await ae.add(sub(rid))
            async for _ in group.outputs():
                pass

    try:
        asyncio.run(scenario())
    finally:
        ae.shutdown()
    steps = sum(1 for c in engine.calls if c[0] == "step")
    assert steps >= 8 and trims == [("engine-loop", 0), ("engine-loop", 0)]   # not after the busy steps


def test_queue_limit_counts_adds_since_the_last_snapshot() -> None:
    engine = RecordingEngine(admit=False)    # nothing gets scheduled: everything waits
    ae = AsyncEngine(engine, max_queue_len=3, retry_after_s=7)
    ae.start()

    async def scenario() -> list[object]:
        results = []
        for i in range(5):
            try:
                results.append(await ae.add(sub(f"q{i}")))
            except QueueFullError as exc:
                results.append(exc)
        return results

    try:
        results = asyncio.run(scenario())
    finally:
        ae.shutdown()
    assert [isinstance(r, QueueFullError) for r in results] == [False, False, False, True, True]
    assert results[3].retry_after == 7 and "--max-queue-len 3" in str(results[3])
    assert sorted(engine.requests) == ["q0", "q1", "q2"]


def test_invalid_request_is_raised_to_the_caller_and_partial_groups_are_undone() -> None:
    engine = RecordingEngine()
    ae = AsyncEngine(engine)
    ae.start()
    subs = sub("ok") + [SubRequest("bad", [], SamplingParams(), 1)]

    async def scenario() -> None:
        with pytest.raises(ValueError, match="empty prompt"):
            await ae.add(subs)

    try:
        asyncio.run(scenario())
    finally:
        ae.shutdown()
    assert [c[:2] for c in engine.calls] == [("add", "ok"), ("abort", "ok")] and not engine.requests


def test_dead_loop_fails_waiting_requests_and_refuses_new_ones() -> None:
    engine = RecordingEngine()
    ae = AsyncEngine(engine)
    ae.start()

    async def scenario() -> None:
        group = await ae.add(sub("d1"))
        engine.fail_step = True
        with pytest.raises(EngineDeadError, match="RuntimeError"):
            async for _ in group.outputs():
                pass
        # the reason names the failure class; the message itself stays in the server log
        assert not ae.is_healthy and ae.dead_reason == "engine loop died (RuntimeError)"
        with pytest.raises(EngineDeadError):
            await ae.add(sub("d2"))

    try:
        asyncio.run(scenario())
    finally:
        ae.shutdown()


def test_real_engine_outputs_are_not_mutated_by_later_steps(server_model_dir) -> None:
    """AsyncEngine hands outputs to other threads as they are: the engine must not touch them afterwards."""
    from pagedmodel.server.engine.args import EngineArgs
    from pagedmodel.server.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineArgs(model=str(server_model_dir), device="cpu", max_model_len=64,
                                                   kv_cache_memory=1 << 20))
    engine.add_request("m1", [1, 2, 3], SamplingParams(max_tokens=4, n=2, temperature=1.0, seed=1, logprobs=1,
                                                       ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    snapshot = [[(len(o.token_ids), len(o.logprobs or []), o.text) for o in out.outputs] for out in outs]
    assert [[n for n, _, _ in s] for s in snapshot] == [[1, 1], [2, 2], [3, 3], [4, 4]]
    assert all(n == k for s in snapshot for n, k, _ in s)
