"""The Hermes tool-call format (Hermes 2 Pro, Qwen2/2.5, the prompt we render for SmolLM2):
`<tool_call>{"name": "f", "arguments": {...}}</tool_call>`, one block per call, anywhere in the text.

A block that is not a JSON object with a string `name` stays in the content, markup and all: the client
sees what the model wrote rather than losing it.
"""
from __future__ import annotations

import json
import re

from ..tool_call_scan import ARGUMENT_KEYS, CallScan, scan_call
from .base import ExtractedToolCalls, ParsedToolCall, StreamDelta
from .call_deltas import CallDeltas

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)


def parse_call(body: str) -> ParsedToolCall | None:
    """One block's JSON as a call, or None if it is not one."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in ARGUMENT_KEYS if k in obj), {})
    if not isinstance(args, dict):
        return None
    return ParsedToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class HermesToolParser:
    name = "hermes"

    def extract(self, text: str) -> ExtractedToolCalls:
        calls: list[ParsedToolCall] = []
        kept: list[str] = []
        pos = 0
        for m in _BLOCK.finditer(text):
            call = parse_call(m.group(1).strip())
            if call is None:
                continue   # malformed: stays in the content
            kept.append(text[pos:m.start()])
            pos = m.end()
            calls.append(call)
        if not calls:   # nothing taken out: the text as the model wrote it, as without tools
            return ExtractedToolCalls([], text or None)
        kept.append(text[pos:])
        content = "".join(kept).strip()
        return ExtractedToolCalls(calls, content or None)

    def streamer(self) -> "HermesStreamer":
        return HermesStreamer()


def _partial_open(text: str) -> int:
    """Length of the longest suffix of text that could still become OPEN (held back from the content)."""
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-k:]):
            return k
    return 0


class HermesStreamer:
    """Content outside blocks streams as it comes (minus a possible partial `<tool_call>`); inside a
    block, the call's name is sent once complete and its arguments as they grow."""

    def __init__(self) -> None:
        self._buf = ""            # text not yet sent as content (outside) or the current block's body (inside)
        self._inside = False
        self._deltas = CallDeltas()
        self._index = 0           # the index the current block's call gets

    @property
    def called(self) -> bool:
        return self._deltas.count > 0

    def feed(self, text: str) -> StreamDelta:
        self._buf += text
        out = StreamDelta()
        while True:
            if not self._inside:
                at = self._buf.find(OPEN)
                if at < 0:
                    keep = _partial_open(self._buf)
                    out.content += self._buf[:len(self._buf) - keep]
                    self._buf = self._buf[len(self._buf) - keep:]
                    return out
                out.content += self._buf[:at]
                self._buf, self._inside = self._buf[at + len(OPEN):], True
                continue
            at = self._buf.find(CLOSE)
            if at < 0:
                # A CLOSE arriving in pieces is never part of the arguments: the scan stops at their end.
                self._stream_block(self._buf, out)
                return out
            body, self._buf, self._inside = self._buf[:at], self._buf[at + len(CLOSE):], False
            self._end_block(body, out)

    def finish(self) -> StreamDelta:
        out = StreamDelta()
        if self._inside:
            self._end_block(self._buf, out, closed=False)   # cut off (max_tokens): judged as it stands
        else:
            out.content += self._buf
        self._buf, self._inside = "", False
        return out

    def _stream_block(self, body: str, out: StreamDelta) -> None:
        scan = scan_call(body)
        if scan is not None:
            out.tool_calls += self._deltas.update(self._index, scan)

    def _end_block(self, body: str, out: StreamDelta, closed: bool = True) -> None:
        if self._deltas.named(self._index):
            # Already announced: send the rest of its arguments as the scan reads them.
            self._stream_block(body, out)
            self._index += 1
            return
        call = parse_call(body.strip())
        if call is None:
            out.content += OPEN + body + (CLOSE if closed else "")
            return
        out.tool_calls += self._deltas.update(self._index, CallScan(call.name, call.arguments, complete=True))
        self._index += 1
