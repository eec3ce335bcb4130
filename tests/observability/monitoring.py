"""The chart's monitoring objects, rendered through Helm's SDK, and what the tests need to read out of
them: the alert rules, the dashboard's queries, the metric names a PromQL expression uses and the
operands a threshold compares."""
from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "pagedmodel"
MONITORING_ON = {"monitoring": {"podMonitor": {"enabled": True}, "prometheusRule": {"enabled": True},
                                "dashboard": {"enabled": True}}}
# Series Prometheus itself makes for every target (not exported by any of our programs).
PROMETHEUS_BUILTINS = frozenset({"up", "scrape_duration_seconds", "scrape_samples_scraped"})


@dataclass(frozen=True)
class Rendered:
    docs: list[dict[str, Any]]

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [d for d in self.docs if d["kind"] == kind]

    def rule_groups(self) -> dict[str, Any]:
        """The PrometheusRule's spec, which is a Prometheus rule file as promtool reads it (a copy)."""
        (rule,) = self.of("PrometheusRule")
        return copy.deepcopy({"groups": rule["spec"]["groups"]})

    def alerts(self) -> list[dict[str, Any]]:
        return [r for g in self.rule_groups()["groups"] for r in g["rules"] if "alert" in r]

    def dashboard(self) -> dict[str, Any]:
        (cm,) = self.of("ConfigMap")
        (text,) = cm["data"].values()
        return json.loads(text)

    def dashboard_queries(self) -> list[tuple[str, str]]:
        """(where, expr) of every panel target and annotation of the dashboard."""
        dash = self.dashboard()
        out = [(f"panel {p['title']!r} {t['refId']}", t["expr"]) for p in dash["panels"] for t in p["targets"]]
        out += [(f"annotation {a['name']!r}", a["expr"]) for a in dash["annotations"]["list"] if "expr" in a]
        out += [(f"variable {v['name']!r}", _label_values_selector(v["query"]["query"]))
                for v in dash["templating"]["list"] if v.get("type") == "query"]
        return out

    def queries(self) -> list[tuple[str, str]]:
        return [(f"alert {a['alert']}", a["expr"]) for a in self.alerts()] + self.dashboard_queries()


def render(values: dict[str, Any] | None = None) -> Rendered:
    import helm_python as helm

    rendered = helm.Chart.load(str(CHART)).render(MONITORING_ON if values is None else values, name="pm", namespace="pm-system")
    return Rendered([d for name, text in rendered.items() if name.endswith(".yaml")
                     for d in yaml.safe_load_all(text) if d])


def _label_values_selector(query: str) -> str:
    """label_values(SELECTOR, label) -> SELECTOR (the part Prometheus evaluates)."""
    m = re.fullmatch(r"label_values\((.*),\s*\w+\)", query.strip())
    if not m:
        raise ValueError(f"unexpected variable query {query!r}")
    return m.group(1)


def substitute(expr: str, values: dict[str, str], rate_interval: str) -> str:
    """Grafana's variables replaced the way Grafana would ($__rate_interval, $var)."""
    expr = expr.replace("$__rate_interval", rate_interval)
    return re.sub(r"\$(\w+)", lambda m: values.get(m.group(1), ".*"), expr)


_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
             "offset", "inf", "nan"}
_IDENT = r"[a-zA-Z_:][a-zA-Z0-9_:]*"


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects: bare selectors and __name__ matchers (alternatives of a
    regex split on |). Function names, keywords, label names and numbers are not names."""
    names = set()
    for alts in re.findall(r'__name__\s*=~?\s*"([^"]*)"', expr):
        names |= set(alts.split("|"))
    text = re.sub(r"\{[^}]*\}", " ", expr)                         # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)                        # range durations
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    for m in re.finditer(_IDENT, text):
        word, rest = m.group(0), text[m.end():]
        if word.lower() in _KEYWORDS or rest.lstrip().startswith("("):
            continue
        if re.match(r"\d", word) or (m.start() > 0 and text[m.start() - 1].isdigit()):
            continue
        names.add(word)
    return names


_SET_OP = re.compile(r"\s(?:and|or|unless)\s")
_COMPARISON = re.compile(r"==|!=|>=|<=|>|<")
_MODIFIERS = re.compile(r"^\s*(bool\s+)?((on|ignoring)\s*\([^)]*\)\s*)?((group_left|group_right)\s*(\([^)]*\))?\s*)?")


def operands(expr: str) -> list[str]:
    """The sub-expressions an expression compares or combines, at the top level (outside brackets and
    quotes), without numbers: `A > 0.3` -> [A]; `A >= B and on (x) C == 1` -> [A, B, C]."""
    parts, depth, start, i, quoted = [], 0, 0, 0, False
    while i < len(expr):
        c = expr[i]
        if c == '"':
            quoted = not quoted
        elif not quoted and c in "([{":
            depth += 1
        elif not quoted and c in ")]}":
            depth -= 1
        elif not quoted and depth == 0:
            m = _SET_OP.match(expr, i) or _COMPARISON.match(expr, i)
            if m:
                parts.append(expr[start:i])
                start = i = m.end()
                continue
        i += 1
    parts.append(expr[start:])
    out = [_MODIFIERS.sub("", p, count=1).strip() for p in parts]
    return [p for p in out if p and not re.fullmatch(r"[-+]?\d+(\.\d+)?(e[-+]?\d+)?", p)]
