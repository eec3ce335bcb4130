"""A request's prompt, checked and tokenized: the one validation the engine and the HTTP server share.

Prompts take vLLM's offline forms: a string, a list of token ids, ``{"prompt": str}``,
``{"prompt_token_ids": [...]}`` or, with --enable-prompt-embeds, ``{"prompt_embeds": tensor}`` (the prompt as
input embeddings, [num_tokens, hidden_size]); each dict optionally with ``"cache_salt"`` (prefix-cache entries
are only shared between requests with the same salt, e.g. per tenant). The chat API sends text with embedding
parts as ``{"prompt_token_ids": [...], "prompt_embeds": PromptEmbeds}`` (prompt_embeds.py). Every refusal is an
InvalidRequestError whose message the API returns as is (HTTP 400), with the parameter it blames and,
for context-length errors, OpenAI's ``context_length_exceeded`` code.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from .prompt_embeds import PLACEHOLDER_TOKEN_ID, PromptEmbeds, check_embeds_tensor
from .sampling_params import SamplingParams

PROMPT_KEYS = ("prompt", "prompt_token_ids")
PROMPT_DICT_KEYS = frozenset(PROMPT_KEYS + ("prompt_embeds", "cache_salt"))
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"

if TYPE_CHECKING:   # the API imports this module; torch loads with the engine
    import torch


class InvalidRequestError(ValueError):
    """The request can never be served as asked (HTTP 400); ``param`` names the culprit."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(frozen=True)
class ProcessedPrompt:
    """A prompt parsed, tokenized and checked against its request's parameters. Its maker ran the checks
    (``InputProcessor.process``, or ``check_prompt`` on its token ids, as the API does before it submits),
    so the engine takes it as it is: a request is validated once."""

    text: str | None          # None when the prompt came as token ids or embeddings
    token_ids: list[int]
    cache_salt: str | None
    embeds: PromptEmbeds | None = None   # positions whose input is an embedding row (their ids: placeholders)


NO_TOKENIZER = "this server runs without a tokenizer (--skip-tokenizer-init)"


def encode_prompt(tokenizer: Any, text: str, param: str = "prompt") -> list[int]:
    """Token ids of ``text``; the tokenizer is a parameter so a server can encode on its own copy in its
    own thread (None: --skip-tokenizer-init, which takes token ids only)."""
    if tokenizer is None:
        raise InvalidRequestError(f"{NO_TOKENIZER}: a prompt must be token ids, not text", param)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        # JSON allows "\ud800" escapes, but an unpaired surrogate is not text and cannot be tokenized.
        raise InvalidRequestError("prompt contains an unpaired UTF-16 surrogate (invalid Unicode)", param) from None
    try:
        return list(tokenizer(text).input_ids)
    except Exception as exc:  # the tokenizer's own failures; the client gets the class, the log the rest
        raise InvalidRequestError(f"prompt could not be tokenized: {type(exc).__name__}", param) from None


def check_cache_salt(salt: object) -> str | None:
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise InvalidRequestError(f"cache_salt must be a non-empty string, got {salt!r}", "cache_salt")
    return salt


@dataclass(frozen=True)
class EmbeddingInput:
    """What prompt embeddings must look like (--enable-prompt-embeds): the model's hidden size and dtype."""
    hidden_size: int
    dtype: torch.dtype


