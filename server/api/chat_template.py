"""--chat-template: a chat template in place of the model's own, given as a file or as the template text
itself (vLLM's rule: a value that names no file is taken as template text when it looks like Jinja, and is
an error when it looks like a path that is missing)."""
from __future__ import annotations

import os

JINJA_MARKERS = ("{{", "{%", "{#")


def load_chat_template(value: str) -> str:
    """The template text ``--chat-template`` names; ValueError saying why it cannot be had."""
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--chat-template {value!r} could not be read: {exc}") from None
        if not text.strip():
            raise ValueError(f"--chat-template {value!r} is an empty file")
        return text
    if any(m in value for m in JINJA_MARKERS):
        return value
    raise ValueError(f"--chat-template {value!r} is neither a readable file nor a Jinja template "
                     "(a template holds {{ ... }} or {% ... %})")
