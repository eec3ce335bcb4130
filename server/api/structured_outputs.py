"""The request forms of structured outputs, for completions and chat alike, and their compile check.

Three spellings reach the same StructuredOutputsParams (docs/structured_outputs.md):
OpenAI's ``response_format`` (``text`` / ``json_object`` / ``json_schema``), vLLM's
``structured_outputs: {json | json_object | regex | choice | grammar}``, and vLLM's older
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``. A request may use one of
them; each error names the field it came from. ``ensure_compiled`` awaits the grammar (compiled off
the event loop and the engine thread), so a schema that does not compile is a 400 before the request
reaches the engine.
"""
from __future__ import annotations

import asyncio
from typing import Any

from pydantic import BaseModel, StrictStr

from pagedmodel.server.engine.grammar_compiler import GrammarError
from pagedmodel.server.engine.sampling_params import SamplingParams, SamplingParamsError
from pagedmodel.server.engine.structured_outputs_params import KINDS, StructuredOutputsParams
from .errors import APIError

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class StructuredOutputsFields(BaseModel):
    """The request fields; mixed into the completions and chat request models."""

    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The one constraint the request asks for, or None; raises SamplingParamsError naming the field."""
        found: list[StructuredOutputsParams] = []
        names: list[str] = []
        for name, parse in (("response_format", _from_response_format), ("structured_outputs", _from_object)):
            value = getattr(self, name)
            spec = parse(value) if value is not None else None
            if spec is not None:
                found.append(spec)
                names.append(name)
        for name, kind in _GUIDED.items():
            value = getattr(self, name)
            if value is not None:
                found.append(StructuredOutputsParams(**{kind: value}, param=name))
                names.append(name)
        if len(found) > 1:
            raise SamplingParamsError(f"give one structured-output form, not {' and '.join(names)}", names[1])
        return found[0] if found else None


def _from_response_format(rf: dict[str, Any]) -> StructuredOutputsParams | None:
    param = "response_format"
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True, param=param)
    if kind != "json_schema":
        raise SamplingParamsError(f"response_format type must be text, json_object or json_schema, got {kind!r}",
                                  param)
    spec = rf.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise SamplingParamsError("response_format json_schema needs a json_schema object with a schema object",
                                  param)
    return StructuredOutputsParams(json=spec["schema"], param=param)


def _from_object(so: dict[str, Any]) -> StructuredOutputsParams:
    param = "structured_outputs"
    unknown = sorted(set(so) - set(KINDS))
    if unknown:
        raise SamplingParamsError(f"structured_outputs takes one of {', '.join(KINDS)}; unknown: {', '.join(unknown)}",
                                  param)
    return StructuredOutputsParams(**so, param=param)


def with_structured_outputs(params: SamplingParams, spec: StructuredOutputsParams | None) -> SamplingParams:
    """``params`` constrained by ``spec`` (validated again: beam search and min_tokens do not combine)."""
    if spec is not None:
        params.structured_outputs = spec
        params.validate()
    return params


async def ensure_compiled(serving: Any, params: SamplingParams) -> None:
    """Wait for the request's grammar to compile; one that does not is a 400 naming its field."""
    spec = params.structured_outputs
    if spec is None:
        return
    try:
        await asyncio.wrap_future(serving.engine.grammars.compile(spec))
    except GrammarError as exc:
        raise APIError(400, str(exc), param=spec.param) from None
