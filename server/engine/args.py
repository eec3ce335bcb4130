"""Engine configuration: the vLLM-named flags, their validation, and the values derived from them."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Any

from .config_error import ConfigError
from .reasoning_config import ReasoningConfig
from .watermark_config import WatermarkConfig, WatermarkConfigError, parse_watermark_config


SUPPORTED_BLOCK_SIZES = (1, 8, 16, 32, 64, 128)
# --block-size when not given, per device type (vLLM's defaults; device.pick_block_size). On CPU a decode
# step's attention reads each sequence's blocks from DRAM, and 16-token blocks are 6 KB pieces at random
# places, read at a fifth of the streaming rate: 128-token blocks made the attention op 1.5x faster on
# mixed-length traffic (benchmarks/attention_cost.py --block-sizes; docs/engine.md).
CPU_BLOCK_SIZE = 128
GPU_BLOCK_SIZE = 16
PREEMPTION_MODES = ("swap", "recompute")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}   # vLLM's --dtype names for the same types
# --load-format: auto and safetensors read the checkpoint's *.safetensors; dummy initialises the weights at
# random from config.json alone (vLLM's: for profiling and for tests that need a model's shape, not its answers)
LOAD_FORMATS = ("auto", "safetensors", "dummy")


def canonical_dtype(name: str) -> str:
    return DTYPE_ALIASES.get(name, name)


@dataclass
class EngineArgs:
    model: str | None = None            # local HF dir, a known name ("smollm2"), or a hub id; None = default
    served_model_name: str | None = None
    block_size: int | None = None       # None: CPU_BLOCK_SIZE or GPU_BLOCK_SIZE, by device
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None   # None: 2048 (chunked prefill splits longer prompts)
    max_model_len: int | None = None            # None: the model's max_position_embeddings
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = None          # bytes for the KV cache; CPU default 1 GiB
    num_gpu_blocks_override: int | None = None  # exact block count (tests use it to force preemption)
    swap_space: float = 4.0                     # GiB of CPU swap space for preempted sequences
    enable_prefix_caching: bool = False
    preemption_mode: str | None = None          # None: swap for multi-sequence groups, recompute otherwise
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    enforce_eager: bool = False
    torch_compile: bool = False                 # the forward through torch.compile (inductor); --enforce-eager wins
    max_queue_len: int | None = None            # waiting requests beyond this are refused (HTTP 503)
    enable_lora: bool = False
    max_loras: int = 1                          # adapters resident (batched together) at once
    max_lora_rank: int = 16
    lora_modules: list[str] | None = None       # "name=path" or '{"name": ..., "path": ...}' loaded at start
    enable_prompt_embeds: bool = False          # prompts may come as input embeddings (vLLM's flag)
    load_format: str = "auto"                   # LOAD_FORMATS
    skip_tokenizer_init: bool = False           # no tokenizer: token ids in, token ids out (vLLM's flag)
    # vLLM's --reasoning-config (JSON text, a dict, or a ReasoningConfig): the thinking markers that
    # thinking_token_budget counts between and forces (reasoning_config.py)
    reasoning_config: ReasoningConfig | str | dict[str, Any] | None = None
    watermark_config: str | dict[str, Any] | WatermarkConfig | None = None   # vLLM's JSON; watermark_config.py

    def __post_init__(self) -> None:
        if self.reasoning_config is not None:
            self.reasoning_config = ReasoningConfig.parse(self.reasoning_config)
        self.validate()

    def validate(self) -> None:
        if self.block_size is not None and self.block_size not in SUPPORTED_BLOCK_SIZES:
            raise ConfigError(f"--block-size must be one of {SUPPORTED_BLOCK_SIZES}, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ConfigError(f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"--max-model-len must be >= 1, got {self.max_model_len}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ConfigError(f"--kv-cache-memory must be a positive byte count, got {self.kv_cache_memory}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ConfigError("num_gpu_blocks_override must be >= 1")
        if self.swap_space < 0:
            raise ConfigError(f"--swap-space must be >= 0 GiB, got {self.swap_space}")
        if self.preemption_mode is not None and self.preemption_mode not in PREEMPTION_MODES:
            raise ConfigError(f"--preemption-mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"--device must be auto, cpu or cuda[:N], got {self.device!r}")
        if self.max_queue_len is not None and self.max_queue_len < 0:
            raise ConfigError(f"--max-queue-len must be >= 0, got {self.max_queue_len}")
        if self.max_loras < 1:
            raise ConfigError(f"--max-loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ConfigError(f"--max-lora-rank must be >= 1, got {self.max_lora_rank}")
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(f"--load-format {self.load_format} is not served: the loader reads safetensors "
                              f"checkpoints (auto, safetensors) or initialises random weights (dummy)")
        if self.lora_modules and not self.enable_lora:
            raise ConfigError("--lora-modules needs --enable-lora")
        for spec in self.lora_modules or []:
            parse_lora_module(spec)
        self.watermark()

    def watermark(self) -> WatermarkConfig | None:
        """--watermark-config parsed and checked (a ConfigError names the bad field)."""
        try:
            return parse_watermark_config(self.watermark_config)
        except WatermarkConfigError as exc:
            raise ConfigError(str(exc)) from None

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        d = EngineArgs.__dataclass_fields__
        a = parser.add_argument
        a("--model", default=None, help="HF-format model directory, 'smollm2', or a hub id (default: SmolLM2-135M-Instruct)")
        a("--served-model-name", default=None, help="model name reported by the API (default: the model's name)")
        a("--block-size", type=int, default=d["block_size"].default, choices=SUPPORTED_BLOCK_SIZES, help="tokens per KV block (default: 128 on CPU, 16 on GPUs)")
        a("--max-num-seqs", type=int, default=d["max_num_seqs"].default, help="most sequences in one batch")
        a("--max-num-batched-tokens", type=int, default=None, help="token budget of one step (chunked prefill splits longer prompts)")
        a("--max-model-len", type=int, default=None, help="longest prompt + output, in tokens (default: the model's)")
        a("--gpu-memory-utilization", type=float, default=d["gpu_memory_utilization"].default, help="share of GPU memory for weights + activations + KV cache")
        a("--kv-cache-memory", type=int, default=None, help="bytes of KV cache (CPU; default 1 GiB)")
        a("--swap-space", type=float, default=d["swap_space"].default, help="GiB of CPU memory for swapped-out KV blocks")
        a("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=False,
          help="reuse KV blocks of identical prompt prefixes (off by default; --no-enable-prefix-caching: off)")
        a("--preemption-mode", choices=PREEMPTION_MODES, default=None, help="how to free KV blocks when they run out")
        a("--dtype", type=canonical_dtype, choices=DTYPES, default="auto",
          help="weights and activations dtype; half and float are vLLM's names for float16 and float32 (auto: bf16 on GPU and on CPUs with AMX or AVX512-BF16, else fp32)")
        a("--device", default="auto", help="auto, cpu or cuda[:N]")
        a("--seed", type=int, default=0, help="seed for requests without one")
        a("--enforce-eager", action="store_true",
          help="run every step eagerly, capturing no CUDA graphs (by default, on CUDA with the Triton backend, "
               "decode steps of up to min(max-num-seqs, 512) sequences replay graphs captured at start-up)")
        a("--torch-compile", action="store_true",
          help="compile the model's forward with torch.compile (inductor, weights frozen) at start-up; off by "
               "default: the compile takes 1-3 minutes and on CPU it did not beat the eager path (docs/engine.md); "
               "a failed compile logs and serves eagerly; --enforce-eager wins")
        a("--max-queue-len", type=int, default=None, help="waiting requests beyond this get HTTP 503")
        a("--enable-lora", action="store_true", help="serve LoRA adapters beside the base model")
        a("--max-loras", type=int, default=d["max_loras"].default, help="LoRA adapters resident (batched) at once")
        a("--max-lora-rank", type=int, default=d["max_lora_rank"].default, help="highest adapter rank accepted")
        a("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
          help='adapters loaded at start: name=path, or \'{"name": "...", "path": "..."}\'; requests pick one by "model"')
        a("--enable-prompt-embeds", action="store_true",
          help="accept prompts as input embeddings: completions' prompt_embeds, chat's prompt_embeds content parts "
               "(base64 of torch.save of a [num_tokens, hidden_size] tensor)")
        a("--load-format", default=d["load_format"].default, metavar="FORMAT",
          help="auto or safetensors: the checkpoint's *.safetensors; dummy: random weights from config.json alone "
               "(the model's shape and speed, not its answers)")
        a("--skip-tokenizer-init", action="store_true",
          help="load no tokenizer: prompts are token ids, outputs are token ids with empty text (no chat, stop "
               "strings or structured outputs); logprobs name tokens as token_id:N")
        a("--reasoning-config", default=None, metavar="JSON",
          help='vLLM\'s reasoning config: {"reasoning_start_str": "<think>", "reasoning_end_str": "</think>"} '
               "(thinking_token_budget counts after the start string and forces the end string; an empty string "
               "comes from --reasoning-parser)")
        a("--watermark-config", default=None, metavar="JSON",
          help='watermark sampled text, e.g. \'{"algorithm": "gumbel", "key": 42}\' (vLLM\'s fields: key, algorithm, '
               'context_width, deduplicate_contexts, deduplicate_contexts_max_history; docs/vllm_compat.md); '
               '`pagedmodel watermark detect` scores text for it')
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})


def parse_lora_module(spec: str) -> tuple[str, str]:
    """``name=path`` or the JSON form ``{"name": ..., "path": ...}`` -> (name, path)."""
    import json

    if spec.lstrip().startswith("{"):
        try:
            obj = json.loads(spec)
        except ValueError as exc:
            raise ConfigError(f"--lora-modules: {spec!r} is not valid JSON: {exc}") from None
        name, path = obj.get("name"), obj.get("path")
    else:
        name, _, path = spec.partition("=")
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        raise ConfigError(f"--lora-modules: {spec!r} must be name=path or {{\"name\": ..., \"path\": ...}}")
    return name, path
