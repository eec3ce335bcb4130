"""What a front end may use of the engine: the one seam between the engine and the programs that drive it
(the HTTP API through its engine thread, the offline ``LLM`` directly). ``LLMEngine`` provides it; the API
names nothing of the engine beyond it (tests/api/test_engine_client_seam.py reads the API's code to check).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .grammar_compiler import GrammarCompiler
    from .input_processor import InputProcessor
    from .kv_events import KVEventLog
    from .lora.registry import LoRARegistry
    from .outputs import RequestOutput, RequestProgress
    from .sampling_params import SamplingParams
    from .stats import EngineStats


class EngineClient(Protocol):
    model_name: str
    max_model_len: int
    vocab_size: int
    tokenizer: Any                       # a HF tokenizer; None with --skip-tokenizer-init
    input_processor: InputProcessor      # the prompt checks a front end runs before it submits (once)
    grammars: GrammarCompiler            # structured-output grammars, compiled once and cached
    kv_events: KVEventLog | None         # prefix-cache changes (None without prefix caching)
    lora_registry: LoRARegistry | None   # loaded adapters (None without --enable-lora)
    step_progress: list[RequestProgress]   # the last step's news per request, whatever its output kind

    def add_request(self, request_id: str, prompt: object, params: SamplingParams, *,
                    arrival_time: float | None = None, priority: int = 0, cache_salt: str | None = None,
                    lora_request: Any = None) -> None: ...

    def abort_request(self, request_id: str) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished_requests(self) -> bool: ...

    def stats(self) -> EngineStats: ...

    def cache_config_info(self) -> dict[str, str]: ...

    def kv_blocks_report(self) -> dict[str, Any]: ...
