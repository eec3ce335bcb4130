"""POST /v1/chat/completions: messages rendered with the model's chat template, answers whole or streamed;
with `tools`, answers carry `tool_calls` (tool_calling.py decides how); with --reasoning-parser, the
thinking part comes apart as `reasoning` (chat_output.py)."""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from pagedmodel.server.engine.outputs import CompletionOutput
from pagedmodel.server.engine.prompt_embeds import PromptEmbeds
from pagedmodel.server.engine.sampling_params import SamplingParams, SamplingParamsError
from . import chat_embeds
from .async_engine import RequestGroup
from .chat_output import ChoiceStream, split_choice
from .errors import APIError
from .logprobs import chat_logprobs, prompt_logprobs
from .protocol import (ChatCompletionChoice, ChatCompletionRequest, ChatCompletionResponse, ChatCompletionStreamChoice,
                       ChatCompletionStreamResponse, ChatResponseMessage, DeltaMessage, random_id)
from .reasoning import ReasoningPlan, plan_reasoning
from .serving import OpenAIServing
from .structured_outputs import ensure_compiled
from .streaming import ChoiceTotals, guarded_stream, sse, stream_headers, usage_chunk, usage_options
from .tool_calling import ToolPlan, finish_reason, plan_tools, response_tool_calls
from .tool_parsers.base import ExtractedToolCalls


@dataclass
class PreparedChat:
    """A chat request checked and rendered, ready for the engine."""
    params: SamplingParams
    plan: ToolPlan
    ids: list[int]
    thinking: ReasoningPlan | None
    lora: Any
    embeds: PromptEmbeds | None = None   # prompt_embeds content parts (chat_embeds.py)


async def prepare_chat(serving: OpenAIServing, req: ChatCompletionRequest) -> PreparedChat:
    """Every check that can refuse the request (400s naming the field), then the prompt."""
    lora = serving.check_model(req.model)
    cfg = serving.config
    plan = plan_tools(req.tools, req.tool_choice, cfg.tool_call_parser, cfg.enable_auto_tool_choice,
                      req.parallel_tool_calls)
    try:
        params = req.to_sampling_params(serving.tokenizer_size, cfg.limits.max_logprobs)
    except SamplingParamsError as exc:
        raise APIError(400, str(exc), param=exc.param) from None
    serving.check_token_ids(params)
    params = plan.constrain(params)
    await ensure_compiled(serving, params)   # a schema that cannot compile: 400 before the engine sees it
    markers, rows = await chat_embeds.load_parts(serving, req.messages)
    ids, prompt_text = await serving.render_chat(req.messages, tools=plan.tools,
                                                 add_generation_prompt=req.add_generation_prompt,
                                                 continue_final_message=req.continue_final_message,
                                                 template_kwargs=req.chat_template_kwargs)
    try:
        forwarded = req.forwarded_prompt_ids()
        req.check_embeds_parts(bool(markers))
        ids = req.truncated(ids, serving.max_model_len)
    except SamplingParamsError as exc:
        raise APIError(400, str(exc), param=exc.param) from None
    embeds = None
    if markers:
        ids, embeds = await chat_embeds.splice(serving, prompt_text, markers, rows)
    if forwarded is not None:   # vLLM's decode side of a disaggregated prefill: the prefill's own prompt
        ids = forwarded
    serving.check_prompt(ids, params, param="messages" if forwarded is None else "kv_transfer_params.prompt_token_ids")
    thinking = plan_reasoning(cfg.reasoning_parser, prompt_text, include=req.include_reasoning,
                              template_kwargs=req.chat_template_kwargs,
                              constrained=params.structured_outputs is not None)
    return PreparedChat(params, plan, ids, thinking, lora, embeds)


