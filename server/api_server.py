"""`pagedmodel serve`: the OpenAI-compatible HTTP API in front of one LLMEngine.

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with SSE streaming), GET /v1/models,
GET /health, GET /metrics. Request bodies are parsed by hand rather than by FastAPI so every malformed
request (wrong content type, non-UTF-8 bytes, invalid JSON, wrong types) gets a precise OpenAI-style
400/415 instead of FastAPI's 422 shape. Prompts are tokenized on a one-thread executor with the server's
own tokenizer copy, so a huge prompt never blocks the event loop and the engine thread's tokenizer is
never shared across threads.
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import hmac
import json
import logging
import math
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from pagedmodel.server.async_engine import (AsyncEngine, EngineDeadError, QueueFullError, RequestGroup,
                                            SubRequest)
from pagedmodel.server.errors import APIError, install_error_handlers, validation_message
from pagedmodel.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from pagedmodel.server.metrics import ServerMetrics
from pagedmodel.server.openai_protocol import (ChatChoiceLogprobs, ChatCompletionChoice, ChatCompletionRequest,
                                               ChatCompletionResponse, ChatCompletionStreamChoice,
                                               ChatCompletionStreamResponse, ChatResponseMessage,
                                               ChatTokenLogprob, CompletionChoice, CompletionLogprobs,
                                               CompletionRequest, CompletionResponse, CompletionStreamResponse,
                                               DeltaMessage, ModelCard, ModelList, TopLogprob, UsageInfo,
                                               random_id)
from pagedmodel.server.outputs import CompletionOutput, RequestOutput
from pagedmodel.server.sampling_params import SamplingParams, SamplingParamsError

logger = logging.getLogger("pagedmodel.server.api")

MAX_BODY_BYTES = 32 << 20   # a 32 MiB JSON body is far beyond any context window we serve
M = TypeVar("M", bound=BaseModel)


@dataclass
class ServerConfig:
    """The HTTP-only knobs; the engine's own flags live in EngineArgs."""

    served_model_name: str
    api_key: str | None = None
    log_requests: bool = False
    max_queue_len: int | None = None
    model_root: str | None = None
    retry_after_s: int = 1


class ClientDisconnected(Exception):
    """The client closed the connection before its (non-streamed) answer was ready."""


def _invalid_request_types() -> tuple[type[BaseException], ...]:
    """The engine's validation error class (a ValueError with .param), plus SamplingParamsError."""
    try:
        from pagedmodel.server.engine import InvalidRequestError
        return (InvalidRequestError, SamplingParamsError)
    except ImportError:  # the engine module is optional for the pure-protocol paths
        return (SamplingParamsError,)


