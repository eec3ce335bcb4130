"""LLMEngine: requests in, one scheduler iteration per ``step()``, incremental outputs back.

A step flows one way: the scheduler picks the sequences and their blocks, the model runner computes
their logits, the sampler draws tokens (keyed by sequence), the scheduler's ``update_from_output``
applies them, and the output processor shapes what changed into RequestOutputs.

Not thread-safe: one thread owns the engine (the async front runs it in a background loop).
"""
from __future__ import annotations

import logging
import random
import time
from dataclasses import replace
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

from .args import ConfigError, EngineArgs, parse_lora_module
from .beam_group import BeamGroup
from .beam_search import BeamSearch
from .detokenizer import init_offsets
from .device import pick_block_size, pick_device
from .grammar_compiler import GrammarCompiler
from .input_processor import EmbeddingInput, InputProcessor, InvalidRequestError
from .lora.adapter import LoRAAdapter, LoRAError
from .lora.layers import LoRAState
from .lora.lora_request import LoRARequest
from .lora.registry import LoRARegistry
from .model_config import ModelConfig
from .model_runner import ModelRunner
from .output_processor import OutputProcessor
from .outputs import RequestMetrics, RequestOutput, RequestProgress
from .reasoning_config import ReasoningConfig
from .sampler import Sampler
from .sampling_params import SamplingParams, SamplingParamsError
from .scheduler import Scheduler
from .step_types import StepUpdate
from .sequence import SequenceGroup, SequenceStatus
from .stats import EngineStats
from .stop_checker import StopChecker
from .thinking_budget import ThinkingMarkers
from .watermark import samples_share_noise, unwatermarked_reason
from .watermark_config import warn_weak
from .worker import Worker

log = logging.getLogger("pagedmodel.engine")

DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048

__all__ = ["LLMEngine", "InvalidRequestError", "DEFAULT_MAX_NUM_BATCHED_TOKENS"]


