"""Tools and tool turns in the prompt: what the chat template is given when a request carries tools,
assistant `tool_calls` or `tool` messages.

A template that knows tools (it reads `tools` / `tool_calls`) gets them as HF's `apply_chat_template`
expects. One that does not (SmolLM2-135M-Instruct's) would drop them silently, so they are written into
the messages in the Hermes format instead: the tool list in the system message, past calls as
`<tool_call>` blocks in the assistant's content, results as `<tool_response>` blocks -- the same format
the `hermes` parser reads back.
"""
from __future__ import annotations

import json
from typing import Any

from .tool_definitions import FunctionTool

HERMES_INSTRUCTIONS = (
    "You can call functions to help with the user's request. The available functions are listed, one JSON "
    "signature per line, between <tools> and </tools>:\n<tools>\n{tools}\n</tools>\n\n"
    "To call a function, write a JSON object with its name and arguments between <tool_call> and "
    "</tool_call>, one block per call:\n<tool_call>\n{{\"name\": \"<function name>\", \"arguments\": "
    "{{<arguments as JSON>}}}}\n</tool_call>")


def template_reads_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template   # type: ignore[operator]


def template_reads_tool_calls(template: str | None) -> bool:
    return bool(template) and "tool_calls" in template   # type: ignore[operator]


def hermes_system_text(tools: list[FunctionTool]) -> str:
    # sort_keys: the same tools render the same prompt (prefix caching, the router's prefix hash)
    lines = "\n".join(json.dumps(t.as_openai(), sort_keys=True, ensure_ascii=False) for t in tools)
    return HERMES_INSTRUCTIONS.format(tools=lines)


def _call_block(call: dict[str, Any]) -> str:
    fn = call["function"]
    return "<tool_call>\n" + json.dumps({"name": fn["name"], "arguments": fn["arguments"]},
                                        ensure_ascii=False) + "\n</tool_call>"


def _inline(message: dict[str, Any]) -> dict[str, Any]:
    """A message with its tool parts written as Hermes text, for a template that ignores them."""
    m = {k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id")}
    if message.get("tool_calls"):
        blocks = "\n".join(_call_block(c) for c in message["tool_calls"])
        m["content"] = (m.get("content") or "") + ("\n" if m.get("content") else "") + blocks
    if message["role"] == "tool":
        m["content"] = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
    return m


def prepare_chat(messages: list[dict[str, Any]], tools: list[FunctionTool],
                 template: str | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, extra apply_chat_template kwargs) for this template."""
    kwargs: dict[str, Any] = {}
    if not template_reads_tool_calls(template):
        messages = [_inline(m) for m in messages]
    if tools and template_reads_tools(template):
        kwargs["tools"] = [t.as_openai() for t in tools]
    elif tools:
        text = hermes_system_text(tools)
        if messages and messages[0]["role"] == "system":
            first = dict(messages[0], content=(messages[0].get("content") or "") + "\n\n" + text)
            messages = [first, *messages[1:]]
        else:
            messages = [{"role": "system", "content": text}, *messages]
    return messages, kwargs
