"""POST /tokenize and POST /detokenize, in vLLM's shapes: a prompt or chat messages (with tools) to token
ids exactly as a completion or chat request would see them, and token ids back to text."""
from __future__ import annotations

from typing import Annotated, Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from .errors import APIError
from .protocol import MAX_MESSAGES, ChatMessage
from .serving import OpenAIServing
from .tool_definitions import parse_tools

MAX_DETOKENIZE = 1 << 20   # ids per /detokenize request; far beyond any context window


class TokenizeRequest(BaseModel):
    """Either form of vLLM's request: `prompt` (completions) or `messages` (chat, template applied)."""

    model_config = ConfigDict(extra="ignore")
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None
    # vLLM's defaults: a prompt gets the tokenizer's special tokens, rendered chat already holds them.
    # Booleans are pydantic's lax ones, as in vLLM: "true" and "false" as strings are taken.
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: StrictStr | None = None
    tokens: Annotated[list[StrictInt], Field(max_length=MAX_DETOKENIZE)]


async def _ids_of(serving: OpenAIServing, req: TokenizeRequest) -> list[int]:
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give exactly one of prompt and messages", param="prompt" if req.prompt else "messages")
    if req.messages is not None:
        if req.continue_final_message and req.add_generation_prompt:
            raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true",
                           param="continue_final_message")
        ids, _ = await serving.render_chat(req.messages, tools=parse_tools(req.tools),
                                           add_generation_prompt=req.add_generation_prompt,
                                           continue_final_message=req.continue_final_message,
                                           add_special_tokens=bool(req.add_special_tokens))
        return ids
    assert req.prompt is not None
    ids, _ = await serving.tokenize_prompt(req.prompt, add_special_tokens=req.add_special_tokens is not False)
    return ids


async def tokenize(serving: OpenAIServing, request: Request) -> JSONResponse:
    req = await serving.parse_body(request, TokenizeRequest)
    serving.check_model(req.model)
    ids = await _ids_of(serving, req)
    body: dict[str, Any] = {"count": len(ids), "max_model_len": serving.max_model_len, "tokens": ids,
                            "token_strs": serving.token_pieces(ids) if req.return_token_strs else None}
    return JSONResponse(body)


async def detokenize(serving: OpenAIServing, request: Request) -> JSONResponse:
    req = await serving.parse_body(request, DetokenizeRequest)
    serving.check_model(req.model)
    serving.require_tokenizer("/detokenize needs the tokenizer", "tokens")
    limit = serving.tokenizer_size
    for i, t in enumerate(req.tokens):
        if not 0 <= t < limit:
            raise APIError(400, f"tokens[{i}] = {t} is not a token id of this model (0 <= id < {limit})",
                           param="tokens", code="invalid_token_id")
    return JSONResponse({"prompt": serving.decode(req.tokens)})