class OpenAIServing:
    """Request handling shared by the endpoints: parsing, validation, tokenization, response building."""

    def __init__(self, engine: Any, config: ServerConfig, metrics: ServerMetrics | None = None):
        self.engine = engine
        self.config = config
        self.model_name = config.served_model_name
        self.max_model_len = int(engine.max_model_len)
        self.vocab_size = int(engine.vocab_size)
        # Own copies: the engine thread uses engine.tokenizer, the executor encodes, the loop decodes.
        self._enc_tokenizer = copy.deepcopy(engine.tokenizer)
        self._dec_tokenizer = copy.deepcopy(engine.tokenizer)
        self._tok_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self._token_str_cache: dict[int, str] = {}
        self.async_engine = AsyncEngine(engine, max_queue_len=config.max_queue_len,
                                        retry_after_s=config.retry_after_s)
        self.metrics = metrics or ServerMetrics(self.model_name, lambda: self.async_engine.last_stats)
        self.async_engine.observer = self.metrics
        self.draining = False
        self._invalid_types = _invalid_request_types()

    def close(self) -> None:
        self.async_engine.shutdown()
        self._tok_pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ parsing
    async def parse_body(self, request: Request, model_cls: type[M]) -> M:
        ctype = request.headers.get("content-type")
        mime = (ctype or "application/json").split(";")[0].strip().lower()
        if mime != "application/json":
            raise APIError(415, f"Content-Type must be application/json, got {ctype!r}", code="unsupported_media_type")
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            raise APIError(413, f"request body of {declared} bytes exceeds the limit of {MAX_BODY_BYTES} bytes")
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise APIError(413, f"request body exceeds the limit of {MAX_BODY_BYTES} bytes")
            chunks.append(chunk)
        raw = b"".join(chunks)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise APIError(400, f"request body is not valid UTF-8 (byte {exc.start})", code="invalid_json") from None
        if not text.strip():
            raise APIError(400, "request body is empty; expected a JSON object", code="invalid_json")

        def no_constants(name: str) -> Any:
            raise ValueError(f"{name} is not valid JSON")
        try:
            data = json.loads(text, parse_constant=no_constants)
        except json.JSONDecodeError as exc:
            raise APIError(400, f"invalid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})",
                           code="invalid_json") from None
        except (ValueError, RecursionError) as exc:
            raise APIError(400, f"invalid JSON: {exc}" if isinstance(exc, ValueError) else "invalid JSON: nested too deeply",
                           code="invalid_json") from None
        if not isinstance(data, dict):
            raise APIError(400, f"request body must be a JSON object, got {type(data).__name__}", code="invalid_json")
        try:
            return model_cls.model_validate(data)
        except ValidationError as exc:
            message, param = validation_message(list(exc.errors(include_url=False)))
            raise APIError(400, message, param=param, code="invalid_request_error") from None

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist. This server serves `{self.model_name}`.",
                           param="model", code="model_not_found")

    def check_accepting(self) -> None:
        if self.draining:
            raise APIError(503, "server is shutting down", code="shutting_down", headers={"Retry-After": "5"})
        if not self.async_engine.is_healthy:
            raise APIError(503, f"engine is not running: {self.async_engine.dead_reason}", code="engine_dead")

    # ------------------------------------------------------------------ tokenization
    async def _in_tokenizer_thread(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._tok_pool, fn)

    async def tokenize_prompt(self, prompt: str | list[int]) -> tuple[list[int], str | None]:
        if isinstance(prompt, list):
            return list(prompt), None
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError:
            # JSON allows "\ud800" escapes, but an unpaired surrogate is not text and cannot be tokenized.
            raise APIError(400, "prompt contains an unpaired UTF-16 surrogate (invalid Unicode)", param="prompt") from None
        try:
            ids = await self._in_tokenizer_thread(lambda: list(self._enc_tokenizer(prompt).input_ids))
        except Exception as exc:  # the tokenizer's own failures; the client gets the class, we keep the rest
            raise APIError(400, f"prompt could not be tokenized: {type(exc).__name__}", param="prompt") from None
        return ids, prompt

    async def render_chat(self, req: ChatCompletionRequest) -> tuple[list[int], str]:
        if not getattr(self._enc_tokenizer, "chat_template", None):
            raise APIError(400, f"model `{self.model_name}` has no chat template; use /v1/completions",
                           param="messages", code="chat_template_missing")
        messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                    for m in req.messages]

        def render() -> tuple[list[int], str]:
            text = self._enc_tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message)
            # The template already holds the special tokens (BOS, role markers): add none.
            return list(self._enc_tokenizer(text, add_special_tokens=False).input_ids), text
        try:
            return await self._in_tokenizer_thread(render)
        except Exception as exc:  # jinja TemplateError ("roles must alternate"), encode errors
            raise APIError(400, f"messages could not be rendered with the chat template: {exc}",
                           param="messages") from None

    def check_prompt(self, ids: list[int], params: SamplingParams, param: str = "prompt") -> None:
        if not ids:
            raise APIError(400, "prompt must not be empty", param=param)
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {self.vocab_size})", param=param)
        if len(ids) > self.max_model_len:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens, but the prompt "
                                f"has {len(ids)} tokens.", param=param, code="context_length_exceeded")
        if params.max_tokens is not None and len(ids) + params.max_tokens > self.max_model_len:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens; the prompt has "
                                f"{len(ids)} tokens and max_tokens is {params.max_tokens}, "
                                f"{len(ids) + params.max_tokens} in total. Lower max_tokens or the prompt.",
                           param="max_tokens", code="context_length_exceeded")
        if len(ids) >= self.max_model_len:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens and the prompt "
                                f"has {len(ids)}: no room left to generate.", param=param,
                           code="context_length_exceeded")

    def token_str(self, token_id: int) -> str:
        s = self._token_str_cache.get(token_id)
        if s is None:
            s = self._dec_tokenizer.decode([token_id])
            self._token_str_cache[token_id] = s
        return s

    # ------------------------------------------------------------------ submission
    def build_subs(self, request_id: str, prompts: list[list[int]], params: SamplingParams) -> list[SubRequest]:
        """One engine request per prompt; the engine forks its n (best_of) samples off the shared prompt."""
        return [SubRequest(f"{request_id}-{i}", ids, params, i) for i, ids in enumerate(prompts)]

    async def submit(self, subs: list[SubRequest], priority: int) -> RequestGroup:
        self.check_accepting()
        try:
            return await self.async_engine.add(subs, priority=priority)
        except QueueFullError as exc:
            raise APIError(503, str(exc), code="queue_full", headers={"Retry-After": str(exc.retry_after)}) from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="engine_dead") from None
        except self._invalid_types as exc:
            raise APIError(400, str(exc), param=getattr(exc, "param", None)) from None

    async def collect(self, group: RequestGroup, request: Request) -> dict[int, RequestOutput]:
        """Wait for every sub-request's final output; a client that disconnects aborts the group."""
        async def watch_disconnect() -> None:
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    group.queue.put_nowait((None, ClientDisconnected()))
                    return

        watcher = asyncio.create_task(watch_disconnect())
        final: dict[int, RequestOutput] = {}
        try:
            async for idx, out in group.outputs():
                final[idx] = out
        except EngineDeadError as exc:
            raise APIError(500, f"request failed: {exc}", code="engine_error") from None
        except ClientDisconnected:
            # Nobody reads this reply; 499 (nginx's "client closed request") keeps it out of 5xx stats.
            raise APIError(499, "client disconnected", code="client_disconnected") from None
        finally:
            watcher.cancel()
            self.async_engine.abort(group)   # no-op when everything finished
        return final

    def set_log_info(self, request: Request, request_id: str, prompt_tokens: int, completion_tokens: int,
                     finish: str | None) -> None:
        request.state.log_info = (f"id={request_id} prompt_tokens={prompt_tokens} "
                                  f"completion_tokens={completion_tokens} finish={finish}")


