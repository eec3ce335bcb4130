"""POST /v1/chat/completions: messages rendered with the model's chat template, answers whole or streamed."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from pagedmodel.server.engine.sampling_params import SamplingParams, SamplingParamsError
from .async_engine import RequestGroup
from .errors import APIError
from .logprobs import chat_logprobs
from .protocol import (ChatCompletionChoice, ChatCompletionRequest, ChatCompletionResponse, ChatCompletionStreamChoice,
                       ChatCompletionStreamResponse, ChatResponseMessage, DeltaMessage,
                       UsageInfo, random_id)
from .serving import OpenAIServing
from .streaming import DeltaTracker, guarded_stream, sse, stream_headers, usage_chunk


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
    group = await serving.submit(serving.build_subs(request_id, [ids], params, req.cache_salt), req.priority)
    request.state.log_info = f"id={request_id}"
    created = int(time.time())
    if req.stream:
        return StreamingResponse(stream_chat(serving, request, req, group, request_id, created, len(ids), params),
                                 media_type="text/event-stream", headers=stream_headers(request_id))

    final = await serving.collect(group, request)
    top_n = req.top_logprobs or 0
    choices = []
    completion_tokens = 0
    for o in sorted(final[0].outputs, key=lambda o: o.index):
        completion_tokens += len(o.token_ids)
        lp = chat_logprobs(serving, o.token_ids, o.logprobs, top_n) if req.logprobs else None
        choices.append(ChatCompletionChoice(index=o.index, message=ChatResponseMessage(content=o.text), logprobs=lp,
                                            finish_reason=o.finish_reason, stop_reason=o.stop_reason))
    usage = UsageInfo(prompt_tokens=len(ids), completion_tokens=completion_tokens,
                      total_tokens=len(ids) + completion_tokens)
    serving.set_log_info(request, request_id, len(ids), completion_tokens,
                         ",".join(sorted({c.finish_reason or "-" for c in choices})))
    resp = ChatCompletionResponse(id=request_id, created=created, model=serving.model_name, choices=choices,
                                  usage=usage)
    return Response(resp.model_dump_json(), media_type="application/json", headers={"X-Request-Id": request_id})


def stream_chat(serving: OpenAIServing, request: Request, req: ChatCompletionRequest, group: RequestGroup,
                 request_id: str, created: int, prompt_tokens: int, params: SamplingParams) -> AsyncIterator[str]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    model = serving.model_name
    top_n = req.top_logprobs or 0

    async def body() -> AsyncIterator[str]:
        def chunk(choice: ChatCompletionStreamChoice) -> str:
            return sse(ChatCompletionStreamResponse(id=request_id, created=created, model=model, choices=[choice]))

        # OpenAI opens every choice with a role-only delta before any content.
        for j in range(params.n):
            yield chunk(ChatCompletionStreamChoice(index=j, delta=DeltaMessage(role="assistant", content="")))
        tracker = DeltaTracker(params.n)
        completion_tokens = 0
        finishes: set[str] = set()
        async for _, out in group.outputs():
            for o in out.outputs:
                delta, new_ids, new_lp, _ = tracker.advance(o.index, o)
                lp = chat_logprobs(serving, new_ids, new_lp, top_n) if req.logprobs and new_ids else None
                if delta or lp is not None:
                    yield chunk(ChatCompletionStreamChoice(index=o.index, delta=DeltaMessage(content=delta), logprobs=lp))
                if tracker.newly_finished(o.index, o):
                    completion_tokens += len(o.token_ids)
                    finishes.add(o.finish_reason or "-")
                    yield chunk(ChatCompletionStreamChoice(index=o.index, delta=DeltaMessage(),
                                                           finish_reason=o.finish_reason, stop_reason=o.stop_reason))
        serving.set_log_info(request, request_id, prompt_tokens, completion_tokens, ",".join(sorted(finishes)))
        if include_usage:
            yield usage_chunk(ChatCompletionStreamResponse, request_id, created, model, prompt_tokens,
                              completion_tokens)

    return guarded_stream(serving, group, body())
