"""POST /v1/chat/completions/batch (vLLM's): several conversations in one request, each answered as its own
chat completion; the answer has one choice per conversation, indexed in the order they came."""
from __future__ import annotations

import time
from typing import Annotated

from fastapi import Request
from fastapi.responses import Response
from pydantic import Field

from .chat import build_choice, prepare_chat, reasoning_token_count
from .errors import APIError
from .protocol import (MAX_MESSAGES, MAX_PROMPTS_PER_REQUEST, ChatCompletionRequest, ChatCompletionResponse,
                       ChatMessage, random_id)
from .serving import OpenAIServing


class BatchChatCompletionRequest(ChatCompletionRequest):
    """The chat request's fields, with ``messages`` a list of conversations."""
    messages: Annotated[list[Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]],
                        Field(min_length=1, max_length=MAX_PROMPTS_PER_REQUEST)]   # type: ignore[assignment]


def _refuse_unbatchable(batch: BatchChatCompletionRequest) -> None:
    """What vLLM's batch endpoint does not take either: each would need an answer shape of its own."""
    for refused, param, why in ((batch.stream, "stream", "a batch is answered whole, not streamed"),
                                (batch.tools, "tools", "a batch does not take tools"),
                                (batch.use_beam_search, "use_beam_search", "a batch does not take beam search"),
                                (batch.n != 1, "n", "a batch answers each conversation once: n must be 1")):
        if refused:
            raise APIError(400, why, param=param)


async def create_chat_batch(serving: OpenAIServing, request: Request) -> Response:
    batch = await serving.parse_body(request, BatchChatCompletionRequest)
    _refuse_unbatchable(batch)
    fields = {k: getattr(batch, k) for k in ChatCompletionRequest.model_fields}
    requests = [ChatCompletionRequest.model_construct(**{**fields, "messages": conversation})
                for conversation in batch.messages]
    prepared = [await prepare_chat(serving, req) for req in requests]   # any 400 before the engine sees one
    params = prepared[0].params
    request_id = random_id("chatcmplbatch")
    subs = serving.build_subs(request_id, [p.ids for p in prepared], params, batch.cache_salt, prepared[0].lora,
                              [p.embeds for p in prepared])
    group = await serving.submit(subs, batch.priority)
    final = await serving.collect(group, request)
    choices, reasoning = [], []
    for i, (req, p) in enumerate(zip(requests, prepared)):
        choice, thought = build_choice(serving, req, final[i].outputs[0], p.plan, params, p.thinking)
        choices.append(choice.model_copy(update={"index": i}))
        reasoning.append(thought)
    prompt_tokens = sum(len(p.ids) for p in prepared)
    completion_tokens = sum(len(out.outputs[0].token_ids) for out in final.values())
    usage = serving.usage(prompt_tokens, completion_tokens, sum(out.num_cached_tokens for out in final.values()),
                          reasoning_tokens=reasoning_token_count(serving, reasoning))
    serving.set_log_info(request, request_id, prompt_tokens, completion_tokens,
                         ",".join(sorted({c.finish_reason or "-" for c in choices})))
    resp = ChatCompletionResponse(id=request_id, created=int(time.time()), model=batch.model or serving.model_name,
                                  choices=choices, usage=usage)
    return Response(resp.model_dump_json(), media_type="application/json", headers={"X-Request-Id": request_id})
