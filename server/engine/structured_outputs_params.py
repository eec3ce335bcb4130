"""What a request's output must match: a JSON schema, any JSON object, a regex, one of some strings, or a grammar.

Exactly one form is set. Validation here is about shape (types, sizes); whether a schema, regex or
grammar actually compiles is checked by the grammar compiler (grammar_compiler.py) before the request
enters the engine, and reported under the same ``param``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from .params_error import SamplingParamsError

MAX_SPEC_CHARS = 64 * 1024      # a schema / regex / grammar larger than this is a 400, not a slow compile
MAX_CHOICES = 256

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """``json``: a JSON schema (dict or JSON text); ``json_object``: any JSON object; ``regex``: the output
    fullmatches it; ``choice``: the output is one of these strings; ``grammar``: an EBNF (GBNF) grammar.
    ``param`` is the request field the errors name (``structured_outputs``, ``response_format``, ...)."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    param: str = field(default="structured_outputs", compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.choice, tuple):
            object.__setattr__(self, "choice", list(self.choice))
        self.validate()

    @property
    def kind(self) -> str:
        for name in KINDS:
            value = getattr(self, name)
            if value is not None and value is not False:
                return name
        raise AssertionError("validate() guarantees one form")

    def cache_key(self) -> tuple[str, str]:
        """(kind, spec) with the spec as text: equal schemas share one compiled grammar."""
        kind = self.kind
        if kind == "json":
            spec = self.json if isinstance(self.json, str) else json.dumps(self.json)   # key order = property order
        elif kind == "json_object":
            spec = ""
        elif kind == "choice":
            spec = json.dumps(self.choice)
        else:
            spec = getattr(self, kind)
        return kind, spec

    def validate(self) -> None:
        def fail(msg: str) -> None:
            raise SamplingParamsError(msg, self.param)

        set_forms = [k for k in KINDS if getattr(self, k) is not None and getattr(self, k) is not False]
        if len(set_forms) != 1:
            fail(f"exactly one of {', '.join(KINDS)} must be given, got {set_forms or 'none'}")
        if not isinstance(self.json_object, bool):
            fail(f"json_object must be a boolean, got {self.json_object!r}")
        if self.json is not None:
            if isinstance(self.json, str):
                if len(self.json) > MAX_SPEC_CHARS:
                    fail(f"the JSON schema is longer than {MAX_SPEC_CHARS} characters")
                try:
                    parsed = json.loads(self.json)
                except ValueError as e:
                    fail(f"the JSON schema is not valid JSON: {e}")
                if not isinstance(parsed, (dict, bool)):
                    fail("a JSON schema must be an object (or a boolean)")
            elif isinstance(self.json, dict):
                if len(json.dumps(self.json)) > MAX_SPEC_CHARS:
                    fail(f"the JSON schema is longer than {MAX_SPEC_CHARS} characters")
            else:
                fail(f"json must be a schema object or its JSON text, got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value or len(value) > MAX_SPEC_CHARS):
                fail(f"{name} must be a non-empty string of at most {MAX_SPEC_CHARS} characters")
        if self.choice is not None:
            if (not isinstance(self.choice, list) or not self.choice or len(self.choice) > MAX_CHOICES
                    or not all(isinstance(c, str) and c for c in self.choice)):
                fail(f"choice must be a list of 1 to {MAX_CHOICES} non-empty strings")
            if sum(len(c) for c in self.choice) > MAX_SPEC_CHARS:
                fail(f"the choices are longer than {MAX_SPEC_CHARS} characters in all")
