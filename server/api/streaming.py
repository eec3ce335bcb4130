"""Server-sent events: the SSE framing, the guard that ends every stream with [DONE], and the tracker
that turns the engine's cumulative outputs into per-choice deltas."""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel

from pagedmodel.server.engine.outputs import CompletionOutput
from .async_engine import EngineDeadError, RequestGroup
from .errors import APIError
from .protocol import UsageInfo
from .serving import OpenAIServing

logger = logging.getLogger("pagedmodel.server.api")


def stream_headers(request_id: str) -> dict[str, str]:
    # no-cache / X-Accel-Buffering: proxies (nginx, our router) must pass SSE chunks through unbuffered
    return {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "X-Request-Id": request_id}


def sse(payload: BaseModel | dict[str, Any]) -> str:
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


async def guarded_stream(serving: OpenAIServing, group: RequestGroup, body: AsyncIterator[str]) -> AsyncIterator[str]:
    """Wrap a chunk generator: abort on disconnect, report engine death in-band, always end with [DONE].

    A stream that sends nothing for --stream-idle-timeout (the engine stalled, or queued it that long)
    is ended with an error event and aborted, so no connection waits on it forever.
    """
    idle = serving.config.limits.stream_idle_timeout
    try:
        while True:
            try:
                chunk = await asyncio.wait_for(body.__anext__(), idle)
            except StopAsyncIteration:
                break
            yield chunk
    except asyncio.TimeoutError:
        yield sse(APIError(504, f"no output for {idle:g}s (--stream-idle-timeout); the request was aborted",
                           code="stream_idle_timeout").body())
    except EngineDeadError as exc:
        yield sse(APIError(500, f"request failed: {exc}", code="engine_error").body())
    except Exception:   # headers are sent: report in-band, keep the traceback in our log
        logger.exception("error while streaming a response")
        yield sse(APIError(500, "internal server error", code="internal_error").body())
    finally:
        # A client that went away cancels us at the await above; this frees its KV blocks before the next step.
        serving.async_engine.abort(group)
    yield "data: [DONE]\n\n"


def usage_chunk(response_cls: type[BaseModel], request_id: str, created: int, model: str, usage: UsageInfo) -> str:
    """The last chunk of a stream asked for `stream_options.include_usage`: no choices, the token counts."""
    return sse(response_cls(id=request_id, created=created, model=model, choices=[], usage=usage))


def usage_options(stream_options: Any, force: bool = False) -> tuple[bool, bool]:
    """(a final usage chunk, usage on every chunk): vLLM's continuous_usage_stats counts only with include_usage;
    ``force`` (--enable-force-include-usage) turns both on whatever the request says, as vLLM does."""
    if force:
        return True, True
    include = bool(stream_options and stream_options.include_usage)
    return include, include and bool(stream_options.continuous_usage_stats)


class ChoiceTotals:
    """What a stream has sent of each choice so far. The engine hands a stream deltas (output kind DELTA):
    each output holds a choice's new text, tokens and logprobs, and its finish once; these running totals give
    a piece's text offset (completions' logprobs) and the tokens a choice has had (usage)."""

    def __init__(self, n_choices: int):
        self.text = [0] * n_choices
        self.tokens = [0] * n_choices

    def add(self, choice: int, o: CompletionOutput) -> int:
        """Count ``o`` (a delta) into ``choice``'s totals; returns the text offset it starts at."""
        offset = self.text[choice]
        self.text[choice] += len(o.text)
        self.tokens[choice] += len(o.token_ids)
        return offset
