"""The OpenAI wire format: request and response models for completions and chat, and their SamplingParams.

Request fields use strict pydantic types, so `"max_tokens": "16"` or `"n": true` is a 400 rather than a
silent coercion; booleans are the exception: `"logprobs": "true"` is coerced as vLLM's (pydantic's lax) models
do, since vLLM clients send them so. Unknown fields are ignored, as vLLM and OpenAI's own compatibility layers do, so clients
that send newer OpenAI fields keep working. Ranges are checked once, by SamplingParams; the server maps its
SamplingParamsError (which names the field) to a 400.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal, Union

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, SerializerFunctionWrapHandler,
                      Strict, StrictFloat, StrictInt, StrictStr, model_serializer)

from pagedmodel.server.engine.outputs import RequestOutputKind
from pagedmodel.server.engine.sampling_params import SamplingParams, SamplingParamsError
from .structured_outputs import StructuredOutputsFields

Number = Union[StrictFloat, StrictInt]
# pydantic's lax bool, as vLLM's request models have it: true/false, 0/1 and "true"/"false"/"yes"/"no"/"1"/"0"...
LaxBool = bool
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
LOGIT_BIAS_LIMIT = 100.0   # OpenAI's documented range; vLLM clamps to it too
MAX_PROMPTS_PER_REQUEST = 64   # a completions `prompt` list; each entry is its own engine request
MAX_MESSAGES = 1024


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: LaxBool = False
    continuous_usage_stats: LaxBool = False   # vLLM's: with include_usage, every chunk carries the counts so far


class _SamplingRequest(StructuredOutputsFields):
    """Fields both endpoints share: OpenAI's sampling knobs plus vLLM's extras (structured outputs included)."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    n: StrictInt = 1
    best_of: StrictInt | None = None
    use_beam_search: LaxBool = False
    length_penalty: Number = 1.0
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    min_p: Number | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    repetition_penalty: Number | None = None
    seed: Annotated[StrictInt, Field(ge=INT64_MIN, le=INT64_MAX)] | None = None   # vLLM's: any int64
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: LaxBool = False
    max_tokens: StrictInt | None = None
    min_tokens: StrictInt = 0
    ignore_eos: LaxBool = False
    skip_special_tokens: LaxBool = True
    stream: LaxBool = False
    stream_options: StreamOptions | None = None
    priority: StrictInt = 0
    # vLLM's name: requests share prefix-cache blocks only with requests of the same salt (e.g. per tenant)
    cache_salt: StrictStr | None = None
    user: StrictStr | None = None
    logit_bias: dict[str, Number] | None = None   # token id (as a string) -> bias added to its logit
    return_token_ids: LaxBool | None = None            # vLLM's: prompt_token_ids and token_ids in the answer
    return_tokens_as_token_ids: LaxBool | None = None  # vLLM's: logprobs name tokens "token_id:N"
    # vLLM's: each prompt token's logprob and the top n (a JSON true is 1, as vLLM's lax int reads it)
    prompt_logprobs: Annotated[int, BeforeValidator(lambda v: int(v) if isinstance(v, bool) else v),
                               Strict()] | None = None
    allowed_token_ids: list[StrictInt] | None = None   # vLLM's: only these tokens may be drawn
    logprob_token_ids: list[StrictInt] | None = None   # vLLM's: these tokens' logprobs instead of the top n
    truncate_prompt_tokens: StrictInt | None = None    # vLLM's: keep k prompt tokens (-1: the context length)
    truncation_side: Literal["left", "right"] | None = None   # which end loses tokens (default: the left)
    # vLLM's: at most this many thinking tokens, then the end marker is forced (-1: unlimited); needs markers
    # from --reasoning-parser or --reasoning-config
    thinking_token_budget: StrictInt | None = None
    watermarking: LaxBool | None = None                # vLLM's: false opts out of the engine's watermark

    def truncated(self, ids: list[int], max_model_len: int) -> list[int]:
        """The prompt cut to ``truncate_prompt_tokens`` (vLLM's: from the left unless truncation_side says)."""
        k = self.truncate_prompt_tokens
        if k is None:
            return ids
        if k == -1:
            k = max_model_len
        if k < 1 or k > max_model_len:
            raise SamplingParamsError(f"truncate_prompt_tokens must be -1 or between 1 and the context length "
                                      f"({max_model_len}), got {self.truncate_prompt_tokens}", "truncate_prompt_tokens")
        if len(ids) <= k:
            return ids
        return ids[:k] if self.truncation_side == "right" else ids[len(ids) - k:]

    def _prompt_logprobs(self, vocab_size: int, max_logprobs: int | None, default: int | None) -> int | None:
        """vLLM's rules: -1 is the whole vocabulary; a stream cannot carry them (0 asks for none, so it may)."""
        count = self.prompt_logprobs if self.prompt_logprobs is not None else default
        if self.prompt_logprobs is not None and self.stream and (self.prompt_logprobs > 0 or self.prompt_logprobs == -1):
            raise SamplingParamsError("prompt_logprobs are not available when stream is true", "prompt_logprobs")
        return logprob_count(count, "prompt_logprobs", vocab_size, max_logprobs)

    def _base_params(self, *, max_tokens: int | None, logprobs: int | None,
                     prompt_logprobs: int | None = None) -> SamplingParams:
        """Build and validate SamplingParams; raises SamplingParamsError naming the bad field."""
        if self.logprob_token_ids:
            if logprobs is None:
                raise SamplingParamsError("logprob_token_ids needs logprobs to be set", "logprob_token_ids")
            # each token's entry then holds the named tokens and the sampled one, whatever logprobs counted
            logprobs = len(set(self.logprob_token_ids)) + 1
        if self.stream_options is not None and not self.stream:
            raise SamplingParamsError("stream_options is only allowed when stream is true", "stream_options")
        if self.stream and self.best_of is not None and self.best_of > self.n:
            raise SamplingParamsError("best_of > n cannot be streamed", "best_of")
        kwargs: dict[str, Any] = dict(
            n=self.n, best_of=self.best_of, use_beam_search=self.use_beam_search,
            length_penalty=self.length_penalty,
            # beam search is deterministic: an unset temperature means 0 there, OpenAI's 1.0 elsewhere
            temperature=(0.0 if self.use_beam_search else 1.0) if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None or self.top_k == 0 else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            seed=engine_seed(self.seed), stop=self.stop or [], stop_token_ids=self.stop_token_ids or [],
            include_stop_str_in_output=self.include_stop_str_in_output,
            max_tokens=max_tokens, min_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            structured_outputs=self.structured_outputs_params(), logit_bias=parse_logit_bias(self.logit_bias),
            allowed_token_ids=self.allowed_token_ids, logprob_token_ids=self.logprob_token_ids or None,
            thinking_token_budget=self.thinking_token_budget,
            watermarking=self.watermarking,
            # a stream is sent piece by piece as it comes; any other answer is whole, once, at the end
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
        )
        return SamplingParams(**kwargs)