class InputProcessor:
    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int, num_kv_blocks: int, block_size: int,
                 embeddings: EmbeddingInput | None = None, thinking_budgets: bool = False):
        self.embeddings = embeddings   # None: prompt embeddings are refused
        self.tokenizer = tokenizer
        self.thinking_budgets = thinking_budgets   # the engine knows thinking markers (--reasoning-config)
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size

    def process(self, prompt: object, params: SamplingParams, cache_salt: str | None = None) -> ProcessedPrompt:
        """Parse, tokenize and check one prompt (any of the forms in the module docstring); a ProcessedPrompt
        was checked by its maker and is returned as it is."""
        if isinstance(prompt, ProcessedPrompt):
            if cache_salt is not None:
                raise InvalidRequestError("cache_salt is given twice: in the prompt and as an argument", "cache_salt")
            return prompt
        if isinstance(prompt, Mapping):
            if "prompt_embeds" in prompt:
                return self._process_embeds(prompt, params, cache_salt)
            prompt, cache_salt = self._unpack(prompt, cache_salt)
        if isinstance(prompt, str):
            text, ids = prompt, encode_prompt(self.tokenizer, prompt)
        elif isinstance(prompt, (list, tuple)):
            text, ids = None, list(prompt)
        else:
            raise InvalidRequestError("a prompt is a string, a list of token ids, or a dict with 'prompt' or "
                                      f"'prompt_token_ids'; got {type(prompt).__name__}", "prompt")
        self.check_prompt(ids, params)
        return ProcessedPrompt(text, ids, check_cache_salt(cache_salt))

    def embedding_rows(self, tensor: object, param: str = "prompt_embeds") -> torch.Tensor:
        """A caller's tensor checked (shape, hidden size, dtype, finite, length) and cast to the model's dtype."""
        if self.embeddings is None:
            raise InvalidRequestError("prompt embeddings need the server started with --enable-prompt-embeds", param)
        try:
            return check_embeds_tensor(tensor, self.embeddings.hidden_size, self.embeddings.dtype,
                                       self.max_model_len, param)
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param) from None

    def _process_embeds(self, prompt: Mapping, params: SamplingParams, cache_salt: str | None) -> ProcessedPrompt:
        """``{"prompt_embeds": tensor}``, or ids with a PromptEmbeds naming which of them are embeddings."""
        if self.embeddings is None:
            raise InvalidRequestError("prompt embeddings need the server started with --enable-prompt-embeds",
                                      "prompt_embeds")
        if "prompt" in prompt:
            raise InvalidRequestError("a prompt dict needs exactly one of 'prompt' and 'prompt_embeds'", "prompt")
        if params.prompt_logprobs is not None:
            raise InvalidRequestError("prompt_logprobs is not compatible with prompt embeddings (there are no "
                                      "prompt tokens to score)", "prompt_logprobs")
        cache_salt = self._dict_salt(prompt, cache_salt)
        embeds = prompt["prompt_embeds"]
        if isinstance(embeds, PromptEmbeds):
            ids = list(prompt.get("prompt_token_ids") or [])
            if any(s.end > len(ids) for s in embeds.spans):
                raise InvalidRequestError("prompt_embeds spans reach past the prompt's token ids", "prompt_embeds")
        else:
            if "prompt_token_ids" in prompt:
                raise InvalidRequestError("'prompt_token_ids' goes with a PromptEmbeds, not a tensor", "prompt")
            rows = self.embedding_rows(embeds)
            embeds, ids = PromptEmbeds.whole(rows), [PLACEHOLDER_TOKEN_ID] * rows.shape[0]
        self.check_prompt(ids, params)
        return ProcessedPrompt(None, ids, check_cache_salt(cache_salt), embeds)

    @staticmethod
    def _dict_salt(prompt: Mapping, cache_salt: str | None) -> str | None:
        """A prompt dict's cache_salt (or the argument's); refuses unknown fields and a salt given twice."""
        unknown = sorted(map(str, set(prompt) - PROMPT_DICT_KEYS))
        if unknown:
            raise InvalidRequestError(f"unknown prompt field(s) {unknown}; expected {sorted(PROMPT_DICT_KEYS)}",
                                      "prompt")
        if "cache_salt" in prompt and cache_salt is not None:
            raise InvalidRequestError("cache_salt is given twice: in the prompt and as an argument", "cache_salt")
        return prompt.get("cache_salt", cache_salt)

    @classmethod
    def _unpack(cls, prompt: Mapping, cache_salt: str | None) -> tuple[object, str | None]:
        cache_salt = cls._dict_salt(prompt, cache_salt)
        given = [k for k in PROMPT_KEYS if k in prompt]
        if len(given) != 1:
            raise InvalidRequestError("a prompt dict needs exactly one of 'prompt' and 'prompt_token_ids'", "prompt")
        value = prompt[given[0]]
        if given[0] == "prompt" and not isinstance(value, str):
            raise InvalidRequestError(f"'prompt' must be a string, got {type(value).__name__}", "prompt")
        if given[0] == "prompt_token_ids" and not isinstance(value, (list, tuple)):
            raise InvalidRequestError(f"'prompt_token_ids' must be a list of token ids, got {type(value).__name__}",
                                      "prompt")
        return value, cache_salt

    def check_prompt(self, ids: list[int], params: SamplingParams, param: str = "prompt") -> None:
        """Refuse a prompt (token ids) that can never be served with ``params``; ``param`` names the prompt
        field in errors (the chat API says "messages")."""
        if not ids:
            raise InvalidRequestError("prompt must not be empty", param)
        bad = next((t for t in ids if not isinstance(t, int) or isinstance(t, bool)), None)
        if bad is not None:
            raise InvalidRequestError(f"token ids must be integers, got {bad!r}", param)
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad} is out of vocabulary: ids are in [0, {self.vocab_size})", param)
        self._check_length(len(ids), params.max_tokens, param)
        if params.thinking_token_budget is not None and not self.thinking_budgets:
            raise InvalidRequestError("thinking_token_budget needs a server started with --reasoning-parser or "
                                      "--reasoning-config (which name the thinking markers); this one has none",
                                      "thinking_token_budget")
        if self.tokenizer is None:
            self._check_needs_no_text(params)
        if params.stop_token_ids and max(params.stop_token_ids) >= self.vocab_size:
            raise InvalidRequestError("stop_token_ids contains ids outside the vocabulary", "stop_token_ids")
        total = len(ids) + (params.max_tokens if params.max_tokens is not None else self.max_model_len - len(ids))
        if params.best_of * -(-total // self.block_size) > self.num_kv_blocks:
            raise InvalidRequestError(
                f"{params.best_of} sequences of up to {total} tokens cannot fit in the KV cache "
                f"({self.num_kv_blocks * self.block_size} tokens)", "max_tokens")

    @staticmethod
    def _check_needs_no_text(params: SamplingParams) -> None:
        """Without a tokenizer there is no output text: what reads or constrains text is refused, not ignored."""
        if params.stop:
            raise InvalidRequestError(f"{NO_TOKENIZER}: stop strings need text; use stop_token_ids", "stop")
        if params.structured_outputs is not None:
            raise InvalidRequestError(f"{NO_TOKENIZER}: structured outputs need the tokenizer's vocabulary",
                                      "structured_outputs")

    def _check_length(self, n: int, max_tokens: int | None, param: str) -> None:
        limit = self.max_model_len
        if n > limit:
            raise InvalidRequestError(f"This model's maximum context length is {limit} tokens, but the prompt has "
                                      f"{n} tokens.", param, CONTEXT_LENGTH_EXCEEDED)
        if n >= limit:
            raise InvalidRequestError(f"This model's maximum context length is {limit} tokens and the prompt has "
                                      f"{n}: no room left to generate.", param, CONTEXT_LENGTH_EXCEEDED)
        if max_tokens is not None and n + max_tokens > limit:
            raise InvalidRequestError(f"This model's maximum context length is {limit} tokens; the prompt has "
                                      f"{n} tokens and max_tokens is {max_tokens}, {n + max_tokens} in total. "
                                      "Lower max_tokens or the prompt.", "max_tokens", CONTEXT_LENGTH_EXCEEDED)
