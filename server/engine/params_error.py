"""The error every request parameter check raises (sampling, structured outputs): a leaf, so the modules that
check parameters need not import one another for it."""
from __future__ import annotations


class SamplingParamsError(ValueError):
    """A parameter is invalid; ``param`` names it (OpenAI's error ``param`` field)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
