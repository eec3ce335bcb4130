"""The model on its device: attention backend chosen, weights loaded, the KV cache sized and allocated."""
from __future__ import annotations

import logging

import torch

from pagedmodel.kernels import cpu_ops
from pagedmodel.kernels.backend import select_backend

from .args import ConfigError, EngineArgs
from .device import pick_device, pick_dtype
from .kv_cache import KVCache, bytes_per_block
from .memory_profiler import num_kv_blocks
from .model_config import ModelConfig
from .models.llama import LlamaForCausalLM
from .models.loader import init_dummy_weights, load_weights

log = logging.getLogger("pagedmodel.engine")


class Worker:
    def __init__(self, args: EngineArgs, mc: ModelConfig, max_num_batched_tokens: int):
        self.device = pick_device(args.device)
        self.dtype = pick_dtype(args.dtype, mc.hf_config, self.device)
        self.backend = select_backend(self.device)
        if self.device.type == "cpu" and self.backend.cache_write_is_cpu_op:
            cpu_ops.load()   # load the CPU ops (and log which build) now, not in the first request
        torch.manual_seed(args.seed)
        self.model = LlamaForCausalLM(mc.hf_config, max_positions=mc.max_model_len)
        if args.load_format == "dummy":
            log.warning("--load-format dummy: random weights (%s on %s); answers are noise", self.dtype, self.device)
            init_dummy_weights(self.model, self.dtype, self.device, args.seed)
        else:
            log.info("loading the weights from %s (%s on %s)", mc.model_dir, self.dtype, self.device)
            load_weights(self.model, mc.model_dir, self.dtype, self.device)
        self.model.eval()
        if self.device.type == "cpu":
            log.info("packing the linear layers")
        self.model.use_packed_linears()   # CPU fp32, or bf16 with native bf16; a no-op elsewhere
        log.info("sizing and allocating the KV cache")

        per_block = bytes_per_block(mc.num_layers, args.block_size, mc.num_kv_heads, mc.head_dim, self.dtype)
        self.num_blocks = num_kv_blocks(args, mc, self.model, self.backend, self.device, self.dtype, per_block,
                                        max_num_batched_tokens)
        if self.num_blocks * args.block_size < mc.max_model_len:
            raise ConfigError(
                f"the KV cache holds {self.num_blocks} blocks of {args.block_size} tokens = "
                f"{self.num_blocks * args.block_size} tokens, fewer than --max-model-len {mc.max_model_len}: "
                "give it more memory (--kv-cache-memory / --gpu-memory-utilization) or lower --max-model-len")
        self.num_cpu_blocks = int(args.swap_space * 2**30 // per_block)
        self.kv_cache = KVCache(mc.num_layers, self.num_blocks, args.block_size, mc.num_kv_heads, mc.head_dim,
                                self.dtype, self.device, self.backend, self.num_cpu_blocks)
