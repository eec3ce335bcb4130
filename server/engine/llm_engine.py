"""LLMEngine: requests in, one scheduler iteration per ``step()``, incremental outputs back.

Not thread-safe: one thread owns the engine (the async front runs it in a background loop).
"""
from __future__ import annotations

import json
import logging
import random
import time
from pathlib import Path

import torch

from pagedmodel.kernels import cpu_paged_attention
from pagedmodel.kernels.attention_metadata import AttentionMetadata
from pagedmodel.kernels.backend import select_backend
from pagedmodel.kernels.cpu_features import has_native_bf16

from .beam_group import BeamGroup
from .beam_search import BeamSearch
from .block_manager import BlockManager
from .args import ConfigError, EngineArgs
from .detokenizer import detokenize_incrementally, init_offsets
from .kv_cache import CPU_DEFAULT_KV_BYTES, KVCache, bytes_per_block
from .model_runner import ModelRunner
from .models.llama import LlamaForCausalLM
from .models.loader import load_weights, model_class, read_config
from .outputs import CompletionOutput, RequestMetrics, RequestOutput
from .sampler import SamplingRow, sample
from .sampling_params import SamplingParams
from .scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from .sequence import Sequence, SequenceGroup, SequenceStatus
from .stats import EngineStats

log = logging.getLogger("pagedmodel.engine")

DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