async def create_chat_completion(serving: OpenAIServing, request: Request,
                                 req: ChatCompletionRequest | None = None) -> Response:
    """``req``: the body already parsed (/invocations reads it to pick the endpoint)."""
    req = req or await serving.parse_body(request, ChatCompletionRequest)
    prepared = await prepare_chat(serving, req)
    params, plan, ids, thinking, lora = (prepared.params, prepared.plan, prepared.ids, prepared.thinking,
                                         prepared.lora)
    request_id = random_id("chatcmpl")
    group = await serving.submit(serving.build_subs(request_id, [ids], params, req.cache_salt, lora,
                                                    [prepared.embeds]), req.priority)
    request.state.log_info = f"id={request_id}"
    created = int(time.time())
    if req.stream:
        return StreamingResponse(stream_chat(serving, request, req, group, request_id, created, ids, params, plan,
                                             thinking),
                                 media_type="text/event-stream", headers=stream_headers(request_id))

    final = await serving.collect(group, request)
    outputs = sorted(final[0].outputs, key=lambda o: o.index)
    answers = [build_choice(serving, req, o, plan, params, thinking) for o in outputs]
    choices = [choice for choice, _ in answers]
    completion_tokens = sum(len(o.token_ids) for o in final[0].outputs)
    usage = serving.usage(len(ids), completion_tokens, final[0].num_cached_tokens,
                          reasoning_tokens=reasoning_token_count(serving, [r for _, r in answers]))
    serving.set_log_info(request, request_id, len(ids), completion_tokens,
                         ",".join(sorted({c.finish_reason or "-" for c in choices})))
    resp = ChatCompletionResponse(id=request_id, created=created, model=req.model or serving.model_name, choices=choices,
                                  usage=usage, prompt_token_ids=list(ids) if req.return_token_ids else None,
                                  prompt_logprobs=prompt_logprobs(serving, final[0], params.prompt_logprobs,
                                                                  serving.tokens_as_ids(req.return_tokens_as_token_ids)))
    return Response(resp.model_dump_json(), media_type="application/json", headers={"X-Request-Id": request_id})


def echoed_content(req: ChatCompletionRequest) -> str:
    """vLLM's chat `echo`: the last message's text when it has the answer's role (the answer's role is the
    assistant's, or with add_generation_prompt false the last message's own), so the answer continues it."""
    if not req.echo or not req.messages:
        return ""
    answer_role = "assistant" if req.add_generation_prompt else req.messages[-1].role
    last = req.messages[-1]
    return last.text() if last.role == answer_role else ""


def reasoning_token_count(serving: OpenAIServing, texts: list[str | None]) -> int | None:
    """usage's reasoning_tokens with --reasoning-parser (None without): the thinking text's token count."""
    if serving.config.reasoning_parser is None:
        return None
    return sum(serving.count_tokens(t) for t in texts if t)


def _whole_calls(extracted: ExtractedToolCalls) -> bool:
    """Whether there are calls and every one's arguments are whole JSON (max_tokens can cut them)."""
    try:
        return bool(extracted.calls) and all(isinstance(json.loads(c.arguments), dict) for c in extracted.calls)
    except ValueError:
        return False


def _hides_reasoning(thinking: ReasoningPlan | None) -> bool:
    # include_reasoning false: logprobs and token ids would spell the thinking out, so they go too (vLLM's)
    return thinking is not None and not thinking.include


def build_choice(serving: OpenAIServing, req: ChatCompletionRequest, o: CompletionOutput, plan: ToolPlan,
            params: SamplingParams, thinking: ReasoningPlan | None) -> tuple[ChatCompletionChoice, str | None]:
    """The choice, and its reasoning (counted in usage even when include_reasoning drops it)."""
    as_ids = serving.tokens_as_ids(req.return_tokens_as_token_ids)
    hide = _hides_reasoning(thinking)
    lp = chat_logprobs(serving, o.token_ids, o.logprobs, params.logprobs or 0, as_ids) \
        if req.logprobs and not hide else None
    reasoning, extracted = split_choice(o.text, plan, thinking)
    content = extracted.content
    forced = plan.choice.mode in ("required", "named")
    if forced and o.finish_reason == "length" and not _whole_calls(extracted):
        extracted, content = ExtractedToolCalls([], None), ""   # vLLM's: a forced call cut short is no call
    if plan.choice.mode == "named" and content is None:
        content = ""   # vLLM's: a named call's message has empty content, not null
    echo = echoed_content(req)
    if echo:
        content = echo + (content or "")
    message = ChatResponseMessage(content=content, tool_calls=response_tool_calls(extracted),
                                  reasoning=None if hide else reasoning)
    return ChatCompletionChoice(index=o.index, message=message, logprobs=lp,
                                finish_reason=finish_reason(o.finish_reason, bool(extracted.calls)),
                                stop_reason=o.stop_reason,
                                token_ids=list(o.token_ids) if req.return_token_ids and not hide else None), reasoning