def logprob_count(value: int | None, name: str, vocab_size: int, max_logprobs: int | None) -> int | None:
    """A count of logprobs as vLLM takes it: n >= 0 tokens, or -1 for the whole vocabulary, which like any
    count must be within --max-logprobs (http_limits checks the explicit counts before the body is parsed)."""
    if value is None or value >= 0:
        return value
    if value != -1:
        raise SamplingParamsError(f"{name} must be a non-negative integer or -1, got {value}", name)
    if max_logprobs is not None and vocab_size > max_logprobs:
        raise SamplingParamsError(f"{name} -1 asks for the whole vocabulary ({vocab_size} tokens); "
                                  f"this server returns at most {max_logprobs} (--max-logprobs)", name)
    return vocab_size


def engine_seed(seed: int | None) -> int | None:
    """vLLM takes any int64 seed; the sampler seeds with ``seed % 2**63`` (sampler.py), so a negative seed is
    passed as that same residue: the draws are those the sampler would make from the negative seed itself.
    (The field's own bounds refuse a seed outside int64 with pydantic's message, before this runs.)"""
    return None if seed is None else seed % 2**63


def parse_logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's {"token id": bias} as {id: bias}, each bias clamped to [-100, 100] as vLLM does; the ids'
    range is the server's to check (it knows the vocabulary)."""
    if not bias:
        return None
    bad = [key for key in bias if not (key.isascii() and key.isdigit())]
    if bad:   # every bad key at once, so one correction fixes the request
        raise SamplingParamsError(f"logit_bias keys must be token ids, got {', '.join(map(repr, bad))}",
                                  "logit_bias")
    out: dict[int, float] = {}
    for key, value in bias.items():
        token = int(key)
        out[token] = max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, float(value)))
    return out


