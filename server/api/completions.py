"""POST /v1/completions: prompts (text, token ids, or lists of either) in, completions out, whole or streamed."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from pagedmodel.server.engine.outputs import RequestOutput
from pagedmodel.server.engine.prompt_embeds import PLACEHOLDER_TOKEN_ID, PromptEmbeds
from pagedmodel.server.engine.sampling_params import SamplingParams, SamplingParamsError
from .async_engine import RequestGroup
from .errors import APIError
from .logprobs import completion_logprobs, prepend_prompt_logprobs, prompt_logprobs
from .protocol import (CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse,
                       CompletionStreamResponse, random_id)
from .serving import OpenAIServing
from .structured_outputs import ensure_compiled
from .streaming import ChoiceTotals, guarded_stream, sse, stream_headers, usage_chunk, usage_options


@dataclass
class PreparedCompletion:
    """A completions request checked and tokenized, ready for the engine."""
    params: SamplingParams
    tokenized: list[tuple[list[int], str | None]]   # per prompt: ids, and the text when it came as text
    lora: Any                                        # the adapter ``model`` names (None: the base model)
    embeds: list[PromptEmbeds | None]                # per prompt: its embeddings (prompt_embeds come first)


async def prepare_completion(serving: OpenAIServing, req: CompletionRequest) -> PreparedCompletion:
    """Every check that can refuse the request (400s naming the field), then the prompts."""
    lora = serving.check_model(req.model)
    try:
        params = req.to_sampling_params(serving.tokenizer_size, serving.config.limits.max_logprobs)
        prompts = req.prompts()
        payloads = req.embeds_payloads()
    except SamplingParamsError as exc:
        raise APIError(400, str(exc), param=exc.param) from None
    rows = [await serving.load_prompt_embeds(p) for p in payloads]
    try:   # truncate_prompt_tokens cuts embeddings as it cuts ids (below)
        rows = [req.truncated(r, serving.max_model_len) for r in rows]
    except SamplingParamsError as exc:
        raise APIError(400, str(exc), param=exc.param) from None
    embeds: list[PromptEmbeds | None] = [PromptEmbeds.whole(r) for r in rows] + [None] * len(prompts)
    tokenized = [([PLACEHOLDER_TOKEN_ID] * r.shape[0], None) for r in rows]
    tokenized += [await serving.tokenize_prompt(p) for p in prompts]
    try:   # a cut prompt's echo is the decode of what is left of it
        cuts = [(req.truncated(ids, serving.max_model_len), ids, text) for ids, text in tokenized]
    except SamplingParamsError as exc:
        raise APIError(400, str(exc), param=exc.param) from None
    tokenized = [(cut, text if cut is ids else None) for cut, ids, text in cuts]
    for ids, _ in tokenized:
        serving.check_prompt(ids, params)
    serving.check_token_ids(params)
    await ensure_compiled(serving, params)
    return PreparedCompletion(params, tokenized, lora, embeds)


async def create_completion(serving: OpenAIServing, request: Request, req: CompletionRequest | None = None) -> Response:
    """``req``: the body already parsed (/invocations reads it to pick the endpoint)."""
    req = req or await serving.parse_body(request, CompletionRequest)
    prepared = await prepare_completion(serving, req)
    params, tokenized = prepared.params, prepared.tokenized
    request_id = random_id("cmpl")
    subs = serving.build_subs(request_id, [ids for ids, _ in tokenized], params, req.cache_salt, prepared.lora,
                              prepared.embeds)
    group = await serving.submit(subs, req.priority)
    request.state.log_info = f"id={request_id}"   # completed with token counts once the reply is done
    created = int(time.time())
    if req.stream:
        return StreamingResponse(stream_completion(serving, request, req, group, request_id, created, tokenized,
                                                    params), media_type="text/event-stream",
                                 headers=stream_headers(request_id))

    final = await serving.collect(group, request)
    choices = [choice for p_idx, (ids, text) in enumerate(tokenized)
               for choice in _prompt_choices(serving, req, params, p_idx, ids, text, final[p_idx])]
    completion_tokens = sum(len(o.token_ids) for out in final.values() for o in out.outputs)
    prompt_tokens = sum(len(ids) for ids, _ in tokenized)
    usage = serving.usage(prompt_tokens, completion_tokens, sum(out.num_cached_tokens for out in final.values()))
    serving.set_log_info(request, request_id, prompt_tokens, completion_tokens,
                         ",".join(sorted({c.finish_reason or "-" for c in choices})))
    resp = CompletionResponse(id=request_id, created=created, model=req.model or serving.model_name, choices=choices,
                              usage=usage)
    return Response(resp.model_dump_json(), media_type="application/json", headers={"X-Request-Id": request_id})


def _prompt_choices(serving: OpenAIServing, req: CompletionRequest, params: SamplingParams, p_idx: int,
                    ids: list[int], text: str | None, final: RequestOutput) -> list[CompletionChoice]:
    """The n choices of one prompt, whole."""
    prompt_text = (text if text is not None else serving.decode(ids)) if req.echo else ""
    top_n = params.logprobs or 0
    as_ids = serving.tokens_as_ids(req.return_tokens_as_token_ids)
    scored_prompt = prompt_logprobs(serving, final, params.prompt_logprobs, as_ids)
    choices = []
    for o in sorted(final.outputs, key=lambda o: o.index):
        lp = None
        if req.logprobs is not None:
            lp = completion_logprobs(serving, o.token_ids, o.logprobs, top_n, len(prompt_text), as_ids)
            if req.echo:
                lp = prepend_prompt_logprobs(serving, ids, final.prompt_logprobs, top_n, lp, as_ids)
        choices.append(CompletionChoice(index=p_idx * params.n + o.index, text=prompt_text + o.text, logprobs=lp,
                                        finish_reason=o.finish_reason, stop_reason=o.stop_reason,
                                        prompt_token_ids=list(ids) if req.return_token_ids else None,
                                        token_ids=list(o.token_ids) if req.return_token_ids else None,
                                        prompt_logprobs=scored_prompt))
    return choices


class _CompletionChunks:
    """Builds one stream's chunks: each choice's delta with the vLLM extras the request asked for
    (token_ids, the prompt's ids in its first chunk, usage on every chunk)."""

    def __init__(self, serving: OpenAIServing, req: CompletionRequest, request_id: str, created: int,
                 tokenized: list[tuple[list[int], str | None]], n: int):
        self.serving, self.req, self.request_id, self.created = serving, req, request_id, created
        self.model = req.model or serving.model_name
        self.tokenized, self.n = tokenized, n
        self.continuous_usage = usage_options(req.stream_options, serving.config.enable_force_include_usage)[1]
        self.as_ids = serving.tokens_as_ids(req.return_tokens_as_token_ids)
        self.prompt_ids_sent: set[int] = set()

    def chunk(self, idx: int, text: str, lp: CompletionLogprobs | None, finish: str | None = None, stop: Any = None,
              new_ids: list[int] | None = None, completion_tokens: int = 0) -> str:
        prompt_ids = self.tokenized[idx // self.n][0]
        choice = CompletionChoice(index=idx, text=text, logprobs=lp, finish_reason=finish, stop_reason=stop)
        if self.req.return_token_ids:
            choice.token_ids = list(new_ids or [])
            if idx not in self.prompt_ids_sent:
                self.prompt_ids_sent.add(idx)
                choice.prompt_token_ids = list(prompt_ids)
        usage = self.serving.usage(len(prompt_ids), completion_tokens) if self.continuous_usage else None
        return sse(CompletionStreamResponse(id=self.request_id, created=self.created, model=self.model,
                                            choices=[choice], usage=usage))

    def logprobs(self, new_ids: list[int], new_lp: list[dict[int, float]], top_n: int,
                 offset: int) -> CompletionLogprobs | None:
        """Every chunk carries logprobs when they were asked for (empty lists on a chunk with no new token)."""
        if self.req.logprobs is None:
            return None
        return completion_logprobs(self.serving, new_ids, new_lp, top_n, offset, self.as_ids)


def stream_completion(serving: OpenAIServing, request: Request, req: CompletionRequest, group: RequestGroup,
                       request_id: str, created: int, tokenized: list[tuple[list[int], str | None]],
                       params: SamplingParams) -> AsyncIterator[str]:
    include_usage = usage_options(req.stream_options, serving.config.enable_force_include_usage)[0]
    n = params.n
    top_n = params.logprobs or 0
    chunks = _CompletionChunks(serving, req, request_id, created, tokenized, n)

    async def body() -> AsyncIterator[str]:
        totals = ChoiceTotals(len(tokenized) * n)
        echo_text = [(text if text is not None else serving.decode(ids)) if req.echo else ""
                     for ids, text in tokenized]
        completion_tokens, cached_tokens = 0, 0
        finishes: set[str] = set()
        if req.echo and req.logprobs is None:   # the prompt text opens every choice
            for idx in range(len(tokenized) * n):
                yield chunks.chunk(idx, echo_text[idx // n], None)
        # with logprobs, the echo waits for the prompt's logprobs, which come with the first output
        echo_pending = set(range(len(tokenized))) if req.echo and req.logprobs is not None else set()
        async for p_idx, out in group.outputs():
            if p_idx in echo_pending:
                echo_pending.discard(p_idx)
                plp = prepend_prompt_logprobs(serving, tokenized[p_idx][0], out.prompt_logprobs, top_n,
                                               CompletionLogprobs(), chunks.as_ids)
                for j in range(n):
                    yield chunks.chunk(p_idx * n + j, echo_text[p_idx], plp)
            for o in out.outputs:
                idx = p_idx * n + o.index
                offset, finished = totals.add(idx, o), o.finished   # a delta; its finish comes once
                # a chunk of new tokens with no text yet (a stop string may follow) only when they are asked for
                if o.text or finished or (o.token_ids and (req.logprobs is not None or req.return_token_ids)):
                    lp = chunks.logprobs(o.token_ids, o.logprobs or [], top_n, len(echo_text[p_idx]) + offset)
                    yield chunks.chunk(idx, o.text, lp, o.finish_reason if finished else None,
                                       o.stop_reason if finished else None, o.token_ids, totals.tokens[idx])
                if finished:
                    completion_tokens += totals.tokens[idx]
                    finishes.add(o.finish_reason or "-")
            if out.finished:
                cached_tokens += out.num_cached_tokens
        prompt_tokens = sum(len(ids) for ids, _ in tokenized)
        serving.set_log_info(request, request_id, prompt_tokens, completion_tokens, ",".join(sorted(finishes)))
        if include_usage:
            usage = serving.usage(prompt_tokens, completion_tokens, cached_tokens)
            yield usage_chunk(CompletionStreamResponse, request_id, created, chunks.model, usage)

    return guarded_stream(serving, group, body())