def stream_chat(serving: OpenAIServing, request: Request, req: ChatCompletionRequest, group: RequestGroup,
                request_id: str, created: int, prompt_ids: list[int], params: SamplingParams,
                plan: ToolPlan, thinking: ReasoningPlan | None) -> AsyncIterator[str]:
    include_usage, continuous_usage = usage_options(req.stream_options, serving.config.enable_force_include_usage)
    hide = _hides_reasoning(thinking)
    model = req.model or serving.model_name
    top_n = params.logprobs or 0
    as_ids = serving.tokens_as_ids(req.return_tokens_as_token_ids)
    prompt_tokens = len(prompt_ids)

    async def body() -> AsyncIterator[str]:
        first = [True]

        def chunk(choice: ChatCompletionStreamChoice, completion_tokens: int = 0) -> str:
            usage = serving.usage(prompt_tokens, completion_tokens) if continuous_usage else None
            # return_token_ids: the prompt's ids ride on the stream's first chunk only
            prompt_token_ids = list(prompt_ids) if req.return_token_ids and first[0] else None
            first[0] = False
            return sse(ChatCompletionStreamResponse(id=request_id, created=created, model=model, choices=[choice],
                                                    usage=usage, prompt_token_ids=prompt_token_ids))

        # OpenAI opens every choice with a role-only delta before any content.
        for j in range(params.n):
            yield chunk(ChatCompletionStreamChoice(index=j, delta=DeltaMessage(role="assistant", content="")))
        echo = echoed_content(req)
        for j in range(params.n if echo else 0):
            yield chunk(ChatCompletionStreamChoice(index=j, delta=DeltaMessage(content=echo)))
        totals = ChoiceTotals(params.n)
        streams = [ChoiceStream(plan, thinking) for _ in range(params.n)]
        completion_tokens, cached_tokens = 0, 0
        finishes: set[str] = set()
        async for _, out in group.outputs():
            for o in out.outputs:
                totals.add(o.index, o)   # a delta: new text, tokens and logprobs; its finish comes once
                new_ids, finished = o.token_ids, o.finished
                lp = chat_logprobs(serving, new_ids, o.logprobs or [], top_n, as_ids) \
                    if req.logprobs and new_ids and not hide else None
                stream = streams[o.index]
                delta = stream.step(o.text, finished)   # on the last output, also what the parsers held back
                if hide:
                    delta.reasoning = None
                token_ids = list(new_ids) if req.return_token_ids and new_ids and not hide else None
                # vLLM's: the last piece of the answer and its finish_reason come in one chunk
                reason = finish_reason(o.finish_reason, stream.called) if finished else None
                ending = {"finish_reason": reason, "stop_reason": o.stop_reason} if finished else {}
                if delta.content or delta.tool_calls or delta.reasoning or lp is not None or token_ids:
                    yield chunk(ChatCompletionStreamChoice(index=o.index, delta=delta, logprobs=lp,
                                                           token_ids=token_ids, **ending), totals.tokens[o.index])
                elif finished:
                    yield chunk(ChatCompletionStreamChoice(index=o.index, delta=DeltaMessage(), **ending),
                                totals.tokens[o.index])
                if finished:
                    completion_tokens += totals.tokens[o.index]
                    finishes.add(reason or "-")
            if out.finished:
                cached_tokens = out.num_cached_tokens
        serving.set_log_info(request, request_id, prompt_tokens, completion_tokens, ",".join(sorted(finishes)))
        if include_usage:
            reasoning_tokens = reasoning_token_count(serving, [s.reasoning_text for s in streams])
            yield usage_chunk(ChatCompletionStreamResponse, request_id, created, model,
                              serving.usage(prompt_tokens, completion_tokens, cached_tokens, reasoning_tokens))

    return guarded_stream(serving, group, body())
