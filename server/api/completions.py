"""POST /v1/completions: prompts (text, token ids, or lists of either) in, completions out, whole or streamed."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from pagedmodel.server.engine.sampling_params import SamplingParams, SamplingParamsError
from .async_engine import RequestGroup
from .errors import APIError
from .logprobs import completion_logprobs, prepend_prompt_logprobs
from .protocol import (CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse,
                       CompletionStreamResponse, UsageInfo, random_id)
from .serving import OpenAIServing
from .structured_outputs import ensure_compiled
from .streaming import DeltaTracker, guarded_stream, sse, stream_headers, usage_chunk


async def prepare_completion(serving: OpenAIServing, req: CompletionRequest
                             ) -> tuple[SamplingParams, list[tuple[list[int], str | None]], Any]:
    """Sampling params, the tokenized prompts, and the LoRA adapter ``model`` names (None: the base model)."""
    lora = serving.check_model(req.model)
    try:
        params = req.to_sampling_params()
        prompts = req.prompts()
    except SamplingParamsError as exc:
        raise APIError(400, str(exc), param=exc.param) from None
    tokenized = [await serving.tokenize_prompt(p) for p in prompts]
    for ids, _ in tokenized:
        serving.check_prompt(ids, params)
    await ensure_compiled(serving, params)
    return params, tokenized, lora


async def create_completion(serving: OpenAIServing, request: Request) -> Response:
    req = await serving.parse_body(request, CompletionRequest)
    params, tokenized, lora = await prepare_completion(serving, req)
    request_id = random_id("cmpl")
    subs = serving.build_subs(request_id, [ids for ids, _ in tokenized], params, req.cache_salt, lora)
    group = await serving.submit(subs, req.priority)
    request.state.log_info = f"id={request_id}"   # completed with token counts once the reply is done
    created = int(time.time())
    if req.stream:
        return StreamingResponse(stream_completion(serving, request, req, group, request_id, created, tokenized,
                                                    params), media_type="text/event-stream",
                                 headers=stream_headers(request_id))

    final = await serving.collect(group, request)
    top_n = params.logprobs or 0
    choices: list[CompletionChoice] = []
    completion_tokens = 0
    for p_idx, (ids, text) in enumerate(tokenized):
        prompt_text = (text if text is not None else serving.decode(ids)) if req.echo else ""
        for o in sorted(final[p_idx].outputs, key=lambda o: o.index):
            completion_tokens += len(o.token_ids)
            lp = None
            if req.logprobs is not None:
                lp = completion_logprobs(serving, o.token_ids, o.logprobs, top_n, len(prompt_text))
                if req.echo:
                    lp = prepend_prompt_logprobs(serving, ids, final[p_idx].prompt_logprobs, top_n, lp)
            choices.append(CompletionChoice(index=p_idx * params.n + o.index, text=prompt_text + o.text, logprobs=lp,
                                            finish_reason=o.finish_reason, stop_reason=o.stop_reason))
    prompt_tokens = sum(len(ids) for ids, _ in tokenized)
    usage = UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                      total_tokens=prompt_tokens + completion_tokens)
    serving.set_log_info(request, request_id, prompt_tokens, completion_tokens,
                         ",".join(sorted({c.finish_reason or "-" for c in choices})))
    resp = CompletionResponse(id=request_id, created=created, model=req.model or serving.model_name, choices=choices,
                              usage=usage)
    return Response(resp.model_dump_json(), media_type="application/json", headers={"X-Request-Id": request_id})

def stream_completion(serving: OpenAIServing, request: Request, req: CompletionRequest, group: RequestGroup,
                       request_id: str, created: int, tokenized: list[tuple[list[int], str | None]],
                       params: SamplingParams) -> AsyncIterator[str]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    model = req.model or serving.model_name
    n = params.n
    top_n = params.logprobs or 0

    async def body() -> AsyncIterator[str]:
        tracker = DeltaTracker(len(tokenized) * n)
        echo_len = [0] * len(tokenized)
        completion_tokens = 0
        finishes: set[str] = set()

        def chunk(idx: int, text: str, lp: CompletionLogprobs | None, finish: str | None, stop: Any) -> str:
            return sse(CompletionStreamResponse(
                id=request_id, created=created, model=model,
                choices=[CompletionChoice(index=idx, text=text, logprobs=lp, finish_reason=finish, stop_reason=stop)]))

        echo_text = [""] * len(tokenized)
        if req.echo:   # the prompt text opens every choice
            for p_idx, (ids, text) in enumerate(tokenized):
                echo_text[p_idx] = text if text is not None else serving.decode(ids)
                echo_len[p_idx] = len(echo_text[p_idx])
                if req.logprobs is None:
                    for j in range(n):
                        yield chunk(p_idx * n + j, echo_text[p_idx], None, None, None)
        # with logprobs, the echo waits for the prompt's logprobs, which come with the first output
        echo_pending = set(range(len(tokenized))) if req.echo and req.logprobs is not None else set()
        async for p_idx, out in group.outputs():
            if p_idx in echo_pending:
                echo_pending.discard(p_idx)
                plp = prepend_prompt_logprobs(serving, tokenized[p_idx][0], out.prompt_logprobs, top_n,
                                               CompletionLogprobs())
                for j in range(n):
                    yield chunk(p_idx * n + j, echo_text[p_idx], plp, None, None)
            for o in out.outputs:
                idx = p_idx * n + o.index
                delta, new_ids, new_lp, offset = tracker.advance(idx, o)
                finished = tracker.newly_finished(idx, o)
                lp = None
                if req.logprobs is not None and new_ids:
                    lp = completion_logprobs(serving, new_ids, new_lp, top_n, echo_len[p_idx] + offset)
                if delta or lp is not None or finished:
                    yield chunk(idx, delta, lp, o.finish_reason if finished else None,
                                o.stop_reason if finished else None)
                if finished:
                    completion_tokens += len(o.token_ids)
                    finishes.add(o.finish_reason or "-")
        prompt_tokens = sum(len(ids) for ids, _ in tokenized)
        serving.set_log_info(request, request_id, prompt_tokens, completion_tokens, ",".join(sorted(finishes)))
        if include_usage:
            yield usage_chunk(CompletionStreamResponse, request_id, created, model, prompt_tokens, completion_tokens)

    return guarded_stream(serving, group, body())
