"""The adapters this engine serves, by name: loaded at start (``--lora-modules``), at run time
(``/v1/load_lora_adapter``) or on first use by the offline API's ``LoRARequest``.

Thread-safe: the API loads adapters in worker threads while the engine thread reads. A removed
adapter stays alive for the requests already holding it; new requests can no longer name it.
"""
from __future__ import annotations

import itertools
import threading

import torch

from .adapter import LoRAAdapter, LoRAError, load_adapter
from .lora_request import LoRARequest


class LoRARegistry:
    def __init__(self, hf_config, max_rank: int, dtype: torch.dtype):
        self.hf_config, self.max_rank, self.dtype = hf_config, max_rank, dtype
        self._adapters: dict[str, LoRAAdapter] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)

    def load(self, name: str, path: str) -> LoRAAdapter:
        """Reads the adapter (slow: file I/O) and registers it; LoRAError if it is bad or the name is taken."""
        if name in self._adapters:
            raise LoRAError(f"the LoRA adapter {name!r} has already been loaded")
        adapter = load_adapter(name, next(self._ids), path, self.hf_config, self.max_rank, self.dtype)
        with self._lock:
            if name in self._adapters:
                raise LoRAError(f"the LoRA adapter {name!r} has already been loaded")
            self._adapters[name] = adapter
        return adapter

    def unload(self, name: str) -> None:
        with self._lock:
            if self._adapters.pop(name, None) is None:
                raise KeyError(name)

    def get(self, name: str) -> LoRAAdapter | None:
        return self._adapters.get(name)

    def resolve(self, request: LoRARequest) -> LoRAAdapter:
        """The offline API's form: the adapter named by the request, loaded from its path on first use."""
        known = self._adapters.get(request.lora_name)
        if known is not None:
            if known.path != request.lora_path:
                raise LoRAError(f"the LoRA adapter {request.lora_name!r} is already loaded from {known.path!r}, "
                                f"not {request.lora_path!r}")
            return known
        return self.load(request.lora_name, request.lora_path)

    def adapters(self) -> list[LoRAAdapter]:
        with self._lock:
            return list(self._adapters.values())
