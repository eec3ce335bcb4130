"""How many KV blocks fit: an explicit count or byte budget, the CPU default, or a GPU profile run."""
from __future__ import annotations

import torch

from pagedmodel.kernels.attention_metadata import AttentionMetadata
from pagedmodel.kernels.backend import AttentionBackend

from .args import ConfigError, EngineArgs
from .kv_cache import CPU_DEFAULT_KV_BYTES, KVCache
from .model_config import ModelConfig


def num_kv_blocks(args: EngineArgs, mc: ModelConfig, model: torch.nn.Module, backend: AttentionBackend,
                  device: torch.device, dtype: torch.dtype, per_block: int, max_num_batched_tokens: int) -> int:
    if args.num_gpu_blocks_override:
        return args.num_gpu_blocks_override
    if args.kv_cache_memory:
        return max(1, args.kv_cache_memory // per_block)
    if device.type == "cpu":
        return max(1, CPU_DEFAULT_KV_BYTES // per_block)
    peak = _profile_peak(args, mc, model, backend, device, dtype, min(max_num_batched_tokens, mc.max_model_len))
    total = torch.cuda.get_device_properties(device).total_memory
    budget = total * args.gpu_memory_utilization - peak
    if budget < per_block:
        raise ConfigError(f"no GPU memory left for the KV cache (peak {peak / 2**30:.1f} GiB of "
                          f"{total / 2**30:.1f} GiB): raise --gpu-memory-utilization")
    return int(budget // per_block)


def _profile_peak(args: EngineArgs, mc: ModelConfig, model: torch.nn.Module, backend: AttentionBackend,
                  device: torch.device, dtype: torch.dtype, tokens: int) -> int:
    """Peak device memory of the largest step, run once on a KV cache just big enough for it."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    bs = args.block_size
    n_blocks = -(-tokens // bs)
    probe = KVCache(mc.num_layers, n_blocks, bs, mc.num_kv_heads, mc.head_dim, dtype, device, backend)
    meta = AttentionMetadata.build([tokens], [tokens], [list(range(n_blocks))], list(range(tokens)), device)
    with torch.inference_mode():
        ids = torch.zeros(tokens, dtype=torch.long, device=device)
        pos = torch.arange(tokens, device=device)
        hidden = model(ids, pos, probe.layers, meta, backend)
        model.compute_logits(hidden[-min(tokens, args.max_num_seqs):])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del probe
    torch.cuda.empty_cache()
    return peak
