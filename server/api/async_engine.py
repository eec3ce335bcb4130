"""The async front of the engine: one background thread steps it, asyncio handlers await their outputs.

The engine is not thread-safe, so only the loop thread ever touches it. Handlers read the RequestOutputs
on the event loop while the engine runs on: this relies on the engine handing out objects it never
mutates afterwards (LLMEngine builds fresh lists for every step's outputs; tests/api checks that),
which spares a second O(sequence length) copy per request per step here. Handlers talk to that thread
through a command queue (add / abort) and get their outputs back on per-request asyncio queues, posted
with `call_soon_threadsafe`. Commands are drained before every step, so an abort (a client that went
away) frees its KV blocks before the next forward pass. If a step raises, the loop stops for good:
every pending request fails with EngineDeadError and `is_healthy` turns false (/health answers 503).
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from pagedmodel.server.engine.engine_client import EngineClient
from pagedmodel.server.engine.input_processor import ProcessedPrompt, check_cache_salt
from pagedmodel.server.engine.outputs import RequestOutput, RequestProgress
from pagedmodel.server.engine.sampling_params import SamplingParams

from .allocator import HeapTrimmer

logger = logging.getLogger("pagedmodel.server.api.async_engine")


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (crashed or shut down); the request cannot complete."""


class QueueFullError(RuntimeError):
    """The waiting queue is at --max-queue-len; the client should retry later (HTTP 503)."""

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


class StepObserver(Protocol):
    """Called on the loop thread; metrics use it. Must be cheap and must not raise."""

    def on_step(self, progress: list[RequestProgress], stats: Any, now: float) -> None: ...
    def on_abort(self, request_id: str) -> None: ...


@dataclass
class SubRequest:
    """One engine request inside an HTTP request: one prompt, with all of its n samples."""

    request_id: str
    prompt: list[int]               # token ids the handler checked (check_prompt) with these params
    params: SamplingParams
    prompt_index: int
    cache_salt: str | None = None   # prefix-cache blocks are shared only within one salt
    lora: Any = None                # the LoRA adapter it runs under (None: the base model)
    embeds: Any = None              # a PromptEmbeds: prompt positions given as embeddings (None: none)

    def engine_prompt(self) -> ProcessedPrompt:
        """The prompt as the engine takes a checked one: the handler ran ``check_prompt`` on these ids with
        these params before it submitted them (serving.py), so the engine does not check them again."""
        return ProcessedPrompt(None, list(self.prompt), check_cache_salt(self.cache_salt), self.embeds)


