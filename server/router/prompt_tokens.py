"""The prompt's token ids as the engine will see them, computed in the router for `prefix-cache` routing.

With `--tokenizer` (the model directory or name the engines get as `--model`) the router encodes
locally: about a millisecond on a worker thread. Without it, it asks an engine's POST /tokenize
(RemoteTokenizer), which renders exactly what that engine's completion would see and needs no
configuration (what the operator deploys), at the cost of one round trip through that engine's
event loop per request; a production router with the model files at hand should pass --tokenizer. Completions are encoded as the engine does (special tokens added: encode_prompt); chat
messages go through the same template path as the engine's /v1/chat/completions (ChatMessage,
tools, prepare_chat, apply_chat_template, no special tokens added). A request the router cannot
render (bad messages, no template) yields None: it is routed by load and the engine answers it with
its own error. The request's `cache_salt`, when given, is part of its hashes (the engine's blocks for
it carry the salt), so a salted request matches only blocks cached under the same salt.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import aiohttp

from pagedmodel.server.engine.input_processor import encode_prompt
from .prefix_index import PromptChains


def load_tokenizer(model: str) -> Any:
    """The tokenizer of `model` (a directory, or a name the engine resolves the same way)."""
    from transformers import AutoTokenizer

    from pagedmodel.server.engine.model_store import resolve_model
    return AutoTokenizer.from_pretrained(str(resolve_model(model)))


def token_ids(tokenizer: Any, path: str, body: dict[str, Any]) -> list[int] | None:
    """The engine's prompt token ids for this request body, or None if the router cannot tell."""
    if path.endswith("/chat/completions"):
        return _chat_ids(tokenizer, body)
    if not path.endswith("/completions"):
        return None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]   # a batch: the first prompt decides, as for the hash strategy
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    if isinstance(prompt, str):
        try:
            return encode_prompt(tokenizer, prompt)
        except ValueError:
            return None
    return None


def _chat_ids(tokenizer: Any, body: dict[str, Any]) -> list[int] | None:
    template = getattr(tokenizer, "chat_template", None)
    messages = body.get("messages")
    if not template or not isinstance(messages, list) or not messages:
        return None
    try:
        # The engine API's own chat rendering, so the ids match its /v1/chat/completions exactly. Imported
        # here, not at the top: only a router given --tokenizer (which brings transformers and the model
        # files anyway) renders chat locally; the router as deployed never loads server/api.
        from pagedmodel.server.api.protocol import ChatMessage
        from pagedmodel.server.api.tool_definitions import parse_tools
        from pagedmodel.server.api.tool_prompt import prepare_chat

        dicts = [ChatMessage.model_validate(m).template_dict(i) for i, m in enumerate(messages)]
        dicts, extra = prepare_chat(dicts, parse_tools(body.get("tools")), template)
        text = tokenizer.apply_chat_template(dicts, tokenize=False,
                                             add_generation_prompt=body.get("add_generation_prompt", True) is not False,
                                             continue_final_message=body.get("continue_final_message") is True,
                                             **extra)
        return list(tokenizer(text, add_special_tokens=False).input_ids)
    except Exception:   # whatever the engine would refuse (400) it answers itself
        return None


class PromptTokenizer:
    """Encodes on one worker thread so the router's event loop never waits on a tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="router-tokenize")

    async def chains(self, path: str, body: dict[str, Any]) -> PromptChains | None:
        ids = await asyncio.get_running_loop().run_in_executor(self._pool, token_ids, self.tokenizer, path, body)
        return PromptChains(ids, salt_of(body)) if ids else None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def salt_of(body: dict[str, Any]) -> bytes:
    salt = body.get("cache_salt")
    return salt.encode() if isinstance(salt, str) and salt else b""


def tokenize_body(path: str, body: dict[str, Any]) -> dict[str, Any] | list[int] | None:
    """What to ask an engine's /tokenize for this request (token ids when the prompt is ids already)."""
    if path.endswith("/chat/completions"):
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        out: dict[str, Any] = {"messages": messages}
        for key in ("tools", "add_generation_prompt", "continue_final_message"):
            if key in body:
                out[key] = body[key]
        return out
    if not path.endswith("/completions"):
        return None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    return {"prompt": prompt} if isinstance(prompt, str) else None


class RemoteTokenizer:
    """Token ids from an engine's POST /tokenize; None on any failure (the request is routed by load)."""

    def __init__(self, session: aiohttp.ClientSession, api_key: str | None = None, timeout: float = 2.0) -> None:
        self.session = session
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = aiohttp.ClientTimeout(total=timeout)

    async def chains(self, url: str, path: str, body: dict[str, Any]) -> PromptChains | None:
        ask = tokenize_body(path, body)
        if ask is None or isinstance(ask, list):
            return PromptChains(ask, salt_of(body)) if ask else None
        try:
            async with self.session.post(url + "/tokenize", json=ask, headers=self.headers,
                                         timeout=self.timeout) as resp:
                if resp.status != 200:
                    return None
                ids = (await resp.json()).get("tokens")
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return None
        if not isinstance(ids, list) or not ids:
            return None
        return PromptChains(ids, salt_of(body))