# ====================================================================== completions

async def _prepare_completion(serving: OpenAIServing, req: CompletionRequest) -> tuple[SamplingParams, list[tuple[list[int], str | None]]]:
    serving.check_model(req.model)
    try:
        params = req.to_sampling_params()
        prompts = req.prompts()
    except SamplingParamsError as exc:
        raise APIError(400, str(exc), param=exc.param) from None
    tokenized = [await serving.tokenize_prompt(p) for p in prompts]
    for ids, _ in tokenized:
        serving.check_prompt(ids, params)
    return params, tokenized


def _finite(x: float) -> float:
    # JSON has no -inf; OpenAI clients expect a number. -9999 is what "impossible" looks like in practice.
    return float(x) if math.isfinite(x) else -9999.0


def _completion_logprobs(serving: OpenAIServing, token_ids: list[int], logprobs: list[dict[int, float]] | None,
                         top_n: int, text_offset0: int) -> CompletionLogprobs:
    out = CompletionLogprobs()
    offset = text_offset0
    for tok, lp in zip(token_ids, logprobs or [{} for _ in token_ids]):
        s = serving.token_str(tok)
        out.tokens.append(s)
        out.text_offset.append(offset)
        offset += len(s)
        out.token_logprobs.append(_finite(lp[tok]) if tok in lp else None)
        top = sorted(lp.items(), key=lambda kv: -kv[1])[:top_n] if top_n > 0 else []
        out.top_logprobs.append({serving.token_str(t): _finite(v) for t, v in top})
    return out


def _prepend_prompt_logprobs(serving: OpenAIServing, prompt_ids: list[int],
                             prompt_logprobs: list[dict[int, float] | None] | None, top_n: int,
                             completion: CompletionLogprobs) -> CompletionLogprobs:
    """The echoed prompt's tokens with their logprobs (the first token has none), then the completion's."""
    entries = [e or {} for e in (prompt_logprobs or [None] * len(prompt_ids))]
    out = _completion_logprobs(serving, prompt_ids, entries, top_n, 0)
    out.top_logprobs[0] = None
    out.tokens += completion.tokens
    out.text_offset += completion.text_offset
    out.token_logprobs += completion.token_logprobs
    out.top_logprobs += completion.top_logprobs
    return out


