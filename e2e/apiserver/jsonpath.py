"""The subset of kubectl JSONPath that printer columns use.

Supports ``.a.b``, ``['a.b']``, ``[0]``, ``[*]`` and filters ``[?(@.type=="Ready")]``.
"""
from __future__ import annotations

import re
from typing import Any

_TOKEN = re.compile(r"""
    \.(?P<name>[A-Za-z0-9_\-$]+(?:\\\.[A-Za-z0-9_\-/]+)*)
  | \[\s*'(?P<quoted>[^']*)'\s*\]
  | \[\s*"(?P<dquoted>[^"]*)"\s*\]
  | \[(?P<index>-?\d+)\]
  | \[(?P<star>\*)\]
  | \.(?P<dotstar>\*)
  | \[\?\(@(?P<fpath>(?:\.[A-Za-z0-9_\-]+)+)\s*(?P<fop>==|!=)\s*(?P<fval>"[^"]*"|'[^']*'|[^)\s]+)\s*\)\]
""", re.VERBOSE)


def _tokens(expr: str) -> list[tuple[str, Any]]:
    expr = expr.strip()
    if expr.startswith("{") and expr.endswith("}"):
        expr = expr[1:-1]
    if expr.startswith("$"):
        expr = expr[1:]
    pos, out = 0, []
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if not m:
            raise ValueError(f"unsupported JSONPath {expr!r} at {expr[pos:]!r}")
        if m.group("name") is not None:
            out.append(("key", m.group("name").replace("\\.", ".")))
        elif m.group("quoted") is not None or m.group("dquoted") is not None:
            out.append(("key", m.group("quoted") if m.group("quoted") is not None else m.group("dquoted")))
        elif m.group("index") is not None:
            out.append(("index", int(m.group("index"))))
        elif m.group("star") or m.group("dotstar"):
            out.append(("star", None))
        else:
            raw = m.group("fval")
            value: Any = raw[1:-1] if raw[0] in "'\"" else raw
            out.append(("filter", (m.group("fpath")[1:].split("."), m.group("fop"), value)))
        pos = m.end()
    return out


def evaluate(obj: Any, expr: str) -> list[Any]:
    """All values the expression selects (empty when the path is absent)."""
    current = [obj]
    for kind, arg in _tokens(expr):
        nxt: list[Any] = []
        for item in current:
            if kind == "key" and isinstance(item, dict) and arg in item:
                nxt.append(item[arg])
            elif kind == "index" and isinstance(item, list) and -len(item) <= arg < len(item):
                nxt.append(item[arg])
            elif kind == "star":
                nxt.extend(item if isinstance(item, list) else list(item.values()) if isinstance(item, dict) else [])
            elif kind == "filter" and isinstance(item, list):
                path, op, value = arg
                for element in item:
                    got: Any = element
                    for part in path:
                        got = got.get(part) if isinstance(got, dict) else None
                    text = got if isinstance(got, str) else ("true" if got is True else "false" if got is False
                                                            else str(got) if got is not None else None)
                    if (text == str(value)) == (op == "=="):
                        nxt.append(element)
        current = nxt
    return current
