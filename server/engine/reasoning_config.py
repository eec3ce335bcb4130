"""``--reasoning-config``: vLLM's ReasoningConfig, the strings that open and (forcibly) close thinking.

Its JSON takes vLLM's three keys: ``reasoning_parser``, ``reasoning_start_str`` and ``reasoning_end_str``
(the string forced when a request's ``thinking_token_budget`` is spent; it may put a transition phrase
before the parser's own end marker). A string left empty comes from the reasoning parser: the server
fills the parser's markers in (``with_parser``), since the parsers are the HTTP layer's. Without either
string the budget is off and a request asking for one is refused, as in vLLM.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from typing import Any

from .config_error import ConfigError
from .json_flag import json_object_flag
from .thinking_budget import ThinkingMarkers

CONFIG_KEYS = ("reasoning_parser", "reasoning_start_str", "reasoning_end_str")


@dataclass(frozen=True)
class ReasoningConfig:
    reasoning_parser: str = ""
    reasoning_start_str: str = ""
    reasoning_end_str: str = ""
    # the parser's own markers, filled in by the server from the parser's name (never from the JSON)
    parser_start_str: str = ""
    parser_end_str: str = ""

    @classmethod
    def parse(cls, value: "str | dict[str, Any] | ReasoningConfig") -> "ReasoningConfig":
        """The flag's JSON text (or a dict, offline); ConfigError naming the bad key or value."""
        if isinstance(value, ReasoningConfig):
            return value
        value = json_object_flag("--reasoning-config", value, ConfigError, f"with keys {', '.join(CONFIG_KEYS)}")
        unknown = sorted(str(k) for k in value if k not in CONFIG_KEYS)
        if unknown:
            raise ConfigError(f"--reasoning-config: unknown key(s) {', '.join(unknown)}; "
                              f"the keys are {', '.join(CONFIG_KEYS)}")
        for key, v in value.items():
            if not isinstance(v, str):
                raise ConfigError(f"--reasoning-config: {key} must be a string, got {json.dumps(v)}")
        return cls(**value)

    def with_parser(self, name: str, start: str, end: str) -> "ReasoningConfig":
        """This config under reasoning parser ``name``, whose markers are ``start`` and ``end``."""
        return replace(self, reasoning_parser=name, parser_start_str=start, parser_end_str=end)

    def as_dict(self) -> dict[str, str]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name in CONFIG_KEYS}

    def markers(self, tokenizer: Any) -> ThinkingMarkers | None:
        """The markers' token ids, or None when neither the config nor the parser names both strings."""
        if self.reasoning_parser and not (self.parser_start_str and self.parser_end_str):
            raise ConfigError(f"--reasoning-config: reasoning_parser {self.reasoning_parser!r} is resolved by "
                              "`pagedmodel serve`; here give reasoning_start_str and reasoning_end_str")
        start = self.reasoning_start_str or self.parser_start_str
        end = self.reasoning_end_str or self.parser_end_str
        if not start or not end:
            return None
        natural_end = self.parser_end_str or end
        ids = [list(tokenizer.encode(s, add_special_tokens=False)) for s in (start, end, natural_end)]
        if not all(ids):
            raise ConfigError(f"--reasoning-config: the reasoning strings must each be at least one token; "
                              f"start {start!r} and end {end!r} tokenize to {ids[0]} and {ids[1]}")
        if ids[0] == ids[1] or ids[0] == ids[2]:
            raise ConfigError(f"--reasoning-config: the start and end strings must differ (both are {start!r})")
        return ThinkingMarkers(tuple(ids[0]), tuple(ids[1]), tuple(ids[2]))