async def create_completion(serving: OpenAIServing, request: Request) -> Response:
    req = await serving.parse_body(request, CompletionRequest)
    params, tokenized = await _prepare_completion(serving, req)
    request_id = random_id("cmpl")
    group = await serving.submit(serving.build_subs(request_id, [ids for ids, _ in tokenized], params), req.priority)
    request.state.log_info = f"id={request_id}"   # completed with token counts once the reply is done
    created = int(time.time())
    if req.stream:
        return StreamingResponse(_stream_completion(serving, request, req, group, request_id, created, tokenized,
                                                    params), media_type="text/event-stream",
                                 headers=_stream_headers(request_id))

    final = await serving.collect(group, request)
    top_n = params.logprobs or 0
    choices: list[CompletionChoice] = []
    completion_tokens = 0
    for p_idx, (ids, text) in enumerate(tokenized):
        prompt_text = (text if text is not None else serving._dec_tokenizer.decode(ids)) if req.echo else ""
        for o in sorted(final[p_idx].outputs, key=lambda o: o.index):
            completion_tokens += len(o.token_ids)
            lp = None
            if req.logprobs is not None:
                lp = _completion_logprobs(serving, o.token_ids, o.logprobs, top_n, len(prompt_text))
                if req.echo:
                    lp = _prepend_prompt_logprobs(serving, ids, final[p_idx].prompt_logprobs, top_n, lp)
            choices.append(CompletionChoice(index=p_idx * params.n + o.index, text=prompt_text + o.text, logprobs=lp,
                                            finish_reason=o.finish_reason, stop_reason=o.stop_reason))
    prompt_tokens = sum(len(ids) for ids, _ in tokenized)
    usage = UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                      total_tokens=prompt_tokens + completion_tokens)
    serving.set_log_info(request, request_id, prompt_tokens, completion_tokens,
                         ",".join(sorted({c.finish_reason or "-" for c in choices})))
    resp = CompletionResponse(id=request_id, created=created, model=serving.model_name, choices=choices, usage=usage)
    return Response(resp.model_dump_json(), media_type="application/json", headers={"X-Request-Id": request_id})


def _stream_headers(request_id: str) -> dict[str, str]:
    # no-cache / X-Accel-Buffering: proxies (nginx, our router) must pass SSE chunks through unbuffered
    return {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "X-Request-Id": request_id}


def _sse(payload: BaseModel | dict[str, Any]) -> str:
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


async def _guarded_stream(serving: OpenAIServing, group: RequestGroup, body: AsyncIterator[str]) -> AsyncIterator[str]:
    """Wrap a chunk generator: abort on disconnect, report engine death in-band, always end with [DONE]."""
    try:
        async for chunk in body:
            yield chunk
    except EngineDeadError as exc:
        yield _sse(APIError(500, f"request failed: {exc}", code="engine_error").body())
    except Exception:   # headers are sent: report in-band, keep the traceback in our log
        logger.exception("error while streaming a response")
        yield _sse(APIError(500, "internal server error", code="internal_error").body())
    finally:
        # A client that went away cancels us at the await above; this frees its KV blocks before the next step.
        serving.async_engine.abort(group)
    yield "data: [DONE]\n\n"


class _DeltaTracker:
    """What each choice has already been sent, so cumulative engine outputs become stream deltas."""

    def __init__(self, n_choices: int):
        self.text = [0] * n_choices
        self.tokens = [0] * n_choices
        self.done: set[int] = set()

    def newly_finished(self, choice: int, o: CompletionOutput) -> bool:
        """True once per choice: later cumulative outputs of the group repeat finished samples."""
        if not o.finished or choice in self.done:
            return False
        self.done.add(choice)
        return True

    def advance(self, choice: int, o: CompletionOutput) -> tuple[str, list[int], list[dict[int, float]], int]:
        """The new text, token ids and logprobs since the last call, and the text offset they start at."""
        t0, k0 = self.text[choice], self.tokens[choice]
        delta = o.text[t0:]
        new_ids = o.token_ids[k0:]
        new_lp = (o.logprobs or [])[k0:]
        # The engine holds back text that may become a stop string, so text only grows; max() guards anyway.
        self.text[choice] = max(t0, len(o.text))
        self.tokens[choice] = len(o.token_ids)
        return delta, new_ids, new_lp, t0


