"""The tokens a relayed response actually used, read off the bytes as they pass through the router.

Non-streamed responses carry `usage.total_tokens` in their JSON body (kept up to `max_body` bytes,
which any completion's JSON fits). Streamed responses carry it in the final chunk only when the client
asked for `stream_options.include_usage`; otherwise each SSE event with generated text counts as one
completion token (the engine emits one event per decoding step) on top of the prompt estimate. A
response with neither (an error, a cut-off stream) reports None: the caller then keeps what it knows.
"""
from __future__ import annotations

import json
from typing import Any


def _total(obj: Any) -> int | None:
    usage = obj.get("usage") if isinstance(obj, dict) else None
    if not isinstance(usage, dict):
        return None
    total = usage.get("total_tokens")
    if isinstance(total, int) and not isinstance(total, bool) and total >= 0:
        return total
    parts = [usage.get("prompt_tokens"), usage.get("completion_tokens")]
    if all(isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in parts):
        return parts[0] + parts[1]
    return None


def _has_text(event: Any) -> bool:
    for choice in (event.get("choices") or []) if isinstance(event, dict) else []:
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
        if (choice.get("text") or delta.get("content") or delta.get("tool_calls") or delta.get("reasoning")
                or delta.get("reasoning_content")):   # vLLM 0.33 names it reasoning, older vLLM reasoning_content
            return True
    return False


class UsageMeter:
    """Feed it the response chunks in order; `used(prompt_estimate)` is the tokens to charge."""

    def __init__(self, streamed: bool, max_body: int = 4 * 1024 * 1024) -> None:
        self.streamed = streamed
        self.max_body = max_body
        self._buf = bytearray()
        self._overflow = False
        self.reported: int | None = None     # usage the upstream stated
        self.text_events = 0                 # streamed events that carried generated text

    def feed(self, chunk: bytes) -> None:
        if not self.streamed:
            if len(self._buf) + len(chunk) > self.max_body:
                self._overflow = True
                self._buf.clear()
            elif not self._overflow:
                self._buf += chunk
            return
        self._buf += chunk
        *lines, rest = self._buf.split(b"\n")
        self._buf = bytearray(rest[-self.max_body:])
        for line in lines:
            self._event(line.strip())

    def _event(self, line: bytes) -> None:
        if not line.startswith(b"data:"):
            return
        data = line[5:].strip()
        if not data or data == b"[DONE]":
            return
        try:
            event = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError):
            return
        total = _total(event)
        if total is not None:
            self.reported = total
        if _has_text(event):
            self.text_events += 1

    def finish(self) -> None:
        """The body ended: parse a non-streamed body, or the last SSE line if it lacked its newline."""
        if self.streamed:
            if self._buf:
                self._event(bytes(self._buf).strip())
            self._buf.clear()
            return
        if self._overflow or not self._buf:
            return
        try:
            self.reported = _total(json.loads(bytes(self._buf)))
        except (UnicodeDecodeError, json.JSONDecodeError):
            pass
        self._buf.clear()

    def used(self, prompt_estimate: int) -> int | None:
        """Tokens the request consumed: the stated usage, else prompt estimate + counted stream events."""
        if self.reported is not None:
            return self.reported
        if self.streamed and self.text_events:
            return prompt_estimate + self.text_events
        return None
