"""Structured-output specs compiled to xgrammar grammars: once per (kind, spec), off the engine thread.

The tokenizer info (every token's bytes, the stop tokens, the model's logits width) is built once, on
first use, so engines that never see a structured request pay nothing. Compilation runs on a small
thread pool; ``compile`` returns a future at once, and the same spec asked twice shares one future (a
bounded cache). A spec that does not compile fails its future with GrammarError, whose message the
caller reports under the request's own field (``response_format``, ``guided_json``, ...).
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .sampling_params import SamplingParamsError
from .structured_outputs_params import StructuredOutputsParams

CACHE_ENTRIES = 512
_LOCATION = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")   # xgrammar's "[time] file.cc:94: " prefix
COMPILE_THREADS = 2


class GrammarError(ValueError):
    """A schema, regex, choice list or grammar that xgrammar cannot compile."""


def _choice_grammar(choices: list[str]) -> str:
    # JSON string literals are valid EBNF literals in xgrammar (same escapes), so any text is safe here
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


class GrammarCompiler:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: set[int], threads: int = COMPILE_THREADS):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size            # the logits width: may exceed len(tokenizer)
        self._stop_ids = sorted(eos_token_ids)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar")
        self._lock = threading.Lock()               # guards the cache; compile() never waits on xgrammar
        self._init_lock = threading.Lock()          # guards building the tokenizer info (about a second)
        self._compiler: Any = None
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()

    def compile(self, spec: StructuredOutputsParams) -> Future:
        """A future of the compiled grammar (xgrammar.CompiledGrammar); never blocks on compilation."""
        key = spec.cache_key()
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, key)
            self._cache[key] = future
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
            return future

    def result(self, spec: StructuredOutputsParams, timeout: float | None = None) -> Any:
        """Wait for ``spec``'s grammar; a spec that does not compile raises SamplingParamsError(param)."""
        return self.wait(self.compile(spec), spec, timeout)

    @staticmethod
    def wait(future: Future, spec: StructuredOutputsParams, timeout: float | None = None) -> Any:
        """``future``'s grammar; a compile error becomes SamplingParamsError naming ``spec``'s field."""
        try:
            return future.result(timeout)
        except GrammarError as exc:
            raise SamplingParamsError(str(exc), spec.param) from None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _xgr_compiler(self) -> Any:
        with self._init_lock:
            if self._compiler is None:
                import xgrammar as xgr   # imported on first use: engines without structured requests skip it

                info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size,
                                                          stop_token_ids=self._stop_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def _compile(self, key: tuple[str, str]) -> Any:
        kind, spec = key
        compiler = self._xgr_compiler()
        try:
            # compact JSON (any_whitespace=False): small models otherwise wander into endless whitespace
            if kind == "json":
                return compiler.compile_json_schema(spec, any_whitespace=False)
            if kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return compiler.compile_regex(spec)
            if kind == "choice":
                return compiler.compile_grammar(_choice_grammar(json.loads(spec)))
            return compiler.compile_grammar(spec)
        except Exception as exc:   # xgrammar raises RuntimeError / ValueError / its own types with the reason
            what = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex",
                    "choice": "choice list", "grammar": "grammar"}[kind]
            lines = str(exc).strip().splitlines()
            reason = _LOCATION.sub("", lines[0]) if lines else type(exc).__name__
            raise GrammarError(f"invalid {what}: {reason}") from None
