"""A chat request's `tools` and `tool_choice`: validated, resolved to one mode, and (for `required` and a
named function) turned into the JSON schema the output is constrained to.

Every bad definition is a 400 naming the exact field (`tools[1].function.parameters`), checked before
anything is tokenized or submitted, so a bad tool never reaches the engine.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from jsonschema import SchemaError
from jsonschema.validators import validator_for

from .errors import APIError

NAME_RE = re.compile(r"[a-zA-Z0-9_-]{1,64}")
MAX_TOOLS = 128
# A function without `parameters` takes no arguments (OpenAI: "an empty parameter list").
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
Mode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class FunctionTool:
    name: str
    description: str | None
    parameters: dict[str, Any]

    def as_openai(self) -> dict[str, Any]:
        """The definition as the chat template (and the Hermes system prompt) receive it: OpenAI's key order
        (name, description, parameters), which a template's `tojson` keeps, so the render is HF's."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolChoice:
    mode: Mode
    name: str | None = None   # set for mode "named"


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_tool")


def _check_schema(schema: Any, param: str) -> dict[str, Any]:
    if not isinstance(schema, dict):
        raise _bad(f"{param} must be a JSON schema object, got {type(schema).__name__}", param)
    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        raise _bad(f"{param} is not a valid JSON schema: {exc.message}" + (f" (at {where})" if where else ""),
                   param) from None
    if schema.get("type", "object") != "object":
        raise _bad(f"{param} must describe an object (its type is {schema.get('type')!r})", param)
    return schema


def _one_tool(raw: Any, i: int) -> FunctionTool:
    at = f"tools[{i}]"
    if not isinstance(raw, dict):
        raise _bad(f"{at} must be an object", at)
    if raw.get("type") != "function":
        raise _bad(f"{at}.type must be 'function', got {raw.get('type')!r}", f"{at}.type")
    fn = raw.get("function")
    if not isinstance(fn, dict):
        raise _bad(f"{at}.function must be an object", f"{at}.function")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise _bad(f"{at}.function.name must match ^[a-zA-Z0-9_-]{{1,64}}$, got {name!r}", f"{at}.function.name")
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise _bad(f"{at}.function.description must be a string", f"{at}.function.description")
    params = fn.get("parameters")
    schema = NO_ARGUMENTS if params is None else _check_schema(params, f"{at}.function.parameters")
    return FunctionTool(name, description, schema)


def parse_tools(raw: list[Any] | None) -> list[FunctionTool]:
    """The request's tools, validated; duplicate names are refused (a call could not say which it means)."""
    if not raw:
        return []
    if len(raw) > MAX_TOOLS:
        raise _bad(f"at most {MAX_TOOLS} tools per request, got {len(raw)}", "tools")
    tools = [_one_tool(t, i) for i, t in enumerate(raw)]
    seen: set[str] = set()
    for i, t in enumerate(tools):
        if t.name in seen:
            raise _bad(f"tools[{i}].function.name {t.name!r} is defined twice", f"tools[{i}].function.name")
        seen.add(t.name)
    return tools


def resolve_tool_choice(raw: Any, tools: list[FunctionTool], auto_enabled: bool) -> ToolChoice:
    """One mode from `tool_choice`; the default is `auto` with tools and `none` without, as OpenAI's."""
    if raw is None:
        raw = "auto" if tools else "none"
    if raw == "none":
        return ToolChoice("none")
    if not tools:
        raise _bad(f"tool_choice {raw!r} needs tools", "tool_choice")
    if raw == "auto":
        if not auto_enabled:
            raise _bad('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                       "tool_choice")
        return ToolChoice("auto")
    if raw == "required":
        return ToolChoice("required")
    if isinstance(raw, dict) and raw.get("type") == "function" and isinstance(raw.get("function"), dict):
        name = raw["function"].get("name")
        if name not in {t.name for t in tools}:
            raise _bad(f"tool_choice names function {name!r}, which is not in tools", "tool_choice")
        return ToolChoice("named", name)
    raise _bad("tool_choice must be 'none', 'auto', 'required' or "
               "{'type': 'function', 'function': {'name': ...}}", "tool_choice")


DEFINITION_KEYS = ("$defs", "definitions")   # where JSON Schema keeps what "#/$defs/X" refs point at


def required_schema(tools: list[FunctionTool], parallel: bool = True) -> dict[str, Any]:
    """`required`: a non-empty array of calls, each `{"name": <a tool>, "arguments": <its parameters>}`;
    exactly one call when the request says `parallel_tool_calls: false`.

    A tool's root-relative refs ("#/$defs/X") would point into the combined schema's root once its
    parameters sit inside it, so each tool's definitions move to that root."""
    root_defs: dict[str, dict[str, Any]] = {}
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "const": t.name},
                             "arguments": _hoist_definitions(t, root_defs)},
              "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    item = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema: dict[str, Any] = {"type": "array", "items": item, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    schema.update({key: defs for key, defs in root_defs.items() if defs})
    return schema


def _hoist_definitions(tool: FunctionTool, root_defs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The tool's parameters without their definitions, which join ``root_defs``; two tools defining one
    name differently cannot share the root, and that is a 400."""
    params = dict(tool.parameters)
    for key in DEFINITION_KEYS:
        defs = params.pop(key, None)
        if not isinstance(defs, dict):
            continue
        merged = root_defs.setdefault(key, {})
        for name, definition in defs.items():
            if name in merged and merged[name] != definition:
                raise APIError(400, f"tools define {key}/{name} differently; tool_choice \"required\" combines "
                                    f"every tool's schema into one, so the definitions must agree",
                               param="tools")
            merged[name] = definition
    return params


def named_schema(tools: list[FunctionTool], name: str) -> dict[str, Any]:
    """A named function: the output is that function's arguments object itself."""
    return next(t.parameters for t in tools if t.name == name)