class LLMEngine:
    def __init__(self, args: EngineArgs):
        # the block size is fixed here, for everything after (cache, scheduler, metrics), from the device
        args = self.args = replace(args, block_size=pick_block_size(args.block_size, pick_device(args.device)))
        log.info("preparing the model (%s)%s", args.model or "the default, SmolLM2-135M-Instruct",
                 "" if args.skip_tokenizer_init else " and its tokenizer")
        mc = self.model_config = ModelConfig.from_args(args)
        self.model_name, self.tokenizer, self.max_model_len = mc.served_name, mc.tokenizer, mc.max_model_len
        self.vocab_size, self.eos_token_ids = mc.vocab_size, mc.eos_token_ids
        max_num_batched_tokens = args.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
        worker = self.worker = Worker(args, mc, max_num_batched_tokens)
        self.model, self.kv_cache, self.backend, self.device = worker.model, worker.kv_cache, worker.backend, worker.device
        self.thinking_markers = self._thinking_markers(args)
        embeddings = EmbeddingInput(mc.hf_config.hidden_size, worker.dtype) if args.enable_prompt_embeds else None
        self.input_processor = InputProcessor(self.tokenizer, self.vocab_size, self.max_model_len,
                                              worker.num_blocks, args.block_size, embeddings,
                                              thinking_budgets=self.thinking_markers is not None)
        self.scheduler = Scheduler(worker.num_blocks, args.block_size, args.max_num_seqs, max_num_batched_tokens,
                                   StopChecker(self.tokenizer, self.eos_token_ids, self.max_model_len),
                                   enable_prefix_caching=args.enable_prefix_caching,
                                   num_cpu_blocks=worker.num_cpu_blocks, preemption_mode=args.preemption_mode,
                                   num_lora_slots=args.max_loras if args.enable_lora else 0)
        self.lora_registry = self._start_lora(args, mc, worker) if args.enable_lora else None
        self.runner = ModelRunner(self.model, self.kv_cache, self.backend, self.device,
                                  max_model_len=self.max_model_len, max_num_seqs=args.max_num_seqs,
                                  enforce_eager=args.enforce_eager, torch_compile=args.torch_compile,
                                  lora=LoRAState(self.model, args.max_loras) if args.enable_lora else None)
        self.kv_events = self.scheduler.block_manager.kv_events   # None without prefix caching
        self.watermark = args.watermark()
        self.sampler = Sampler(self.device, self.eos_token_ids, self.thinking_markers, self.watermark)
        if self.watermark is not None:
            log.info("watermarking sampled text: %s", self.watermark.describe())
            warn_weak(self.watermark)
        self._watermark_warned: set[str] = set()
        self.output_processor = OutputProcessor(self.tokenizer)
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self._compiling: dict[str, tuple[SequenceGroup, Future]] = {}   # admitted once their grammar is built
        self.requests: dict[str, SequenceGroup] = {}
        self.step_progress: list[RequestProgress] = []   # the last step's, rewritten by each step()
        self._seed_rng = random.Random(args.seed)
        log.info("engine ready: %s on %s (%s), %d KV blocks x %d tokens (%.1f MiB), max_model_len %d",
                 self.model_name, self.device, worker.dtype, worker.num_blocks, args.block_size,
                 self.kv_cache.nbytes / 2**20, self.max_model_len)

    def _thinking_markers(self, args: EngineArgs) -> ThinkingMarkers | None:
        """--reasoning-config's markers as token ids; None (budgets refused) when it names no strings."""
        config = args.reasoning_config
        if config is None:
            return None
        assert isinstance(config, ReasoningConfig)   # EngineArgs parsed it
        if self.tokenizer is None:
            raise ConfigError("--reasoning-config and --reasoning-parser need the tokenizer (the thinking markers "
                              "are text); they cannot go with --skip-tokenizer-init")
        markers = config.markers(self.tokenizer)
        if markers is None:
            log.warning("--reasoning-config names no start and end strings (nor a reasoning parser that has "
                        "them): requests with thinking_token_budget will be refused")
        return markers

    @staticmethod
    def _start_lora(args: EngineArgs, mc: ModelConfig, worker: Worker) -> LoRARegistry:
        registry = LoRARegistry(mc.hf_config, args.max_lora_rank, worker.dtype)
        for spec in args.lora_modules or []:
            name, path = parse_lora_module(spec)
            try:
                registry.load(name, path)
            except LoRAError as exc:
                raise ConfigError(f"--lora-modules: {exc}") from None
        return registry

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: object, params: SamplingParams, *,
                    arrival_time: float | None = None, priority: int = 0, cache_salt: str | None = None,
                    lora_request: LoRARequest | LoRAAdapter | None = None) -> None:
        """``prompt``: a string, token ids, or a ``{"prompt" | "prompt_token_ids": ..., "cache_salt": ...}``
        dict (input_processor.py); ``lora_request``: the adapter to run under (loaded on first use), or
        the registry's adapter itself; an unservable request raises InvalidRequestError and holds nothing."""
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        inputs = self.input_processor.process(prompt, params, cache_salt)
        adapter = self._adapter(lora_request)
        salt = (inputs.cache_salt or "").encode()
        if inputs.embeds is not None:   # cached KV of embedded positions is only theirs (prompt_embeds.py)
            salt += b"\0embeds:" + inputs.embeds.digest()
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        group = SequenceGroup(request_id, inputs.text, inputs.token_ids, params,
                              RequestMetrics(arrival_time if arrival_time is not None else time.time()),
                              priority=priority, seed=seed,
                              cache_salt=adapter.cache_salt + b"\0" + salt if adapter else salt, lora=adapter,
                              prompt_embeds=inputs.embeds)
        init_offsets(group.seqs[0])
        self._warn_watermark(params)
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None]   # nothing scores the first prompt token
            group.prompt_token_ranks = [None]
        if params.use_beam_search:
            limit = self.max_model_len - len(inputs.token_ids)
            max_new = min(params.max_tokens, limit) if params.max_tokens is not None else limit
            search = BeamSearch(params.best_of, params.length_penalty, params.early_stopping,
                                () if params.ignore_eos else self.eos_token_ids, max_new_tokens=max_new)
            group.beams = BeamGroup(group, search)
        so = params.structured_outputs
        grammar = self.grammars.compile(so) if so is not None else None
        if grammar is not None and not grammar.done():
            self.requests[request_id] = group
            self._compiling[request_id] = (group, grammar)
            return
        if grammar is not None:
            group.grammar = self.grammars.wait(grammar, so)   # a bad spec raises, holding nothing
        self.requests[request_id] = group
        self.scheduler.add(group)

    def _warn_watermark(self, params: SamplingParams) -> None:
        """Once per reason, as vLLM does: a request that will not carry the watermark it would get, or whose
        samples will come out alike."""
        reason = unwatermarked_reason(self.watermark, params) or samples_share_noise(self.watermark, params)
        if reason is not None and reason not in self._watermark_warned:
            self._watermark_warned.add(reason)
            log.warning("watermark: %s (said once)", reason)

    def _adapter(self, lora_request: LoRARequest | LoRAAdapter | None) -> LoRAAdapter | None:
        if lora_request is None or isinstance(lora_request, LoRAAdapter):
            return lora_request
        if self.lora_registry is None:
            raise InvalidRequestError("this engine serves no LoRA adapters; start it with --enable-lora", "model")
        try:
            return self.lora_registry.resolve(lora_request)
        except LoRAError as exc:
            raise InvalidRequestError(str(exc), "model") from None

    def abort_request(self, request_id: str) -> None:
        group = self.requests.pop(request_id, None)
        if group is None:
            return
        self._compiling.pop(request_id, None)
        self.scheduler.abort(group)   # its sampling state goes with the group

    def reset_prefix_cache(self) -> bool:
        """Drop the prefix cache (vLLM's reset_prefix_cache); False while requests hold blocks."""
        done = self.scheduler.block_manager.pool.reset_prefix_cache()
        if done and self.kv_events is not None:
            self.kv_events.publish()
        return done

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, run the model, sample, apply, and report what changed: the outputs due,
        and in ``step_progress`` every request's news (what metrics count, whatever its output kind)."""
        self.step_progress = []
        try:
            return self._step()
        finally:
            if self.kv_events is not None:
                self.kv_events.publish()   # the step's commits and evictions, as one batch

    def _step(self) -> list[RequestOutput]:
        failed = self._admit_compiled() if self._compiling else []
        sched = self.scheduler.schedule(time.time())
        if sched.is_empty:
            if self._compiling and not failed:   # only grammars in the works: wait for one, do not spin
                wait([f for _, f in self._compiling.values()], timeout=0.05, return_when=FIRST_COMPLETED)
            return failed
        model_output = self.runner.execute(sched)
        samples = self.sampler.sample(model_output)
        update = self.scheduler.update_from_output(sched, samples)
        outputs = self._shape(update)
        for group in update.touched.values():
            if group.is_finished:
                self.requests.pop(group.request_id, None)
        return failed + outputs

    def _admit_compiled(self) -> list[RequestOutput]:
        """Schedule the requests whose grammar is ready; one that failed to compile ends (finish "abort")."""
        failed = StepUpdate()
        for request_id, (group, grammar) in list(self._compiling.items()):
            if not grammar.done():
                continue
            del self._compiling[request_id]
            try:
                group.grammar = self.grammars.wait(grammar, group.params.structured_outputs)
            except SamplingParamsError as exc:
                log.warning("request %s: %s; aborted", request_id, exc)
                for seq in group.seqs:
                    seq.status = SequenceStatus.FINISHED_ABORTED
                self.requests.pop(request_id, None)
                failed.touched[request_id] = group
                continue
            self.scheduler.add(group)
        return self._shape(failed) if failed.touched else []

    def _shape(self, update: StepUpdate) -> list[RequestOutput]:
        outputs, progress = self.output_processor.process(update, time.time())
        self.step_progress += progress
        return outputs

    # ---- observability -------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        return self.scheduler.stats()

    def cache_config_info(self) -> dict[str, str]:
        """vllm:cache_config_info's labels: the KV cache as sized at start (it never changes)."""
        a = self.args
        return {"block_size": str(a.block_size), "cache_dtype": str(self.worker.dtype).removeprefix("torch."),
                "num_gpu_blocks": str(self.worker.num_blocks), "num_cpu_blocks": str(self.worker.num_cpu_blocks),
                "swap_space": str(a.swap_space), "enable_prefix_caching": str(a.enable_prefix_caching),
                "gpu_memory_utilization": str(a.gpu_memory_utilization)}

    def kv_blocks_report(self) -> dict[str, Any]:
        """The block manager's counts and invariant check (GET /debug/kv_blocks); on the engine thread only."""
        return {**self.scheduler.block_manager.report(), "unfinished_requests": self.has_unfinished_requests()}
