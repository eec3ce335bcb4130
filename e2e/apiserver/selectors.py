"""Label selectors (equality and set-based) and field selectors, as LIST and WATCH accept them."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

from .errors import bad_request

_KEY = r"[A-Za-z0-9](?:[-A-Za-z0-9_./]*[A-Za-z0-9])?"


@dataclass(frozen=True)
class Requirement:
    key: str
    op: str            # "=", "!=", "in", "notin", "exists", "!"
    values: tuple[str, ...] = ()

    def matches(self, labels: dict[str, str]) -> bool:
        present = self.key in labels
        if self.op == "exists":
            return present
        if self.op == "!":
            return not present
        if self.op in ("=", "in"):
            return present and labels[self.key] in self.values
        # != and notin match objects without the label, as in Kubernetes.
        return not present or labels[self.key] not in self.values


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside parentheses."""
    parts, depth, current = [], 0, []
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    parts.append("".join(current))
    return [p.strip() for p in parts if p.strip()]


def parse_label_selector(text: str | None) -> list[Requirement]:
    if not text:
        return []
    reqs = []
    for part in _split_top_level(text):
        m = re.fullmatch(rf"({_KEY})\s+(in|notin)\s+\(([^)]*)\)", part)
        if m:
            values = tuple(v.strip() for v in m.group(3).split(",") if v.strip())
            reqs.append(Requirement(m.group(1), m.group(2), values))
            continue
        m = re.fullmatch(rf"({_KEY})\s*(==|!=|=)\s*(\S*)", part)
        if m:
            op = "!=" if m.group(2) == "!=" else "="
            reqs.append(Requirement(m.group(1), op, (m.group(3),)))
            continue
        m = re.fullmatch(rf"!\s*({_KEY})", part)
        if m:
            reqs.append(Requirement(m.group(1), "!"))
            continue
        if re.fullmatch(_KEY, part):
            reqs.append(Requirement(part, "exists"))
            continue
        raise bad_request(f"unable to parse requirement: invalid label selector: {part!r}")
    return reqs


def selector_from_label_selector(sel: dict[str, Any] | None) -> list[Requirement]:
    """A ``metav1.LabelSelector`` (matchLabels + matchExpressions) as requirements."""
    if not sel:
        return []
    reqs = [Requirement(k, "=", (str(v),)) for k, v in (sel.get("matchLabels") or {}).items()]
    for expr in sel.get("matchExpressions") or []:
        op = {"In": "in", "NotIn": "notin", "Exists": "exists", "DoesNotExist": "!"}[expr["operator"]]
        reqs.append(Requirement(expr["key"], op, tuple(expr.get("values") or ())))
    return reqs


def labels_match(reqs: list[Requirement], obj: dict[str, Any]) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return all(r.matches(labels) for r in reqs)


def selector_string(sel: dict[str, Any] | None) -> str:
    """Render a LabelSelector the way ``status.selector`` of a scale subresource shows it."""
    parts = [f"{k}={v}" for k, v in sorted(((sel or {}).get("matchLabels") or {}).items())]
    for expr in (sel or {}).get("matchExpressions") or []:
        op = expr["operator"]
        if op == "Exists":
            parts.append(expr["key"])
        elif op == "DoesNotExist":
            parts.append("!" + expr["key"])
        else:
            parts.append(f"{expr['key']} {op.lower()} ({','.join(expr.get('values') or [])})")
    return ",".join(parts)


def _field_value(obj: dict[str, Any], path: str) -> str:
    cur: Any = obj
    for part in path.split("."):
        if not isinstance(cur, dict):
            return ""
        cur = cur.get(part)
    if cur is None:
        return ""
    if isinstance(cur, bool):
        return "true" if cur else "false"
    return str(cur)


def parse_field_selector(text: str | None) -> Callable[[dict[str, Any]], bool]:
    """Field selectors compare dotted paths (``metadata.name``, ``involvedObject.uid``...) with = or !=."""
    if not text:
        return lambda obj: True
    terms = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        m = re.fullmatch(r"([A-Za-z0-9_.]+)\s*(==|!=|=)\s*(.*)", part)
        if not m:
            raise bad_request(f'invalid field selector: "{part}"')
        terms.append((m.group(1), m.group(2) != "!=", m.group(3)))

    def match(obj: dict[str, Any]) -> bool:
        return all((_field_value(obj, path) == value) == equal for path, equal, value in terms)

    return match


def field_selector_name(text: str | None) -> str | None:
    """The name pinned by ``metadata.name=x`` (lets watches on one object skip the rest)."""
    for part in (text or "").split(","):
        m = re.fullmatch(r"\s*metadata\.name\s*==?\s*(\S+)\s*", part)
        if m:
            return m.group(1)
    return None
