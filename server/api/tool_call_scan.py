"""Reading tool calls out of JSON text that is still arriving: how far each call object
`{"name": ..., "arguments": ...}` has come, so a stream can send a call's name as soon as it is complete
and its arguments as they grow.

This is not a JSON parser: it only finds where values start and end (brackets, strings and escapes), and
says "not a call" as soon as the text cannot become one. Complete calls are read with `json.loads`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

_WS = " \t\r\n"
_LITERAL_END = ",}] \t\r\n"
ARGUMENT_KEYS = ("arguments", "parameters")   # Hermes models write either


@dataclass
class CallScan:
    name: str | None = None   # set once the name's closing quote arrived
    arguments: str = ""       # the arguments value's text so far (all of it, once complete)
    complete: bool = False    # the call object is closed
    end: int = 0              # just past what was read (past the closing brace when complete)


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def string_end(text: str, i: int) -> int | None:
    """Index just past the string starting at text[i] == '"', or None if it has not closed yet."""
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return None


def value_end(text: str, i: int) -> int | None:
    """Index just past the JSON value starting at text[i], or None if it has not ended yet."""
    c = text[i]
    if c == '"':
        return string_end(text, i)
    if c not in "{[":
        j = i
        while j < len(text) and text[j] not in _LITERAL_END:
            j += 1
        return j if j < len(text) else None   # a literal at the very end may still grow
    depth, j = 0, i
    while j < len(text):
        c = text[j]
        if c == '"':
            end = string_end(text, j)
            if end is None:
                return None
            j = end
            continue
        if c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return None


def scan_call(text: str, start: int = 0) -> CallScan | None:
    """How much of a call object starting at text[start] (after whitespace) has arrived; None: not a call."""
    scan = CallScan()
    i = _skip_ws(text, start)
    if i >= len(text):
        scan.end = i
        return scan
    if text[i] != "{":
        return None
    i += 1
    while True:
        scan.end = i = _skip_ws(text, i)
        if i >= len(text):
            return scan
        if text[i] == "}":
            scan.complete, scan.end = True, i + 1
            return scan
        if text[i] == ",":
            i += 1
            continue
        if text[i] != '"':
            return None
        key_end = string_end(text, i)
        if key_end is None:
            return scan
        key = json.loads(text[i:key_end])
        i = _skip_ws(text, key_end)
        if i >= len(text):
            return scan
        if text[i] != ":":
            return None
        i = _skip_ws(text, i + 1)
        if i >= len(text):
            return scan
        end = value_end(text, i)
        if key == "name":
            if text[i] != '"':
                return None
            if end is None:
                return scan
            scan.name = json.loads(text[i:end])
        elif key in ARGUMENT_KEYS:
            scan.arguments = text[i:] if end is None else text[i:end]
        if end is None:
            return scan
        i = end


def scan_call_array(text: str) -> list[CallScan] | None:
    """The calls of a JSON array of call objects (`tool_choice: "required"`) so far; None: not such an array."""
    i = _skip_ws(text, 0)
    if i >= len(text):
        return []
    if text[i] != "[":
        return None
    i += 1
    calls: list[CallScan] = []
    while True:
        i = _skip_ws(text, i)
        if i >= len(text) or text[i] == "]":
            return calls
        if text[i] == ",":
            i += 1
            continue
        scan = scan_call(text, i)
        if scan is None:
            return None
        calls.append(scan)
        if not scan.complete:
            return calls
        i = scan.end
