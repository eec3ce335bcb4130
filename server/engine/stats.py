"""A snapshot of the engine's state and cumulative counters, for metrics and autoscaling."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_swapped: int
    kv_cache_usage: float      # 0..1: share of blocks referenced by sequences
    cpu_cache_usage: float     # 0..1: share of swap space in use
    num_blocks_total: int
    num_blocks_free: int       # includes cached-but-unreferenced blocks (evictable)
    fragmentation: float       # share of allocated slots holding no token
    prompt_tokens_total: int
    generation_tokens_total: int
    prefix_cache_queries_total: int
    prefix_cache_hits_total: int
    num_preemptions_total: int
    num_swap_outs_total: int = 0
    # Configuration the router (per-replica in-flight cap) and the operator's tuner read back.
    max_num_seqs: int = 0
    block_size: int = 0
    # block manager allocate() durations, cumulative: counts <= each edge of
    # metrics_contract.ALLOCATION_BUCKETS, then +Inf (= the count); and their sum in seconds
    block_allocation_buckets: tuple[int, ...] = ()
    block_allocation_seconds_sum: float = 0.0
    # LoRA (vllm:lora_requests_info): adapters of running and of waiting requests, and --max-loras
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    max_lora: int = 0
