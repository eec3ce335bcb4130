"""Offline API: ``LLM(model=...).generate(prompts, SamplingParams(...))``, no server involved."""
from __future__ import annotations

import itertools
from dataclasses import replace
from collections.abc import Mapping, Sequence
from typing import Union

from .args import EngineArgs
from .engine_client import EngineClient
from .lora.lora_request import LoRARequest
from .llm_engine import LLMEngine
from .outputs import RequestOutput, RequestOutputKind
from .sampling_params import SamplingParams

PromptType = Union[str, list[int], Mapping[str, object]]


class LLM:
    def __init__(self, model: str | None = None, **engine_args):
        self.engine: EngineClient = LLMEngine(EngineArgs(model=model, **engine_args))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order, with timings in ``.metrics``.

        A prompt is a string, a list of token ids, ``{"prompt": str}``, ``{"prompt_token_ids": [...]}`` or,
        with enable_prompt_embeds, ``{"prompt_embeds": tensor}`` (each dict may carry ``"cache_salt"``); pass
        one or a list of them, as with vLLM.
        ``lora_request``: one adapter for every prompt, or one (or None: the base model) per prompt."""
        prompts = _prompt_list(prompts)
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        # each request's one output, whole, at its end (as vLLM's LLM does; the caller's params stay as given)
        params_list = [replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params_list]
        loras = list(lora_request) if isinstance(lora_request, Sequence) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError("give one LoRARequest, or one per prompt")
        specs = [p.structured_outputs for p in params_list if p.structured_outputs is not None]
        for spec in specs:        # compile them all in parallel; a bad one raises before anything is added
            self.engine.grammars.compile(spec)
        for spec in specs:
            self.engine.grammars.result(spec)
        ids = []
        try:
            for prompt, p, lora in zip(prompts, params_list, loras):
                rid = f"offline-{next(self._ids)}"
                self.engine.add_request(rid, prompt, p, lora_request=lora)
                ids.append(rid)
        except Exception:   # a bad prompt in the list: the ones before it must not linger in the engine
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        results: dict[str, RequestOutput] = {}
        progress = None
        if use_tqdm:
            from tqdm import tqdm

            progress = tqdm(total=len(ids), desc="generate", unit="req")
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    results[out.request_id] = out
                    if progress:
                        progress.update(1)
        if progress:
            progress.close()
        return [results[rid] for rid in ids]


def _prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """One prompt (a string, a dict, or a list of token ids) becomes a list of one."""
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], int):
        return [prompts]
    return prompts