def _stream_completion(serving: OpenAIServing, request: Request, req: CompletionRequest, group: RequestGroup,
                       request_id: str, created: int, tokenized: list[tuple[list[int], str | None]],
                       params: SamplingParams) -> AsyncIterator[str]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    model = serving.model_name
    n = params.n
    top_n = params.logprobs or 0

    async def body() -> AsyncIterator[str]:
        tracker = _DeltaTracker(len(tokenized) * n)
        echo_len = [0] * len(tokenized)
        completion_tokens = 0
        finishes: set[str] = set()

        def chunk(idx: int, text: str, lp: CompletionLogprobs | None, finish: str | None, stop: Any) -> str:
            return _sse(CompletionStreamResponse(
                id=request_id, created=created, model=model,
                choices=[CompletionChoice(index=idx, text=text, logprobs=lp, finish_reason=finish, stop_reason=stop)]))

        echo_text = [""] * len(tokenized)
        if req.echo:   # the prompt text opens every choice
            for p_idx, (ids, text) in enumerate(tokenized):
                echo_text[p_idx] = text if text is not None else serving._dec_tokenizer.decode(ids)
                echo_len[p_idx] = len(echo_text[p_idx])
                if req.logprobs is None:
                    for j in range(n):
                        yield chunk(p_idx * n + j, echo_text[p_idx], None, None, None)
        # with logprobs, the echo waits for the prompt's logprobs, which come with the first output
        echo_pending = set(range(len(tokenized))) if req.echo and req.logprobs is not None else set()
        async for p_idx, out in group.outputs():
            if p_idx in echo_pending:
                echo_pending.discard(p_idx)
                plp = _prepend_prompt_logprobs(serving, tokenized[p_idx][0], out.prompt_logprobs, top_n,
                                               CompletionLogprobs())
                for j in range(n):
                    yield chunk(p_idx * n + j, echo_text[p_idx], plp, None, None)
            for o in out.outputs:
                idx = p_idx * n + o.index
                delta, new_ids, new_lp, offset = tracker.advance(idx, o)
                finished = tracker.newly_finished(idx, o)
                lp = None
                if req.logprobs is not None and new_ids:
                    lp = _completion_logprobs(serving, new_ids, new_lp, top_n, echo_len[p_idx] + offset)
                if delta or lp is not None or finished:
                    yield chunk(idx, delta, lp, o.finish_reason if finished else None,
                                o.stop_reason if finished else None)
                if finished:
                    completion_tokens += len(o.token_ids)
                    finishes.add(o.finish_reason or "-")
        prompt_tokens = sum(len(ids) for ids, _ in tokenized)
        serving.set_log_info(request, request_id, prompt_tokens, completion_tokens, ",".join(sorted(finishes)))
        if include_usage:
            yield _sse(CompletionStreamResponse(
                id=request_id, created=created, model=model, choices=[],
                usage=UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                                total_tokens=prompt_tokens + completion_tokens)))

    return _guarded_stream(serving, group, body())


# ====================================================================== chat

def _chat_logprobs(serving: OpenAIServing, token_ids: list[int], logprobs: list[dict[int, float]] | None,
                   top_n: int) -> ChatChoiceLogprobs:
    content = []
    for tok, lp in zip(token_ids, logprobs or [{} for _ in token_ids]):
        s = serving.token_str(tok)
        top = sorted(lp.items(), key=lambda kv: -kv[1])[:top_n] if top_n > 0 else []
        content.append(ChatTokenLogprob(
            token=s, logprob=_finite(lp.get(tok, -math.inf)), bytes=list(s.encode("utf-8", "replace")),
            top_logprobs=[TopLogprob(token=serving.token_str(t), logprob=_finite(v),
                                     bytes=list(serving.token_str(t).encode("utf-8", "replace"))) for t, v in top]))
    return ChatChoiceLogprobs(content=content)


