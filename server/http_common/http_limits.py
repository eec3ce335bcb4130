"""The HTTP limits `pagedmodel serve` and `pagedmodel router` share: one set of flags with the same
names and defaults, and one check of a request's fields, so a request the router lets through is
one the engine accepts and both refuse with the same message (docs/limits.md is the table).

The per-request field limits may be lowered by flag but not raised above the engine's own ceilings
(server/engine/sampling_params.py): those bound what one request may cost the KV cache and sampler.
"""
from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from pagedmodel.server.engine.sampling_params import MAX_LOGPROBS, MAX_N, MAX_STOP_STRING_LEN, MAX_STOP_STRINGS
from .errors import APIError

MiB = 1 << 20


@dataclass(frozen=True)
class HTTPLimits:
    """Every bound a client's request meets before it costs the server anything more than the bytes read."""

    max_body_bytes: int = 8 * MiB          # far beyond any context window's JSON (128k token ids ~ 1 MiB)
    max_header_bytes: int = 16 << 10       # request line + all headers
    request_read_timeout: float = 30.0     # seconds to receive the headers, and again the body
    keep_alive_timeout: float = 5.0        # an idle keep-alive connection closes after this
    max_connections: int = 1024            # requests in progress at once (each holds a connection)
    stream_idle_timeout: float = 300.0     # seconds a stream may go without a byte before it is ended
    max_prompt_tokens: int | None = None   # None: the engine's --max-model-len
    max_n: int = MAX_N
    max_best_of: int = MAX_N
    max_logprobs: int = MAX_LOGPROBS
    max_stop_strings: int = MAX_STOP_STRINGS
    max_stop_string_len: int = MAX_STOP_STRING_LEN
    # The router's ceiling; `serve` raises it to the model's vocabulary, as vLLM does (serve.py)
    max_logprobs_ceiling: int = MAX_LOGPROBS

    def __post_init__(self) -> None:
        for name, ceiling in (("max_n", MAX_N), ("max_best_of", MAX_N), ("max_logprobs", self.max_logprobs_ceiling),
                              ("max_stop_strings", MAX_STOP_STRINGS), ("max_stop_string_len", MAX_STOP_STRING_LEN)):
            value = getattr(self, name)
            if not 0 <= value <= ceiling or (name in ("max_n", "max_best_of") and value < 1):
                raise ValueError(f"--{name.replace('_', '-')} must be between {int(name in ('max_n', 'max_best_of'))} "
                                 f"and the engine's ceiling {ceiling}, got {value}")
        for name in ("max_body_bytes", "max_header_bytes", "max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("request_read_timeout", "keep_alive_timeout", "stream_idle_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0 seconds, got {getattr(self, name)}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError(f"--max-prompt-tokens must be >= 1, got {self.max_prompt_tokens}")

    # ------------------------------------------------------------------ the per-request fields
    def check_fields(self, body: dict[str, Any]) -> None:
        """Raise the 400 for the first field of a decoded JSON body over a limit.

        Fields of the wrong type are left alone: the engine's request models name those precisely.
        """
        n = _int(body.get("n"))
        if n is not None and n > self.max_n:
            raise _over("n", f"n must be at most {self.max_n}, got {n}")
        best_of = _int(body.get("best_of"))
        if best_of is not None and best_of > self.max_best_of:
            raise _over("best_of", f"best_of must be at most {self.max_best_of}, got {best_of}")
        for name in ("logprobs", "top_logprobs", "prompt_logprobs"):
            v = _int(body.get(name))
            if v is not None and v > self.max_logprobs:
                raise _over(name, f"{name} must be at most {self.max_logprobs} (--max-logprobs), got {v}")
        stop = body.get("stop")
        stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
        if len(stops) > self.max_stop_strings:
            raise _over("stop", f"at most {self.max_stop_strings} stop strings are allowed, got {len(stops)}")
        if any(isinstance(s, str) and len(s) > self.max_stop_string_len for s in stops):
            raise _over("stop", f"each stop string may be at most {self.max_stop_string_len} characters")
        ids = body.get("stop_token_ids")
        if isinstance(ids, list) and len(ids) > self.max_stop_strings:
            raise _over("stop_token_ids", f"at most {self.max_stop_strings} stop_token_ids are allowed, got {len(ids)}")
        if self.max_prompt_tokens is not None:
            longest = max((len(p) for p in _token_id_prompts(body.get("prompt"))), default=0)
            if longest > self.max_prompt_tokens:
                raise _over("prompt", f"prompt has {longest} tokens; the limit is {self.max_prompt_tokens} "
                                      f"(--max-prompt-tokens)", code="context_length_exceeded")


async def read_body(declared: str | None, chunks: AsyncIterator[bytes], limits: HTTPLimits) -> bytes:
    """The whole body, refused with 413 past max_body_bytes (declared or counted) and 408 when it takes
    longer than request_read_timeout to arrive (a client trickling it holds a connection and a buffer)."""
    limit = limits.max_body_bytes
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes (--max-body-bytes)",
                       code="body_too_large")

    async def collect() -> bytes:
        parts: list[bytes] = []
        size = 0
        async for chunk in chunks:
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"request body exceeds the limit of {limit} bytes (--max-body-bytes)",
                               code="body_too_large")
            parts.append(chunk)
        return b"".join(parts)
    try:
        return await asyncio.wait_for(collect(), limits.request_read_timeout)
    except asyncio.TimeoutError:
        raise APIError(408, f"request body not received within {limits.request_read_timeout:g}s "
                            f"(--request-read-timeout)", code="request_timeout", headers={"Connection": "close"}) from None


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _token_id_prompts(prompt: Any) -> list[list[Any]]:
    """A completions prompt's token-id lists (text prompts are counted after tokenizing, by the engine)."""
    if not isinstance(prompt, list) or not prompt:
        return []
    if all(isinstance(x, int) for x in prompt):
        return [prompt]
    return [p for p in prompt if isinstance(p, list)]


