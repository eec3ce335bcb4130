"""pagedmodel: Kubernetes-native paged-KV LLM serving.

The offline API, under vLLM's names::

    from pagedmodel import LLM, SamplingParams
    outputs = LLM().generate(["The capital of France is"], SamplingParams(max_tokens=16))

The names are imported on first use (module `__getattr__`), so `import pagedmodel` — which the CLI,
the operator and the router all do — never loads torch or the engine.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "LLM": "pagedmodel.server.engine.llm",
    "SamplingParams": "pagedmodel.server.engine.sampling_params",
    "RequestOutput": "pagedmodel.server.engine.outputs",
    "EngineArgs": "pagedmodel.server.engine.args",
    "LoRARequest": "pagedmodel.server.engine.lora.lora_request",
}

__all__ = ["EngineArgs", "LLM", "LoRARequest", "RequestOutput", "SamplingParams"]   # the keys of _EXPORTS

if TYPE_CHECKING:  # static checkers and IDEs see the real classes
    from pagedmodel.server.engine.args import EngineArgs
    from pagedmodel.server.engine.llm import LLM
    from pagedmodel.server.engine.lora.lora_request import LoRARequest
    from pagedmodel.server.engine.outputs import RequestOutput
    from pagedmodel.server.engine.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedmodel' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value   # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
