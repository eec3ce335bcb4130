"""OpenAIServing: the request handling every endpoint shares — body parsing, model and prompt checks,
tokenization on its own thread, submission to the async engine and collecting the final outputs.

Request bodies are parsed by hand rather than by FastAPI so every malformed request (wrong content
type, non-UTF-8 bytes, invalid JSON, wrong types) gets a precise OpenAI-style 400/415 instead of
FastAPI's 422 shape. Prompts are tokenized on a one-thread executor with the server's own tokenizer
copy, so a huge prompt never blocks the event loop and the engine thread's tokenizer is never shared
across threads.
"""
from __future__ import annotations

import asyncio
import copy
import json
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from pagedmodel.server.engine.input_processor import NO_TOKENIZER, InvalidRequestError, encode_prompt
from pagedmodel.server.engine.outputs import RequestOutput
from pagedmodel.server.engine.sampling_params import SamplingParams, SamplingParamsError
from .allocator import heap_trimmer
from .async_engine import AsyncEngine, EngineDeadError, QueueFullError, RequestGroup, SubRequest
from pagedmodel.server.http_common.api_key import DEFAULT_AUTH_EXEMPT
from .embedding_payload import EmbeddingPayloadError, decode_embeddings
from .errors import UNSERVED_HEADER, APIError, validation_message
from pagedmodel.server.http_common.http_limits import HTTPLimits, read_body
from .lora_adapters import resolve_model
from .metrics import ServerMetrics
from .protocol import ChatMessage, CompletionTokensDetails, PromptTokensDetails, UsageInfo
from .tool_definitions import FunctionTool
from .tool_prompt import prepare_chat

if TYPE_CHECKING:
    import torch

    from pagedmodel.server.engine.engine_client import EngineClient
    from pagedmodel.server.engine.prompt_embeds import PromptEmbeds

logger = logging.getLogger("pagedmodel.server.api")

M = TypeVar("M", bound=BaseModel)
# apply_chat_template's own arguments: a request's chat_template_kwargs may not set them
_RENDER_OWN = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "tokenize",
                         "add_generation_prompt", "continue_final_message", "return_dict", "return_tensors",
                         "padding", "truncation", "max_length", "tokenizer_kwargs", "return_assistant_tokens_mask"})


@dataclass
class ServerConfig:
    """The HTTP-only knobs; the engine's own flags live in EngineArgs."""

    served_model_name: str
    api_key: str | None = None
    log_requests: bool = False
    max_queue_len: int | None = None
    model_root: str | None = None
    retry_after_s: int = 1
    # vLLM's --enable-auto-tool-choice / --tool-call-parser: tool_choice "auto" needs both
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    enable_debug_endpoints: bool = False   # GET /debug/kv_blocks (LLMEngine.kv_blocks_report)
    auth_exempt: tuple[str, ...] = DEFAULT_AUTH_EXEMPT   # paths served without the API key
    limits: HTTPLimits = field(default_factory=HTTPLimits)   # docs/limits.md
    # vLLM's flags of the same names (vllm_flags.py, docs/vllm_compat.md)
    enable_request_id_headers: bool = False
    enable_prompt_tokens_details: bool = False
    return_tokens_as_token_ids: bool = False
    enable_tokenizer_info_endpoint: bool = False
    enable_server_load_tracking: bool = False
    enable_force_include_usage: bool = False   # vLLM's: every stream carries usage, on every chunk
    root_path: str = ""   # --root-path: the prefix a proxy serves the app under
    reasoning_parser: str | None = None   # --reasoning-parser: chat answers split off their thinking (reasoning/)


class ClientDisconnected(Exception):
    """The client closed the connection before its (non-streamed) answer was ready."""


def _bad_request(exc: InvalidRequestError) -> APIError:
    return APIError(400, str(exc), param=exc.param, code=exc.code)