class CompletionRequest(_SamplingRequest):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]] | None = None
    # vLLM's (--enable-prompt-embeds): base64 torch.save tensors, each a prompt, answered before `prompt`'s
    prompt_embeds: StrictStr | list[StrictStr] | None = None
    echo: LaxBool = False
    logprobs: StrictInt | None = None
    suffix: StrictStr | None = None

    def embeds_payloads(self) -> list[str]:
        """prompt_embeds as a list of payloads (decoded by the server: embedding_payload.py)."""
        p = self.prompt_embeds
        payloads = [p] if isinstance(p, str) else list(p or [])
        if payloads and self.echo:
            raise SamplingParamsError("echo cannot repeat a prompt given as embeddings", "echo")
        if payloads and self.prompt_logprobs is not None:
            raise SamplingParamsError("prompt_logprobs is not compatible with prompt_embeds (there are no prompt "
                                      "tokens to score)", "prompt_logprobs")
        return payloads

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of independent prompts (text or token ids)."""
        p = self.prompt
        embeds = self.embeds_payloads()
        if p is None or (p == "" and embeds):
            if not embeds:
                raise SamplingParamsError("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
            out: list[str | list[int]] = []
        elif isinstance(p, str):
            out = [p]
        elif not p:
            raise SamplingParamsError("prompt must not be empty", "prompt")
        elif all(isinstance(x, int) for x in p):
            out = [list(p)]  # type: ignore[arg-type]
        else:
            out = list(p)  # type: ignore[arg-type]
        if len(out) + len(embeds) > MAX_PROMPTS_PER_REQUEST:
            raise SamplingParamsError(f"at most {MAX_PROMPTS_PER_REQUEST} prompts per request (prompt and "
                                      f"prompt_embeds together), got {len(out) + len(embeds)}", "prompt")
        for x in out:
            if (isinstance(x, str) and not x) or (isinstance(x, list) and not x):
                raise SamplingParamsError("prompt must not be empty", "prompt")
        return out

    def to_sampling_params(self, vocab_size: int = 0, max_logprobs: int | None = None) -> SamplingParams:
        """``vocab_size`` and ``max_logprobs`` resolve vLLM's -1 counts (the whole vocabulary)."""
        if self.suffix:
            raise SamplingParamsError("suffix is not supported", "suffix")
        # OpenAI's completions default is 16 tokens.
        max_tokens = 16 if self.max_tokens is None else self.max_tokens
        if self.logprob_token_ids and max_tokens == 0:
            raise SamplingParamsError("logprob_token_ids score generated tokens, and no output tokens are generated "
                                      "with max_tokens 0", "logprob_token_ids")
        logprobs = logprob_count(self.logprobs, "logprobs", vocab_size, max_logprobs)
        # echo + logprobs: the echoed prompt's tokens carry logprobs too, as OpenAI returns them
        prompt_logprobs = self._prompt_logprobs(vocab_size, max_logprobs, default=logprobs if self.echo else None)
        return self._base_params(max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs)


class TextContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: StrictStr