async def create_chat_completion(serving: OpenAIServing, request: Request) -> Response:
    req = await serving.parse_body(request, ChatCompletionRequest)
    serving.check_model(req.model)
    try:
        params = req.to_sampling_params()
    except SamplingParamsError as exc:
        raise APIError(400, str(exc), param=exc.param) from None
    ids, _ = await serving.render_chat(req)
    serving.check_prompt(ids, params, param="messages")
    request_id = random_id("chatcmpl")
    group = await serving.submit(serving.build_subs(request_id, [ids], params), req.priority)
    request.state.log_info = f"id={request_id}"
    created = int(time.time())
    if req.stream:
        return StreamingResponse(_stream_chat(serving, request, req, group, request_id, created, len(ids), params),
                                 media_type="text/event-stream", headers=_stream_headers(request_id))

    final = await serving.collect(group, request)
    top_n = req.top_logprobs or 0
    choices = []
    completion_tokens = 0
    for o in sorted(final[0].outputs, key=lambda o: o.index):
        completion_tokens += len(o.token_ids)
        lp = _chat_logprobs(serving, o.token_ids, o.logprobs, top_n) if req.logprobs else None
        choices.append(ChatCompletionChoice(index=o.index, message=ChatResponseMessage(content=o.text), logprobs=lp,
                                            finish_reason=o.finish_reason, stop_reason=o.stop_reason))
    usage = UsageInfo(prompt_tokens=len(ids), completion_tokens=completion_tokens,
                      total_tokens=len(ids) + completion_tokens)
    serving.set_log_info(request, request_id, len(ids), completion_tokens,
                         ",".join(sorted({c.finish_reason or "-" for c in choices})))
    resp = ChatCompletionResponse(id=request_id, created=created, model=serving.model_name, choices=choices,
                                  usage=usage)
    return Response(resp.model_dump_json(), media_type="application/json", headers={"X-Request-Id": request_id})


def _stream_chat(serving: OpenAIServing, request: Request, req: ChatCompletionRequest, group: RequestGroup,
                 request_id: str, created: int, prompt_tokens: int, params: SamplingParams) -> AsyncIterator[str]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    model = serving.model_name
    top_n = req.top_logprobs or 0

    async def body() -> AsyncIterator[str]:
        def chunk(choice: ChatCompletionStreamChoice) -> str:
            return _sse(ChatCompletionStreamResponse(id=request_id, created=created, model=model, choices=[choice]))

        # OpenAI opens every choice with a role-only delta before any content.
        for j in range(params.n):
            yield chunk(ChatCompletionStreamChoice(index=j, delta=DeltaMessage(role="assistant", content="")))
        tracker = _DeltaTracker(params.n)
        completion_tokens = 0
        finishes: set[str] = set()
        async for _, out in group.outputs():
            for o in out.outputs:
                delta, new_ids, new_lp, _ = tracker.advance(o.index, o)
                lp = _chat_logprobs(serving, new_ids, new_lp, top_n) if req.logprobs and new_ids else None
                if delta or lp is not None:
                    yield chunk(ChatCompletionStreamChoice(index=o.index, delta=DeltaMessage(content=delta), logprobs=lp))
                if tracker.newly_finished(o.index, o):
                    completion_tokens += len(o.token_ids)
                    finishes.add(o.finish_reason or "-")
                    yield chunk(ChatCompletionStreamChoice(index=o.index, delta=DeltaMessage(),
                                                           finish_reason=o.finish_reason, stop_reason=o.stop_reason))
        serving.set_log_info(request, request_id, prompt_tokens, completion_tokens, ",".join(sorted(finishes)))
        if include_usage:
            yield _sse(ChatCompletionStreamResponse(
                id=request_id, created=created, model=model, choices=[],
                usage=UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                                total_tokens=prompt_tokens + completion_tokens)))

    return _guarded_stream(serving, group, body())


# ====================================================================== app

class RequestLogMiddleware:
    """One INFO line per request once its response body is complete (streams included)."""

    def __init__(self, app: Callable[..., Awaitable[None]]):
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = [0]
        logged = [False]

        def log(note: str = "") -> None:
            logged[0] = True
            info = scope.get("state", {}).get("log_info", "")
            client = scope.get("client") or ("-", 0)
            logger.info("%s %s %s %d %.1fms %s%s", client[0], scope["method"], scope["path"], status[0],
                        (time.perf_counter() - start) * 1000, info, note)

        async def logging_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                log()
        try:
            await self.app(scope, receive, logging_send)
        finally:
            if not logged[0]:   # the body never completed: the client went away mid-stream
                log(" (client disconnected)")