class InvalidRequestError(ValueError):
    """The request can never be served as asked (HTTP 400); ``param`` names the culprit."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _resolve_model_dir(model: str | None) -> Path:
    from .model_store import resolve_model

    return Path(resolve_model(model))


def _default_served_name(model: str | None, model_dir: Path) -> str:
    """A local dir serves under its folder name, a hub id under itself, a built-in under its upstream name."""
    if model and Path(model).expanduser().is_dir():
        return Path(model).expanduser().resolve().name
    from .model_store import BUILTIN_SOURCES, DEFAULT_MODEL_NAME, SMOLLM2

    if not model or any(model in s.aliases or model.lower() == s.name for s in BUILTIN_SOURCES.values()):
        return DEFAULT_MODEL_NAME if (not model or model_dir.name == SMOLLM2.name) else model_dir.name
    return model.removeprefix("hf://")


def _pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for, but no CUDA device is available")
    return device


def _pick_dtype(name: str, config, device: torch.device, native_bf16: bool | None = None) -> torch.dtype:
    """``--dtype``; ``auto`` is bf16 on GPUs (fp16 if the checkpoint is fp16) and on CPUs with native
    bf16 (AMX / AVX512-BF16), float32 on other CPUs (there bf16 is emulated: slower and lossy)."""
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cpu":
        return torch.bfloat16 if (has_native_bf16() if native_bf16 is None else native_bf16) else torch.float32
    wanted = getattr(config, "torch_dtype", None) or getattr(config, "dtype", None)
    return torch.float16 if wanted in (torch.float16, "float16") else torch.bfloat16


class LLMEngine:
    def __init__(self, args: EngineArgs):
        self.args = args
        self.model_dir = _resolve_model_dir(args.model)
        self.model_name = args.served_model_name or _default_served_name(args.model, self.model_dir)
        config = read_config(self.model_dir)
        model_class(config)  # unsupported architectures fail here, before any allocation
        self.config = config
        self.device = _pick_device(args.device)
        self.dtype = _pick_dtype(args.dtype, config, self.device)

        max_len = int(getattr(config, "max_position_embeddings", 2048))
        window = getattr(config, "sliding_window", None)
        if window and getattr(config, "use_sliding_window", True) and config.model_type == "mistral":
            max_len = min(max_len, int(window))  # no sliding-window attention here: stay inside the window
        if args.max_model_len and args.max_model_len > max_len:
            raise ConfigError(f"--max-model-len {args.max_model_len} exceeds the model's limit of {max_len} tokens")
        self.max_model_len = args.max_model_len or max_len
        self.max_num_batched_tokens = args.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS

        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        self.vocab_size = int(config.vocab_size)
        self.eos_token_ids = self._eos_ids(config)

        self.backend = select_backend(self.device)
        if self.device.type == "cpu" and self.backend.name == "torch":
            cpu_paged_attention.load()   # build (or load) the CPU attention op now, not in the first request
        torch.manual_seed(args.seed)
        self.model = LlamaForCausalLM(config, max_positions=self.max_model_len)
        load_weights(self.model, self.model_dir, self.dtype, self.device)
        self.model.eval()

        head_dim, kv_heads = self.head_dim(), self.kv_cache_heads()
        per_block = bytes_per_block(config.num_hidden_layers, args.block_size, kv_heads, head_dim, self.dtype)
        num_blocks = self._num_kv_blocks(per_block)
        if num_blocks * args.block_size < self.max_model_len:
            raise ConfigError(
                f"the KV cache holds {num_blocks} blocks of {args.block_size} tokens = "
                f"{num_blocks * args.block_size} tokens, fewer than --max-model-len {self.max_model_len}: "
                "give it more memory (--kv-cache-memory / --gpu-memory-utilization) or lower --max-model-len")
        num_cpu_blocks = int(args.swap_space * 2**30 // per_block)
        self.kv_cache = KVCache(config.num_hidden_layers, num_blocks, args.block_size, kv_heads, head_dim,
                                self.dtype, self.device, self.backend, num_cpu_blocks)
        self.block_manager = BlockManager(num_blocks, args.block_size, args.enable_prefix_caching,
                                          num_cpu_blocks=num_cpu_blocks)
        self.scheduler = Scheduler(self.block_manager, args.max_num_seqs, self.max_num_batched_tokens,
                                   args.preemption_mode)
        self.runner = ModelRunner(self.model, self.kv_cache, self.block_manager, self.backend, self.device,
                                  max_model_len=self.max_model_len, max_num_seqs=args.max_num_seqs,
                                  enforce_eager=args.enforce_eager)
        self.requests: dict[str, SequenceGroup] = {}
        self._generators: dict[int, torch.Generator] = {}
        self._beams: dict[str, BeamGroup] = {}
        self._seed_rng = random.Random(args.seed)
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        log.info("engine ready: %s on %s (%s), %d KV blocks x %d tokens (%.1f MiB), max_model_len %d",
                 self.model_name, self.device, self.dtype, num_blocks, args.block_size,
                 self.kv_cache.nbytes / 2**20, self.max_model_len)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args)

    def _eos_ids(self, config) -> set[int]:
        ids: set[int] = set()
        for source in (getattr(self.tokenizer, "eos_token_id", None), getattr(config, "eos_token_id", None)):
            if isinstance(source, int):
                ids.add(source)
            elif isinstance(source, (list, tuple)):
                ids.update(int(i) for i in source)
        gen_cfg = self.model_dir / "generation_config.json"
        if gen_cfg.exists():
            eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
            ids.update([eos] if isinstance(eos, int) else (eos or []))
        return ids

    def _num_kv_blocks(self, per_block: int) -> int:
        if self.args.num_gpu_blocks_override:
            return self.args.num_gpu_blocks_override
        if self.args.kv_cache_memory:
            return max(1, self.args.kv_cache_memory // per_block)
        if self.device.type == "cpu":
            return max(1, CPU_DEFAULT_KV_BYTES // per_block)
        return self._profile_gpu_blocks(per_block)

    def _profile_gpu_blocks(self, per_block: int) -> int:
        """Run the largest step once on a cache just big enough, then give the KV cache what the
        utilization target leaves."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        tokens = min(self.max_num_batched_tokens, self.max_model_len)
        bs = self.args.block_size
        n_blocks = -(-tokens // bs)
        probe = KVCache(self.config.num_hidden_layers, n_blocks, bs, self.kv_cache_heads(), self.head_dim(),
                        self.dtype, self.device, self.backend)
        meta = AttentionMetadata.build([tokens], [tokens], [list(range(n_blocks))], list(range(tokens)), self.device)
        with torch.inference_mode():
            ids = torch.zeros(tokens, dtype=torch.long, device=self.device)
            pos = torch.arange(tokens, device=self.device)
            hidden = self.model(ids, pos, probe.layers, meta, self.backend)
            self.model.compute_logits(hidden[-min(tokens, self.args.max_num_seqs):])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        del probe
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(self.device).total_memory
        budget = total * self.args.gpu_memory_utilization - peak
        if budget < per_block:
            raise ConfigError(f"no GPU memory left for the KV cache (peak {peak / 2**30:.1f} GiB of "
                              f"{total / 2**30:.1f} GiB): raise --gpu-memory-utilization")
        return int(budget // per_block)

    def kv_cache_heads(self) -> int:
        return getattr(self.config, "num_key_value_heads", None) or self.config.num_attention_heads

    def head_dim(self) -> int:
        return getattr(self.config, "head_dim", None) or self.config.hidden_size // self.config.num_attention_heads

    # ---- requests ------------------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt).input_ids)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, *,
                    arrival_time: float | None = None, priority: int = 0, cache_salt: str | None = None) -> None:
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenize(prompt)
        else:
            text, ids = None, list(prompt)
            bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(f"token id {bad[0]!r} is outside the vocabulary [0, {self.vocab_size})", "prompt")
        if not ids:
            raise InvalidRequestError("the prompt is empty", "prompt")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the prompt has "
                f"{len(ids)} tokens (at least one token must be left to generate)", "prompt")
        max_tokens = params.max_tokens
        if max_tokens is not None and len(ids) + max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has {len(ids)} "
                f"tokens and max_tokens asks for {max_tokens} more ({len(ids) + max_tokens} in total)", "max_tokens")
        total = len(ids) + (max_tokens if max_tokens is not None else self.max_model_len - len(ids))
        width = params.best_of
        if width * self.block_manager.blocks_needed(total) > self.block_manager.num_blocks:
            raise InvalidRequestError(
                f"{width} sequences of up to {total} tokens cannot fit in the KV cache "
                f"({self.block_manager.num_blocks * self.block_manager.block_size} tokens)", "max_tokens")
        if params.stop_token_ids and max(params.stop_token_ids) >= self.vocab_size:
            raise InvalidRequestError("stop_token_ids contains ids outside the vocabulary", "stop_token_ids")
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        group = SequenceGroup(request_id, text, ids, params,
                              RequestMetrics(arrival_time if arrival_time is not None else time.time()),
                              priority=priority, seed=seed, cache_salt=(cache_salt or "").encode())
        init_offsets(group.seqs[0])
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None]   # nothing scores the first prompt token
        if params.use_beam_search:
            limit = self.max_model_len - len(ids)
            search = BeamSearch(params.best_of, params.length_penalty, params.early_stopping,
                                () if params.ignore_eos else self.eos_token_ids,
                                max_new_tokens=min(max_tokens, limit) if max_tokens is not None else limit)
            self._beams[request_id] = BeamGroup(group, search, self.block_manager)
        self.requests[request_id] = group
        self.scheduler.add(group)

    def abort_request(self, request_id: str) -> None:
        group = self.requests.pop(request_id, None)
        if group is None:
            return
        self.scheduler.abort(group)
        self._drop_generators(group)
        self._beams.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, move KV blocks, run the model, sample, and report what changed."""
        sched = self.scheduler.schedule()
        now = time.time()
        for group in sched.admitted:
            if group.metrics.first_scheduled_time is None:
                group.metrics.first_scheduled_time = now
                self.prompt_tokens_total += len(group.prompt_token_ids)
        if sched.is_empty:
            return []
        logits, prompt_logprobs = self.runner.execute(sched)
        for i, start, logprobs in prompt_logprobs:
            self._record_prompt_logprobs(sched.scheduled[i], start, logprobs)
        sampling = self._advance_computed(sched)
        touched: dict[str, SequenceGroup] = {}
        new_counts: dict[int, int] = {}
        self._sample(sampling, logits, touched, new_counts)
        self.scheduler.free_finished()
        return self._collect_outputs(touched, new_counts)

    def _advance_computed(self, sched: SchedulerOutput) -> list[ScheduledSequence]:
        """Mark the step's tokens computed (committing full blocks to the prefix cache); returns the
        sequences whose logits give their next token, in logits-row order."""
        sampling = []
        for s in sched.scheduled:
            samples = s.samples   # read before num_computed_tokens moves
            s.seq.num_computed_tokens += s.num_new_tokens
            self.block_manager.commit(s.seq, s.group.cache_salt)
            if samples:
                sampling.append(s)
        return sampling

    def _sample(self, sampling: list[ScheduledSequence], logits: torch.Tensor,
                touched: dict[str, SequenceGroup], new_counts: dict[int, int]) -> None:
        rows: list[SamplingRow] = []
        targets: list[tuple[SequenceGroup, Sequence]] = []
        row_logits: list[int] = []
        now = time.time()
        for i, s in enumerate(sampling):
            group, seq = s.group, s.seq
            beams = self._beams.get(group.request_id)
            if beams is not None:
                if beams.offer(seq, logits[i]):
                    self.generation_tokens_total += beams.advance()
                    group.metrics.first_token_time = group.metrics.first_token_time or now
                    group.metrics.last_token_time = now
                    touched[group.request_id] = group
                continue
            family = [seq]
            if seq.num_output_tokens == 0 and len(group.seqs) < group.params.best_of:
                family += self._fork(group, seq)   # samples share the prompt's blocks from here on
            for member in family:
                rows.append(self._sampling_row(group, member))
                targets.append((group, member))
                row_logits.append(i)
        if not rows:
            return
        index = torch.tensor(row_logits, dtype=torch.long, device=logits.device)
        results = sample(logits.index_select(0, index), rows)
        now = time.time()
        for (group, seq), result in zip(targets, results):
            seq.append_token(result.token_id, result.logprob, result.top_logprobs)
            self.generation_tokens_total += 1
            if group.metrics.first_token_time is None:
                group.metrics.first_token_time = now
            group.metrics.last_token_time = now
            detokenize_incrementally(self.tokenizer, seq, group.params.skip_special_tokens)
            self._check_stop(group, seq, result.token_id)
            new_counts[seq.seq_id] = new_counts.get(seq.seq_id, 0) + 1
            touched[group.request_id] = group

    def _collect_outputs(self, touched: dict[str, SequenceGroup], new_counts: dict[int, int]) -> list[RequestOutput]:
        now = time.time()
        outputs = []
        for group in touched.values():
            if group.is_finished:
                group.metrics.finished_time = now
                self.requests.pop(group.request_id, None)
                self._drop_generators(group)
            beams = self._beams.get(group.request_id)
            out = self._make_output(group, new_counts) if beams is None else self._beam_output(group, beams)
            if out is not None:
                outputs.append(out)
        return outputs

    def _record_prompt_logprobs(self, s: ScheduledSequence, start: int, logprobs: torch.Tensor) -> None:
        group, seq = s.group, s.seq
        k = group.params.prompt_logprobs
        targets = torch.tensor(seq.token_ids[start + 1:start + 1 + len(logprobs)], device=logprobs.device)
        chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
        top = torch.topk(logprobs, k) if k else None
        for j, (token, lp) in enumerate(zip(targets.tolist(), chosen)):
            if len(group.prompt_logprobs) != start + 1 + j:
                continue   # already recorded (a recomputed prompt scores the same tokens again)
            entry = {token: lp}
            if top is not None:
                entry.update({int(t): float(v) for t, v in zip(top.indices[j].tolist(), top.values[j].tolist())})
            group.prompt_logprobs.append(entry)

    def _beam_output(self, group: SequenceGroup, beams: BeamGroup) -> RequestOutput | None:
        if beams.hypotheses is None:
            return None   # beams are only ranked at the end
        del self._beams[group.request_id]
        completions = []
        for i, hyp in enumerate(beams.hypotheses[:group.params.n]):
            ended = bool(hyp.tokens) and hyp.tokens[-1] in beams.search.eos_token_ids
            completions.append(CompletionOutput(
                index=i, text=self.tokenizer.decode(hyp.tokens, skip_special_tokens=group.params.skip_special_tokens),
                token_ids=list(hyp.tokens), cumulative_logprob=hyp.cum_logprob,
                finish_reason="stop" if ended else "length"))
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, completions, True,
                             group.metrics, num_cached_tokens=group.num_cached_tokens,
                             new_token_counts=[len(c.token_ids) for c in completions])

    def _fork(self, group: SequenceGroup, parent: Sequence) -> list[Sequence]:
        children = []
        for index in range(len(group.seqs), group.params.best_of):
            child = parent.fork(index)
            self.block_manager.fork(parent, child)
            group.seqs.append(child)
            children.append(child)
        return children

    def _sampling_row(self, group: SequenceGroup, seq: Sequence) -> SamplingRow:
        p = group.params
        gen = None
        if not p.greedy:
            gen = self._generators.get(seq.seq_id)
            if gen is None:
                gen = torch.Generator(device=self.device)
                gen.manual_seed((group.seed + 1_000_003 * seq.index) % 2**63)
                self._generators[seq.seq_id] = gen
        banned: tuple[int, ...] = ()
        if seq.num_output_tokens < p.min_tokens:
            banned = tuple(sorted((set() if p.ignore_eos else self.eos_token_ids) | set(p.stop_token_ids)))
        return SamplingRow(p, group.prompt_token_ids, seq.output_token_ids, gen, banned)

    def _drop_generators(self, group: SequenceGroup) -> None:
        for seq in group.seqs:
            self._generators.pop(seq.seq_id, None)

    def _check_stop(self, group: SequenceGroup, seq: Sequence, token: int) -> None:
        p = group.params
        if not p.ignore_eos and token in self.eos_token_ids and seq.num_output_tokens > p.min_tokens - 1:
            seq.status = SequenceStatus.FINISHED_STOPPED
            return
        if token in p.stop_token_ids:
            seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, token
            return
        if p.stop and seq.num_output_tokens >= p.min_tokens:
            window = max(len(s) for s in p.stop) + 16
            tail_start = max(0, len(seq.output_text) - window)
            for stop in p.stop:
                at = seq.output_text.find(stop, tail_start)
                if at >= 0:
                    end = at + len(stop) if p.include_stop_str_in_output else at
                    seq.output_text = seq.output_text[:end]
                    seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, stop
                    return
        if p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens:
            seq.status = SequenceStatus.FINISHED_LENGTH
        elif seq.num_tokens >= self.max_model_len:
            seq.status = SequenceStatus.FINISHED_LENGTH

    def _make_output(self, group: SequenceGroup, new_counts: dict[int, int]) -> RequestOutput | None:
        p = group.params
        finished = group.is_finished
        seqs = sorted(group.seqs, key=lambda s: s.index)
        if p.best_of > p.n:
            if not finished:
                return None  # the best n are only known at the end
            seqs = sorted(group.seqs, key=lambda s: s.cumulative_logprob, reverse=True)[:p.n]
        hold = max((len(s) for s in p.stop), default=1) - 1  # never stream what may turn out to be a stop string
        completions = []
        for i, seq in enumerate(seqs):
            text = seq.output_text
            if hold and not seq.is_finished:
                text = text[:max(0, len(text) - hold)]
            completions.append(CompletionOutput(
                index=i if p.best_of > p.n else seq.index, text=text, token_ids=list(seq.output_token_ids),
                cumulative_logprob=seq.cumulative_logprob,
                logprobs=list(seq.output_logprobs) if p.logprobs is not None else None,
                finish_reason=seq.status.finish_reason, stop_reason=seq.stop_reason))
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, completions, finished,
                             group.metrics, num_cached_tokens=group.num_cached_tokens,
                             prompt_logprobs=list(group.prompt_logprobs) if group.prompt_logprobs is not None else None,
                             new_token_counts=[new_counts.get(s.seq_id, 0) for s in seqs])

    # ---- observability -------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_swapped=len(self.scheduler.swapped), kv_cache_usage=bm.usage(), cpu_cache_usage=bm.cpu_usage(),
            num_blocks_total=bm.num_blocks, num_blocks_free=bm.num_free_blocks,
            fragmentation=bm.fragmentation(),
            prompt_tokens_total=self.prompt_tokens_total, generation_tokens_total=self.generation_tokens_total,
            prefix_cache_queries_total=bm.prefix_queries, prefix_cache_hits_total=bm.prefix_hits,
            num_preemptions_total=self.scheduler.num_preemptions, num_swap_outs_total=self.scheduler.num_swap_outs,
            max_num_seqs=self.args.max_num_seqs, block_size=self.args.block_size)