def _over(param: str, message: str, code: str = "limit_exceeded") -> APIError:
    return APIError(400, message, param=param, code=code)


# ---------------------------------------------------------------------- CLI
def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def add_limit_arguments(parser: argparse.ArgumentParser, *, engine: bool) -> None:
    """The limit flags, named and defaulted alike on `serve` and `router`; `engine` adds the ones only
    the engine can enforce (it alone tokenizes text prompts)."""
    d = HTTPLimits()
    g = parser.add_argument_group("limits (docs/limits.md)")
    g.add_argument("--max-body-bytes", type=positive_int, default=d.max_body_bytes,
                   help="largest request body; more is 413")
    g.add_argument("--max-header-bytes", type=positive_int, default=d.max_header_bytes,
                   help="largest request line + headers; more is 431")
    g.add_argument("--request-read-timeout", type=_positive_seconds, default=d.request_read_timeout, metavar="S",
                   help="seconds to receive a request's headers, and again its body; slower is 408")
    g.add_argument("--keep-alive-timeout", type=_positive_seconds, default=d.keep_alive_timeout, metavar="S",
                   help="seconds an idle keep-alive connection stays open")
    g.add_argument("--max-connections", type=positive_int, default=d.max_connections,
                   help="open client connections; a request on one past this gets 503 with Retry-After")
    g.add_argument("--stream-idle-timeout", type=_positive_seconds, default=d.stream_idle_timeout, metavar="S",
                   help="seconds a streamed response may send nothing before it is ended with an error event")
    g.add_argument("--max-prompt-tokens", type=positive_int, default=None,
                   help="longest prompt in tokens (default: --max-model-len)" if engine else
                        "longest token-id prompt (text prompts are counted by the engine)")
    g.add_argument("--max-n", type=positive_int, default=d.max_n, help=f"largest n (ceiling {MAX_N})")
    g.add_argument("--max-best-of", type=positive_int, default=d.max_best_of, help=f"largest best_of (ceiling {MAX_N})")
    if engine:   # vLLM's flag: up to the vocabulary, -1 meaning all of it (serve.py caps it at the model's)
        g.add_argument("--max-logprobs", type=logprobs_limit, default=d.max_logprobs,
                       help="largest logprobs / top_logprobs / prompt_logprobs (-1 or more than the "
                            "vocabulary: the vocabulary size)")
    else:
        g.add_argument("--max-logprobs", type=non_negative_int, default=d.max_logprobs,
                       help=f"largest logprobs / top_logprobs / prompt_logprobs (ceiling {MAX_LOGPROBS})")
    g.add_argument("--max-stop-strings", type=non_negative_int, default=d.max_stop_strings,
                   help=f"most stop strings (and stop_token_ids) per request (ceiling {MAX_STOP_STRINGS})")
    g.add_argument("--max-stop-string-len", type=positive_int, default=d.max_stop_string_len,
                   help=f"longest stop string in characters (ceiling {MAX_STOP_STRING_LEN})")


def logprobs_limit(text: str) -> int:
    """`serve --max-logprobs`: a count, or -1 for the whole vocabulary (vLLM's meaning)."""
    value = int(text)
    if value < -1:
        raise argparse.ArgumentTypeError(f"must be >= 0, or -1 for the vocabulary, got {value}")
    return value


def limits_from_args(args: argparse.Namespace, max_logprobs_ceiling: int = MAX_LOGPROBS,
                     max_logprobs: int | None = None) -> HTTPLimits:
    """The parsed flags as HTTPLimits; raises ValueError (the CLI's exit 2) for a value above a ceiling.

    ``max_logprobs`` overrides the flag once `serve` knows the vocabulary it resolves to."""
    return HTTPLimits(max_logprobs_ceiling=max_logprobs_ceiling,
                      max_body_bytes=args.max_body_bytes, max_header_bytes=args.max_header_bytes,
                      request_read_timeout=args.request_read_timeout, keep_alive_timeout=args.keep_alive_timeout,
                      max_connections=args.max_connections, stream_idle_timeout=args.stream_idle_timeout,
                      max_prompt_tokens=args.max_prompt_tokens, max_n=args.max_n, max_best_of=args.max_best_of,
                      max_logprobs=args.max_logprobs if max_logprobs is None else max_logprobs,
                      max_stop_strings=args.max_stop_strings,
                      max_stop_string_len=args.max_stop_string_len)
