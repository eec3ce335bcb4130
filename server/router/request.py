"""One client request as the router carries it: built once by the handler, passed to dispatch and relay.

It holds the request in both the forms routing needs, decided once: the text key the hash strategies
read (`prompt_key`) and, for `prefix-cache`, the prompt's block hashes (`chains`); plus its priority, its
tenant admission, the model that restricts its replicas, and, as it goes, the replicas it was tried on.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from .prefix_index import PromptChains
from .tenancy import Admission
from .upstreams import Upstream


@dataclass
class RoutedRequest:
    method: str
    path_qs: str                          # path and query, appended to the upstream's base URL
    body: bytes                           # forwarded unchanged
    headers: dict[str, str]               # the client's, less hop-by-hop ones
    priority: int = 0                     # lower first (vLLM's convention)
    prompt_key: str = ""                  # what the hash strategies read (`prompt_key()` below)
    chains: PromptChains | None = None    # the prompt's block hashes (prefix-cache strategy only)
    admission: Admission | None = None    # the tenant's reservation, settled by the response's usage
    model: str | None = None              # the request's `model`: only upstreams serving it may take it
    tried: set[str] = field(default_factory=set)   # upstreams an attempt went to (a retry avoids them)
    upstream: Upstream | None = None      # granted by dispatch while it waited in the queue


def _tools_key(tools: Any) -> str:
    """Tool definitions as canonical JSON: the same tools (whatever their key order) give the same key."""
    return "tools:" + json.dumps(tools, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def prompt_key(body: dict[str, Any]) -> str:
    """The leading text prefix affinity hashes: the prompt, or the chat messages rendered in order.

    A chat request's tools go where the engine renders them, into the system prompt ahead of the
    conversation (after the first system message's own text), so requests sharing a system prompt and
    tools share an upstream, and with it their cached prefix.
    """
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]   # a batch of prompts: the first one decides
    if isinstance(prompt, list):   # token ids
        return ",".join(map(str, prompt))
    if isinstance(prompt, str):
        return prompt
    messages = body.get("messages")
    if isinstance(messages, list):
        parts = []
        for m in messages:
            if isinstance(m, dict):
                content = m.get("content")
                parts.append(f"{m.get('role')}:{content if isinstance(content, str) else json.dumps(content)}")
        tools = body.get("tools")
        if tools:
            first_is_system = bool(messages) and isinstance(messages[0], dict) and messages[0].get("role") == "system"
            parts.insert(1 if first_is_system else 0, _tools_key(tools))
        return "\n".join(parts)
    return ""