class PromptEmbedsContentPart(BaseModel):
    """vLLM's content part (--enable-prompt-embeds): embeddings that stand in the message where the part is."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["prompt_embeds"]
    data: StrictStr   # base64 of torch.save of a [num_tokens, hidden_size] tensor
    _marker: str = PrivateAttr(default="")

    @property
    def text(self) -> str:
        """What the chat template renders in the part's place: a marker chat_embeds.py splits the prompt at."""
        return self._marker


ContentPart = Annotated[Union[TextContentPart, PromptEmbedsContentPart], Field(discriminator="type")]


class FunctionCallParam(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: StrictStr
    arguments: StrictStr   # JSON text, as the API returned it


class ToolCallParam(BaseModel):
    """A call of an earlier assistant turn, sent back for multi-turn tool use."""

    model_config = ConfigDict(extra="ignore")
    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    # OpenAI's roles, or any other the model's chat template knows: vLLM passes custom roles to the template
    role: Annotated[StrictStr, Field(min_length=1)]
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCallParam] | None = None
    tool_call_id: StrictStr | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def template_dict(self, i: int) -> dict[str, Any]:
        """The message as chat templates take it (call arguments as objects); raises naming the bad field."""
        m: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name:
            m["name"] = self.name
        if self.role == "tool":
            if self.tool_call_id is None:
                raise SamplingParamsError(f"messages[{i}]: a tool message needs tool_call_id",
                                          f"messages[{i}].tool_call_id")
            m["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            if self.role != "assistant":
                raise SamplingParamsError(f"messages[{i}]: only assistant messages carry tool_calls",
                                          f"messages[{i}].tool_calls")
            m["tool_calls"] = [self._call_dict(i, j, c) for j, c in enumerate(self.tool_calls)]
        return m

    @staticmethod
    def _call_dict(i: int, j: int, call: ToolCallParam) -> dict[str, Any]:
        try:
            args = json.loads(call.function.arguments)
        except ValueError:
            args = None
        if not isinstance(args, dict):
            raise SamplingParamsError(f"messages[{i}].tool_calls[{j}].function.arguments must be a JSON object",
                                      f"messages[{i}].tool_calls[{j}].function.arguments")
        return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": args}}


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    logprobs: LaxBool = False
    top_logprobs: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    add_generation_prompt: LaxBool = True
    continue_final_message: LaxBool = False
    tools: list[Any] | None = None   # validated by tool_definitions.parse_tools (400s naming tools[i]...)
    tool_choice: Any = None
    parallel_tool_calls: LaxBool = True   # false: `required` makes exactly one call
    echo: LaxBool = False   # vLLM's: the answer starts with the last message's content when it is the answer's role
    include_reasoning: LaxBool = True   # vLLM's: false drops `reasoning` (with --reasoning-parser)
    chat_template_kwargs: dict[str, Any] | None = None   # vLLM's: extra variables for the chat template
    # vLLM's disaggregated decode: {"prompt_token_ids": [...]} is the prompt as the prefill side rendered it
    kv_transfer_params: dict[str, Any] | None = None

    def check_embeds_parts(self, has_parts: bool) -> None:
        """What cannot go with prompt_embeds content parts: each would need the prompt as tokens."""
        if not has_parts:
            return
        for name in ("echo", "truncate_prompt_tokens", "prompt_logprobs", "kv_transfer_params"):
            if getattr(self, name) not in (None, False):
                raise SamplingParamsError(f"{name} is not compatible with prompt_embeds content parts", name)

    def forwarded_prompt_ids(self) -> list[int] | None:
        """kv_transfer_params.prompt_token_ids, used verbatim in place of rendering the messages."""
        ids = (self.kv_transfer_params or {}).get("prompt_token_ids")
        if ids is None:
            return None
        if not isinstance(ids, list) or not ids or not all(type(t) is int for t in ids):
            raise SamplingParamsError("kv_transfer_params.prompt_token_ids must be a non-empty list of token ids",
                                      "kv_transfer_params.prompt_token_ids")
        return ids

    def to_sampling_params(self, vocab_size: int = 0, max_logprobs: int | None = None) -> SamplingParams:
        """``vocab_size`` and ``max_logprobs`` resolve vLLM's ``top_logprobs: -1`` (the whole vocabulary)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise SamplingParamsError("top_logprobs requires logprobs to be true", "top_logprobs")
        if self.continue_final_message and self.add_generation_prompt:
            raise SamplingParamsError("continue_final_message and add_generation_prompt cannot both be true",
                                      "continue_final_message")
        logprobs = logprob_count(self.top_logprobs or 0, "top_logprobs", vocab_size, max_logprobs) if self.logprobs else None
        # vLLM's: with echo, the prompt is scored with top_logprobs alternatives unless prompt_logprobs says
        # (a stream echoes the text alone, so it does not pay for them)
        prompt_logprobs = self._prompt_logprobs(vocab_size, max_logprobs,
                                                default=self.top_logprobs if self.echo and not self.stream else None)
        # max_completion_tokens is the newer name; None means "up to the model's context".
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._base_params(max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs)


# ---------------------------------------------------------------- responses

def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class PromptLogprob(BaseModel):
    """vLLM's prompt_logprobs entry for one token (keyed by its id)."""
    logprob: float
    rank: int | None = None            # 1 + how many tokens were more likely
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, PromptLogprob] | None]   # per prompt token; the first is None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0   # prompt tokens served from the prefix cache


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0   # the completion tokens that were thinking (with --reasoning-parser)


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None   # with --enable-prompt-tokens-details
    completion_tokens_details: CompletionTokensDetails | None = None   # with --reasoning-parser

    @model_serializer(mode="wrap")
    def _omit_completion_details(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return omit_none(handler(self), ("completion_tokens_details",))


def omit_none(data: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    """``data`` without those of ``keys`` that are None: vLLM sends them only where they carry something."""
    for key in keys:
        if data.get(key) is None:
            data.pop(key, None)
    return data


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None   # return_token_ids (a stream: its first chunk only)
    token_ids: list[int] | None = None          # return_token_ids (a stream: each chunk's new tokens)
    prompt_logprobs: PromptLogprobs | None = None   # vLLM's prompt_logprobs (or echo + logprobs)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    reasoning: str | None = None   # vLLM's (older vLLM said reasoning_content); null when there is none

    @model_serializer(mode="wrap")
    def _omit_no_calls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # as OpenAI and vLLM: no tool_calls key when there are none; reasoning is always there (vLLM's)
        data = handler(self)
        if not data.get("tool_calls"):
            data.pop("tool_calls", None)
        return data


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None          # return_token_ids


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    prompt_token_ids: list[int] | None = None   # return_token_ids
    prompt_logprobs: PromptLogprobs | None = None   # vLLM's prompt_logprobs (or echo + top_logprobs)


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A piece of a streamed call: index always; id, type and name in its first piece; argument text after."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning: str | None = None   # with --reasoning-parser: the thinking this delta adds

    @model_serializer(mode="plain")
    def _drop_unset(self) -> dict[str, Any]:
        # OpenAI sends only the keys a delta changes: {"role": ...} first, then {"content": ...}, then {}.
        out: dict[str, Any] = {k: v for k, v in (("role", self.role), ("content", self.content),
                                                 ("reasoning", self.reasoning)) if v is not None}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump(exclude_none=True) for c in self.tool_calls]
        return out


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None          # return_token_ids: this chunk's new tokens

    @model_serializer(mode="wrap")
    def _omit_token_ids(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return omit_none(handler(self), ("token_ids",))


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None   # return_token_ids: the first chunk only

    @model_serializer(mode="wrap")
    def _omit_prompt_token_ids(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return omit_none(handler(self), ("prompt_token_ids",))


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedmodel"
    root: str | None = None
    parent: str | None = None            # a LoRA adapter's base model (None for the base model itself)
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