class RequestGroup:
    """The engine requests of one HTTP request, and the asyncio queue their outputs arrive on.

    Items are (prompt_index, RequestOutput) or (None, exception), in step order: a stream's outputs are
    deltas (each one's news), any other request's one output is whole.
    """

    def __init__(self, subs: list[SubRequest], loop: asyncio.AbstractEventLoop):
        self.subs = subs
        self.loop = loop
        self.queue: asyncio.Queue[tuple[int | None, Any]] = asyncio.Queue()
        self.unfinished = {s.request_id for s in subs}
        self.accepted: asyncio.Future[None] = loop.create_future()

    # --- called from the loop thread
    def _post(self, item: tuple[int | None, Any]) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            pass  # the event loop is closed: nobody is listening any more

    def _resolve(self, exc: BaseException | None) -> None:
        def set_result() -> None:
            if self.accepted.done():
                return
            if exc is None:
                self.accepted.set_result(None)
            else:
                self.accepted.set_exception(exc)
        try:
            self.loop.call_soon_threadsafe(set_result)
        except RuntimeError:
            pass

    # --- called from handlers
    @property
    def finished(self) -> bool:
        return not self.unfinished

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Yield (prompt_index, output) until every sub-request has finished."""
        while self.unfinished:
            idx, item = await self.queue.get()
            if idx is None:
                raise item
            if item.finished:
                self.unfinished.discard(item.request_id)
            yield idx, item


def _deliver(items: list[tuple[RequestGroup, tuple[int, RequestOutput]]]) -> None:
    for group, item in items:
        group.queue.put_nowait(item)


def _settle_call(cmd: "_Call", ok: bool, value: Any) -> None:
    def settle() -> None:
        if not cmd.future.done():
            (cmd.future.set_result if ok else cmd.future.set_exception)(value)
    try:
        cmd.loop.call_soon_threadsafe(settle)
    except RuntimeError:
        pass  # the caller's event loop is closed


@dataclass
class _Add:
    group: RequestGroup
    priority: int
    arrival_time: float


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _Call:
    """Run `fn(engine)` on the loop thread between steps (read-only inspection, e.g. /debug/kv_blocks)."""
    fn: Callable[[Any], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]


class AsyncEngine:
    """Runs `engine` on a background thread; `add` / `abort` are called from the asyncio loop."""

    def __init__(self, engine: EngineClient, *, max_queue_len: int | None = None,
                 observer: StepObserver | None = None, retry_after_s: int = 1,
                 heap_trimmer: HeapTrimmer | None = None):
        self.engine = engine
        self.heap_trimmer = heap_trimmer   # called between steps, on this thread (allocator.py says why)
        self.max_queue_len = max_queue_len
        self.observer = observer
        self.retry_after_s = retry_after_s
        self._commands: queue.SimpleQueue[_Add | _Abort | _Call | None] = queue.SimpleQueue()
        self._groups: dict[str, RequestGroup] = {}   # engine request id -> its group (loop thread only)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._dead: BaseException | None = None
        self.last_stats: Any = None
        self._waiting_since_stats = 0
        self.steps = 0

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._thread is not None:
            return
        self.last_stats = self._safe_stats()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop thread; requests still pending fail with EngineDeadError."""
        self._stop.set()
        self._commands.put(None)
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_healthy(self) -> bool:
        return self._dead is None and self._thread is not None and self._thread.is_alive()

    @property
    def dead_reason(self) -> str | None:
        """Client-facing: names the failure class only; the full error is in the server log."""
        if isinstance(self._dead, EngineDeadError):
            return str(self._dead)
        if self._dead is not None:
            return f"engine loop died ({type(self._dead).__name__})"
        if self._thread is None or not self._thread.is_alive():
            return "engine loop is not running"
        return None

    # ------------------------------------------------------------------ handler side
    async def add(self, subs: list[SubRequest], *, priority: int = 0,
                  arrival_time: float | None = None) -> RequestGroup:
        """Queue the sub-requests as one unit; returns once the engine accepted all of them.

        Raises the engine's validation error (all-or-nothing), QueueFullError or EngineDeadError.
        """
        if not self.is_healthy:
            raise EngineDeadError(self.dead_reason or "engine is not running")
        group = RequestGroup(subs, asyncio.get_running_loop())
        self._commands.put(_Add(group, priority, time.time() if arrival_time is None else arrival_time))
        if not self.is_healthy:
            # The loop died after the check above and may have drained the queue already: nobody
            # would ever answer this add. (_fail_all marks the loop dead before it drains.)
            group._resolve(EngineDeadError(self.dead_reason or "engine is not running"))
        try:
            await group.accepted
        except asyncio.CancelledError:
            # The handler went away while the add was queued: the abort queues behind the add, so the
            # engine drops the request right after accepting it instead of running it unobserved.
            self.abort(group)
            raise
        return group

    def abort(self, group: RequestGroup) -> None:
        """Abort whatever of the group is still running; safe to call more than once."""
        ids = sorted(group.unfinished)
        group.unfinished.clear()
        if ids and self._thread is not None:
            self._commands.put(_Abort(ids))

    async def call(self, fn: Callable[[Any], Any], timeout: float = 30.0) -> Any:
        """`fn(engine)` run on the loop thread between two steps (only that thread may touch the engine);
        its exception is raised here. EngineDeadError when the loop is not running."""
        if not self.is_healthy:
            raise EngineDeadError(self.dead_reason or "engine is not running")
        loop = asyncio.get_running_loop()
        cmd = _Call(fn, loop, loop.create_future())
        self._commands.put(cmd)
        return await asyncio.wait_for(cmd.future, timeout)

    # ------------------------------------------------------------------ loop thread
    def _handle_call(self, cmd: _Call) -> None:
        try:
            result, ok = cmd.fn(self.engine), True
        except Exception as exc:  # noqa: BLE001 - the caller gets it; the loop goes on
            result, ok = exc, False
        _settle_call(cmd, ok, result)

    def _safe_stats(self) -> Any:
        try:
            return self.engine.stats()
        except Exception:  # stats are best-effort; a broken stats() must not kill serving
            logger.exception("engine.stats() failed")
            return self.last_stats

    def _num_waiting(self) -> int:
        base = getattr(self.last_stats, "num_waiting", 0) or 0
        return base + self._waiting_since_stats

    def _handle_add(self, cmd: _Add) -> None:
        group = cmd.group
        if self.max_queue_len is not None and self._num_waiting() >= self.max_queue_len:
            group._resolve(QueueFullError(
                f"server overloaded: {self._num_waiting()} requests are waiting "
                f"(--max-queue-len {self.max_queue_len}); retry later", self.retry_after_s))
            return
        added: list[str] = []
        try:
            for sub in group.subs:
                lora = {"lora_request": sub.lora} if sub.lora is not None else {}
                self.engine.add_request(sub.request_id, sub.engine_prompt(), sub.params, arrival_time=cmd.arrival_time,
                                        priority=cmd.priority, **lora)
                added.append(sub.request_id)
                self._groups[sub.request_id] = group
        except Exception as exc:  # validation errors reach the handler; partial groups are undone
            for rid in added:
                self._groups.pop(rid, None)
                self.engine.abort_request(rid)
            group._resolve(exc)
            return
        self._waiting_since_stats += len(added)
        group._resolve(None)

    def _handle_abort(self, cmd: _Abort) -> None:
        for rid in cmd.request_ids:
            if self._groups.pop(rid, None) is not None:
                self.engine.abort_request(rid)
                if self.observer is not None:
                    self.observer.on_abort(rid)

    def _drain(self, block: bool) -> bool:
        """Apply queued commands; blocks for the first one when idle. False once shutdown was asked."""
        try:
            cmd = self._commands.get(block=block, timeout=0.5 if block else None)
        except queue.Empty:
            return not self._stop.is_set()
        while True:
            if cmd is None or self._stop.is_set():
                return False
            if isinstance(cmd, _Add):
                self._handle_add(cmd)
            elif isinstance(cmd, _Call):
                self._handle_call(cmd)
            else:
                self._handle_abort(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
        if not self.engine.has_unfinished_requests():
            # No step will follow to refresh the gauges (e.g. the last request was just aborted).
            self._refresh_stats()
        return True

    def _refresh_stats(self) -> None:
        self.last_stats = self._safe_stats()
        self._waiting_since_stats = 0

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._drain(block=not self.engine.has_unfinished_requests()):
                    break
                if not self.engine.has_unfinished_requests():
                    continue
                outputs = self.engine.step()
                self.steps += 1
                now = time.time()
                self._refresh_stats()
                if self.observer is not None:
                    try:
                        self.observer.on_step(self.engine.step_progress, self.last_stats, now)
                    except Exception:
                        logger.exception("metrics observer failed")
                # One wake-up of the event loop per step, not one per request (each is a self-pipe write).
                batches: dict[asyncio.AbstractEventLoop, list[tuple[RequestGroup, tuple[int, RequestOutput]]]] = {}
                for out in outputs:
                    group = self._groups.get(out.request_id)
                    if group is None:
                        continue  # aborted while this step ran
                    if out.finished:
                        del self._groups[out.request_id]
                    idx = next(s.prompt_index for s in group.subs if s.request_id == out.request_id)
                    batches.setdefault(group.loop, []).append((group, (idx, out)))
                for loop, items in batches.items():
                    try:
                        loop.call_soon_threadsafe(_deliver, items)
                    except RuntimeError:
                        pass  # that event loop is closed: nobody is listening any more
                if self.heap_trimmer is not None:   # after the outputs are on their way: a trim takes ms
                    self.heap_trimmer.after_step(idle=not self.engine.has_unfinished_requests())
            reason: BaseException = EngineDeadError("server is shutting down")
        except BaseException as exc:  # noqa: BLE001 - the loop must report any death, then stop
            logger.exception("engine loop died")
            self._dead = exc
            reason = EngineDeadError(f"engine loop died: {type(exc).__name__}")
        self._fail_all(reason)

    def _fail_all(self, reason: BaseException) -> None:
        if self._dead is None:
            self._dead = reason   # before draining: add() relies on this order
        groups = {id(g): g for g in self._groups.values()}
        self._groups.clear()
        # Requests still in the command queue never reached the engine; tell their handlers too.
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Add):
                cmd.group._resolve(reason)
            elif isinstance(cmd, _Call):
                _settle_call(cmd, False, reason)
        for g in groups.values():
            g._resolve(reason)
            g._post((None, reason))

