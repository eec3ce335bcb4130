"""`GET /debug/kv_blocks` (only with `pagedmodel serve --enable-debug-endpoints`): the KV block pool's
counts and the block manager's invariant check, run on the engine thread between two steps.

What a soak or an operator needs to prove "no leaked blocks": the gauge says how many blocks are in use;
this also checks that every block's ref count equals the block tables holding it. It is read-only and
cheap (one pass over the pool), but it lists internals, so it is off by default and behind the API key.
"""
from __future__ import annotations

from typing import Any


def kv_blocks_report(engine: Any) -> dict[str, Any]:
    """Pool counts and `check_invariants()`'s verdict; call on the engine thread only."""
    bm = engine.scheduler.block_manager
    try:
        bm.check_invariants()
        invariant_error = None
    except AssertionError as exc:
        invariant_error = str(exc) or "invariant violated"
    cpu = bm.cpu_pool
    return {
        "num_blocks": bm.pool.num_blocks,
        "blocks_free": bm.pool.num_free,
        "blocks_in_use": bm.pool.num_blocks - bm.pool.num_free,
        "blocks_cached": bm.pool.num_cached,          # full blocks findable by prefix hash (free or not)
        "num_cpu_blocks": cpu.num_blocks if cpu is not None else 0,
        "cpu_blocks_in_use": (cpu.num_blocks - cpu.num_free) if cpu is not None else 0,
        "sequences_resident": len(bm.tables),
        "sequences_swapped": len(bm.cpu_tables),
        "unfinished_requests": bool(engine.has_unfinished_requests()),
        "invariants_ok": invariant_error is None,
        "invariant_error": invariant_error,
    }