class OpenAIServing:
    """Request handling shared by the endpoints: parsing, validation, tokenization, response building."""

    def __init__(self, engine: EngineClient, config: ServerConfig, metrics: ServerMetrics | None = None):
        self.engine = engine
        self.config = config
        self.model_name = config.served_model_name
        self.max_model_len = int(engine.max_model_len)
        # The engine's own checks (input_processor.py): its messages are what the client reads.
        self.inputs = engine.input_processor
        # Own copies: the engine thread uses engine.tokenizer, the executor encodes, the loop decodes.
        # None (--skip-tokenizer-init): token ids in and out; what needs text is a 400 (require_tokenizer).
        self._enc_tokenizer = copy.deepcopy(engine.tokenizer)
        self._dec_tokenizer = copy.deepcopy(engine.tokenizer)
        self.vocab_size = int(engine.vocab_size)
        self._tok_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self._token_str_cache: dict[int, str] = {}
        limits = config.limits
        self.max_prompt_tokens = min(self.max_model_len, limits.max_prompt_tokens or self.max_model_len)
        # No token spells more characters than its longest vocabulary piece, so a text longer than this
        # is over the token limit for sure: refused without paying to tokenize it (a 8 MiB prompt).
        vocab = self._enc_tokenizer.get_vocab() if self._enc_tokenizer is not None else {}
        longest = max((len(p) for p in vocab), default=1)
        self.max_prompt_chars = self.max_prompt_tokens * max(1, longest)
        self.async_engine = AsyncEngine(engine, max_queue_len=config.max_queue_len,
                                        retry_after_s=config.retry_after_s, heap_trimmer=heap_trimmer())
        self.metrics = metrics or ServerMetrics(self.model_name, lambda: self.async_engine.last_stats,
                                                cache_config=engine.cache_config_info())
        self.async_engine.observer = self.metrics
        self.draining = False

    def close(self) -> None:
        self.async_engine.shutdown()
        self._tok_pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ parsing
    async def parse_body(self, request: Request, model_cls: type[M]) -> M:
        return self.validate_body(await self.read_json(request), model_cls)

    async def read_json(self, request: Request) -> dict[str, Any]:
        """The body as a JSON object, within the limits; a precise 400/413/415 otherwise."""
        ctype = request.headers.get("content-type")
        mime = (ctype or "application/json").split(";")[0].strip().lower()
        if mime != "application/json":
            raise APIError(415, f"Content-Type must be application/json, got {ctype!r}", code="unsupported_media_type")
        limits = self.config.limits
        raw = await read_body(request.headers.get("content-length"), request.stream(), limits)
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
        return data

    def validate_body(self, data: dict[str, Any], model_cls: type[M]) -> M:
        self.config.limits.check_fields(data)
        try:
            return model_cls.model_validate(data)
        except ValidationError as exc:
            message, param = validation_message(list(exc.errors(include_url=False)))
            raise APIError(400, message, param=param, code="invalid_request_error") from None

    def check_model(self, model: str | None) -> Any:
        """The LoRA adapter ``model`` names (None: the base model); 404 when this server has no such model."""
        return resolve_model(self, model)

    def check_accepting(self) -> None:
        if self.draining:
            raise APIError(503, "server is shutting down", code="shutting_down",
                           headers={"Retry-After": "5", UNSERVED_HEADER: "shutting_down"})
        if not self.async_engine.is_healthy:
            raise APIError(503, f"engine is not running: {self.async_engine.dead_reason}", code="engine_dead",
                           headers={UNSERVED_HEADER: "engine_dead"})

    # ------------------------------------------------------------------ tokenization
    async def _in_tokenizer_thread(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._tok_pool, fn)

    async def tokenize_prompt(self, prompt: str | list[int],
                              add_special_tokens: bool = True) -> tuple[list[int], str | None]:
        if isinstance(prompt, list):
            return list(prompt), None
        self.check_text_length(prompt, "prompt")
        tok = self._enc_tokenizer

        def encode() -> list[int]:
            ids = encode_prompt(tok, prompt)   # the engine's checks and messages
            return ids if add_special_tokens else list(tok(prompt, add_special_tokens=False).input_ids)
        try:
            ids = await self._in_tokenizer_thread(encode)
        except InvalidRequestError as exc:
            raise _bad_request(exc) from None
        return ids, prompt

    async def load_prompt_embeds(self, data: object, param: str = "prompt_embeds") -> torch.Tensor:
        """A base64 ``torch.save`` payload as prompt embedding rows, checked against the model (400s)."""
        def load() -> torch.Tensor:
            return self.inputs.embedding_rows(decode_embeddings(data, param), param)
        try:
            return await self._in_tokenizer_thread(load)
        except EmbeddingPayloadError as exc:
            raise APIError(400, str(exc), param=exc.param) from None
        except InvalidRequestError as exc:
            raise _bad_request(exc) from None

    async def render_chat(self, messages: list[ChatMessage], *, tools: list[FunctionTool] | None = None,
                          add_generation_prompt: bool = True, continue_final_message: bool = False,
                          add_special_tokens: bool = False,
                          template_kwargs: dict[str, Any] | None = None) -> tuple[list[int], str]:
        """The messages (and tools) through the model's chat template: (token ids, rendered text).

        ``template_kwargs``: the request's chat_template_kwargs, extra variables for the template (Qwen3's
        enable_thinking); names that are render_chat's own arguments are not theirs to change.
        """
        self.require_tokenizer("chat messages need the chat template", "messages")
        template = getattr(self._enc_tokenizer, "chat_template", None)
        if not template:
            raise APIError(400, f"model `{self.model_name}` has no chat template; use /v1/completions",
                           param="messages", code="chat_template_missing")
        try:
            dicts = [m.template_dict(i) for i, m in enumerate(messages)]
        except SamplingParamsError as exc:
            raise APIError(400, str(exc), param=exc.param) from None
        dicts, extra = prepare_chat(dicts, tools or [], template)
        extra = {**{k: v for k, v in (template_kwargs or {}).items() if k not in _RENDER_OWN}, **extra}

        def render() -> tuple[list[int], str]:
            text = self._enc_tokenizer.apply_chat_template(
                dicts, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, **extra)
            self.check_text_length(text, "messages")
            # The template already holds the special tokens (BOS, role markers): add none unless asked.
            return list(self._enc_tokenizer(text, add_special_tokens=add_special_tokens).input_ids), text
        try:
            return await self._in_tokenizer_thread(render)
        except APIError:
            raise
        except Exception as exc:  # jinja TemplateError ("roles must alternate"), encode errors
            raise APIError(400, f"messages could not be rendered with the chat template: {exc}",
                           param="messages") from None

    def check_prompt(self, ids: list[int], params: SamplingParams, param: str = "prompt") -> None:
        """Refuse before submitting what the engine would refuse (same check, same message)."""
        try:
            self.inputs.check_prompt(ids, params, param)
        except InvalidRequestError as exc:
            raise _bad_request(exc) from None
        if len(ids) > self.max_prompt_tokens:
            raise APIError(400, f"the prompt has {len(ids)} tokens; the limit is {self.max_prompt_tokens} "
                                f"(--max-prompt-tokens)", param=param, code="context_length_exceeded")

    def check_text_length(self, text: str, param: str) -> None:
        if len(text) > self.max_prompt_chars:
            raise APIError(400, f"the prompt has {len(text)} characters, more than {self.max_prompt_tokens} tokens "
                                f"can spell ({self.max_prompt_chars}); the limit is {self.max_prompt_tokens} tokens",
                           param=param, code="context_length_exceeded")

    def require_tokenizer(self, what: str, param: str | None = None) -> None:
        """A 400 naming ``what`` when the server has no tokenizer (--skip-tokenizer-init)."""
        if self._dec_tokenizer is None:
            raise APIError(400, f"{NO_TOKENIZER}: {what}", param=param, code="tokenizer_not_loaded")

    def decode(self, ids: list[int]) -> str:
        """Token ids as text, on the event loop's own tokenizer copy (an echoed token-id prompt); "" without
        a tokenizer, as vLLM echoes then."""
        return self._dec_tokenizer.decode(ids) if self._dec_tokenizer is not None else ""

    @property
    def tokenizer_size(self) -> int:
        """Ids the tokenizer can decode (the model's logits may be wider, padded to a round size); without a
        tokenizer, the model's vocabulary."""
        return len(self._dec_tokenizer) if self._dec_tokenizer is not None else self.vocab_size

    def token_pieces(self, ids: list[int]) -> list[str]:
        """The tokenizer's own piece for each id (`Ġhello`), as vLLM's /tokenize returns them."""
        self.require_tokenizer("token pieces need the tokenizer's vocabulary")
        return list(self._dec_tokenizer.convert_ids_to_tokens(ids))

    def token_str(self, token_id: int) -> str:
        """One token as text (logprobs); without a tokenizer, ``token_id:N`` as with return_tokens_as_token_ids."""
        s = self._token_str_cache.get(token_id)
        if s is None:
            s = self._dec_tokenizer.decode([token_id]) if self._dec_tokenizer is not None else f"token_id:{token_id}"
            self._token_str_cache[token_id] = s
        return s

    # ------------------------------------------------------------------ submission
    def build_subs(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
                   cache_salt: str | None = None, lora: Any = None,
                   embeds: list[PromptEmbeds | None] | None = None) -> list[SubRequest]:
        """One engine request per prompt; the engine forks its n (best_of) samples off the shared prompt.
        ``embeds``: per prompt, its positions given as embeddings (None: none)."""
        embeds = embeds or [None] * len(prompts)
        return [SubRequest(f"{request_id}-{i}", ids, params, i, cache_salt, lora, e)
                for i, (ids, e) in enumerate(zip(prompts, embeds, strict=True))]

    async def submit(self, subs: list[SubRequest], priority: int) -> RequestGroup:
        self.check_accepting()
        try:
            group = await self.async_engine.add(subs, priority=priority)
        except QueueFullError as exc:
            raise APIError(503, str(exc), code="queue_full", headers={"Retry-After": str(exc.retry_after)}) from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="engine_dead") from None
        except InvalidRequestError as exc:
            raise _bad_request(exc) from None
        except SamplingParamsError as exc:
            raise APIError(400, str(exc), param=exc.param) from None
        for sub in subs:
            p = sub.params
            max_tokens = p.max_tokens if p.max_tokens is not None else self.max_model_len - len(sub.prompt)
            self.metrics.on_submit(p.n, max_tokens)
        return group

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

    # ------------------------------------------------------------------ vLLM's response options
    def tokens_as_ids(self, requested: bool | None) -> bool:
        """return_tokens_as_token_ids: the request's own choice, else --return-tokens-as-token-ids."""
        return self.config.return_tokens_as_token_ids if requested is None else requested

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
              reasoning_tokens: int | None = None) -> UsageInfo:
        """The token counts; with --enable-prompt-tokens-details, also how many prompt tokens were cached;
        with a ``reasoning_tokens`` count (--reasoning-parser), completion_tokens_details."""
        details = PromptTokensDetails(cached_tokens=cached_tokens) if self.config.enable_prompt_tokens_details else None
        completion = CompletionTokensDetails(reasoning_tokens=reasoning_tokens) if reasoning_tokens is not None else None
        return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                         total_tokens=prompt_tokens + completion_tokens, prompt_tokens_details=details,
                         completion_tokens_details=completion)

    def count_tokens(self, text: str) -> int:
        """How many tokens ``text`` encodes to (usage's reasoning_tokens: the thinking's share of the output)."""
        return len(self._dec_tokenizer(text, add_special_tokens=False).input_ids)

    def check_token_ids(self, params: SamplingParams) -> None:
        """Token ids a request names (logit_bias, allowed_token_ids, logprob_token_ids) must name tokens:
        the sampler would skip others silently."""
        for name, ids in (("logit_bias", params.logit_bias or {}), ("allowed_token_ids", params.allowed_token_ids or []),
                          ("logprob_token_ids", params.logprob_token_ids or [])):
            bad = sorted(t for t in ids if t >= self.tokenizer_size)
            if bad:
                raise APIError(400, f"{name} has token ids outside the vocabulary of {self.tokenizer_size} tokens: "
                                    f"{bad[:8]}", param=name)

    def set_log_info(self, request: Request, request_id: str, prompt_tokens: int, completion_tokens: int,
                     finish: str | None) -> None:
        request.state.log_info = (f"id={request_id} prompt_tokens={prompt_tokens} "
                                  f"completion_tokens={completion_tokens} finish={finish}")