def build_app(engine: Any, config: ServerConfig) -> FastAPI:
    """The FastAPI app serving `engine`; the engine loop thread runs for the app's lifespan."""
    serving = OpenAIServing(engine, config)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        serving.async_engine.start()
        try:
            yield
        finally:
            serving.close()

    app = FastAPI(title="pagedmodel", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serving = serving
    install_error_handlers(app)
    if config.log_requests:
        app.add_middleware(RequestLogMiddleware)

    def check_key(request: Request) -> None:
        if config.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), config.api_key.encode()):
            raise APIError(401, "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'.",
                           code="invalid_api_key")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        check_key(request)
        return await create_completion(serving, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        check_key(request)
        return await create_chat_completion(serving, request)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        check_key(request)
        card = ModelCard(id=serving.model_name, root=config.model_root or serving.model_name,
                         max_model_len=serving.max_model_len)
        return Response(ModelList(data=[card]).model_dump_json(), media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        if not serving.async_engine.is_healthy:
            raise APIError(503, f"engine is not running: {serving.async_engine.dead_reason}", code="engine_dead")
        if serving.draining:
            raise APIError(503, "server is shutting down", code="shutting_down")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(serving.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    return app


# ====================================================================== CLI

def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pagedmodel.server.config import EngineArgs
    EngineArgs.add_cli_args(parser)
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on /v1/* (also read from $PAGEDMODEL_API_KEY)")
    parser.add_argument("--log-requests", action="store_true", help="log one INFO line per request")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds to let in-flight requests finish after SIGTERM")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


class _GracefulServer:
    """uvicorn.Server whose SIGTERM ends the process with status 0 after draining, as Kubernetes expects."""

    def __init__(self, app: FastAPI, host: str, port: int, shutdown_timeout: float, log_level: str):
        import uvicorn
        self.config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                                     timeout_graceful_shutdown=max(0.0, shutdown_timeout), lifespan="on")
        self.server = uvicorn.Server(self.config)
        self.app = app

    def run(self) -> None:
        serving: OpenAIServing = self.app.state.serving
        orig = self.server.handle_exit

        def handle_exit(sig: int, frame: Any) -> None:
            serving.draining = True   # new requests on open connections get 503; /health turns 503
            if sig == signal.SIGTERM:
                logger.info("SIGTERM: draining in-flight requests (up to %.0fs), then exiting",
                            self.config.timeout_graceful_shutdown or 0)
            orig(sig, frame)
        self.server.handle_exit = handle_exit  # type: ignore[method-assign]
        # uvicorn re-raises the caught signal after shutdown; a no-op SIGTERM handler turns that into exit 0.
        previous = signal.signal(signal.SIGTERM, lambda *_: None)
        try:
            self.server.run()
        finally:
            signal.signal(signal.SIGTERM, previous)


def run(args: argparse.Namespace) -> int:
    import os

    from pagedmodel.server.config import ConfigError, EngineArgs

    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import faulthandler
    faulthandler.register(signal.SIGUSR1, all_threads=True)   # `kill -USR1 <pid>` dumps every thread's stack
    try:
        engine_args = EngineArgs.from_cli_args(args)
    except ConfigError as exc:
        print(f"pagedmodel serve: error: {exc}", file=sys.stderr)
        return 2
    if not 0 <= args.port <= 65535:
        print(f"pagedmodel serve: error: --port must be in [0, 65535], got {args.port}", file=sys.stderr)
        return 2
    from pagedmodel.server.engine import LLMEngine
    try:
        from pagedmodel.server.model_store import ModelNotAvailableError
    except ImportError:
        ModelNotAvailableError = ConfigError  # type: ignore[misc,assignment]  # no model store: nothing extra to catch
    try:
        engine = LLMEngine.from_engine_args(engine_args)
    except (ConfigError, ModelNotAvailableError, OSError, ValueError) as exc:
        print(f"pagedmodel serve: error: cannot load the model: {exc}", file=sys.stderr)
        return 2
    config = ServerConfig(served_model_name=engine.model_name,
                          api_key=args.api_key or os.environ.get("PAGEDMODEL_API_KEY") or None,
                          log_requests=args.log_requests, max_queue_len=engine_args.max_queue_len,
                          model_root=engine_args.model)
    app = build_app(engine, config)
    logger.info("serving %s on http://%s:%d (max_model_len %d)", engine.model_name, args.host, args.port,
                engine.max_model_len)
    _GracefulServer(app, args.host, args.port, args.shutdown_timeout, args.log_level).run()
    return 0
