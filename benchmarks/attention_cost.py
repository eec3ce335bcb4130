"""Decode attention cost: does one long sequence make the short ones pay for its length?

    python benchmarks/attention_cost.py [--threads 2] [--short 150] [--long 2000] [--batch 64] [--cache-gib 2]
    python benchmarks/attention_cost.py --prefill [--threads 2] [--dtype bfloat16]
    python benchmarks/attention_cost.py --block-sizes 16 128 [--threads 1] [--dtype bfloat16] [--layers 30]

One layer of SmolLM2-135M's attention (9 query heads, 3 KV heads, head dim 64, block size 16) over
a decode batch of ``--batch`` sequences of ``--short`` tokens, then the same batch with one of them
``--long`` tokens long, for each implementation: the dense reference (padded to the longest, float32),
the torch-ops fallback (length buckets + SDPA) and the C++ row op. Prints milliseconds per call and
the ratio long/short; the issue's bar is < 2x (the sum of contexts grows by
``(long - short) / (batch * short)``, 19 % with the defaults). A benchmark, not a test: compare the
ratios of one run. ``--cache-gib`` scatters the batch's blocks over a cache of that size, as a
serving engine's are: then the reads come from DRAM, not from the last-level cache.

``--prefill`` times a long chunk's attention instead (whole prompts of 512 and 1,500 tokens, and a
512-token chunk at the end of a 1,500-token context): ``torch_attention.prefill_attention`` (float32
tiles of query rows, each over the keys it can see) against one SDPA call over the whole chunk with a
bottom-right causal mask, which is what it replaced; with ``--dtype bfloat16``, also each C++ prefill op
this CPU has (VDPBF16PS, AMX) on its own.

``--block-sizes`` times the C++ row op on a decode batch shaped like the mixed workload's (27 rows,
lognormal contexts, ~11k tokens in all) for each block size, cycling through ``--layers`` caches of
``2 GiB / layers`` each, as a step does through its layers: between two calls on one cache the others
push it out of the last-level cache, so the blocks come from DRAM, where the block size decides how
long each contiguous read is. Prints ms per call and the K/V bytes read per second.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "kernels"))
from kernel_batches import make_batch  # noqa: E402

from pagedmodel.kernels import cpu_ops, reference_attention, torch_attention  # noqa: E402


def time_ms(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(3):   # best of three rounds: the machine is shared, the minimum is the least noisy
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - start) / reps * 1e3)
    return best


def implementations() -> dict:
    def fast(mode):
        def run(b, scale):
            os.environ[cpu_ops.OPS_ENV] = mode
            return torch_attention.paged_attention(b.query, b.kv_cache, b.meta, scale)
        return run
    impls = {"reference (padded, fp32)": lambda b, s: reference_attention.paged_attention(b.query, b.kv_cache, b.meta, s),
             "torch ops (length buckets)": fast("off")}
    if cpu_ops.load() is not None:
        impls["C++ row op"] = fast("auto")
    else:
        print(f"C++ row op unavailable: {cpu_ops.load_error()}")
    return impls


def sdpa_prefill(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
                 scale: float) -> torch.Tensor:
    """The replaced path: one SDPA call, every score of the chunk materialised at once."""
    q_len = query.shape[0]
    k, v = reference_attention.gather_context(kv_cache, block_table, seq_len)
    rows = torch.arange(q_len)[:, None] + (seq_len - q_len)
    mask = torch.arange(seq_len)[None, :] <= rows
    out = torch.nn.functional.scaled_dot_product_attention(query.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                           attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)


def prefill_ops(dtype: torch.dtype) -> dict:
    """The C++ prefill ops this CPU has, timed one by one (``prefill_attention`` takes the fastest)."""
    if dtype != torch.bfloat16:
        return {}
    found = {"VDPBF16PS op": cpu_ops.bf16_prefill(), "AMX op": cpu_ops.amx_prefill()}
    return {name: op for name, op in found.items() if op is not None}


def prefill_cost(args, shapes: dict) -> dict:
    results = {}
    print(f"long-chunk attention, {args.dtype}, {args.threads} threads; ms per layer call")
    ops = prefill_ops(shapes["dtype"])
    for q_len, seq_len in ((512, 512), (1500, 1500), (512, 1500)):
        b = make_batch([q_len], [seq_len], **shapes)
        query, table = b.query, b.meta.block_tables[0]
        old = time_ms(lambda: sdpa_prefill(query, b.kv_cache, table, seq_len, 64 ** -0.5), args.reps)
        new = time_ms(lambda: torch_attention.prefill_attention(query, b.kv_cache, table, seq_len, 64 ** -0.5),
                      args.reps)
        row = {"sdpa_ms": old, "tiled_ms": new, "speedup": old / new}
        for name, op in ops.items():
            args_ = (query.contiguous(), b.kv_cache, table.to(torch.int32).contiguous(), seq_len, 64 ** -0.5)
            row[f"{name} ms"] = time_ms(lambda: op(*args_), args.reps)
        results[f"{q_len}/{seq_len}"] = row
        each = "".join(f"  {name} {row[f'{name} ms']:8.2f}" for name in ops)
        print(f"  {q_len:5d} rows over {seq_len:5d} tokens: one SDPA call {old:8.2f}  tiled {new:8.2f}  "
              f"({old / new:.1f}x){each}")
    return results


def kv_bytes(shapes: dict, block_size: int) -> int:
    """K and V bytes of one block of ``block_size`` tokens."""
    return 2 * block_size * shapes["kv_heads"] * shapes["head_dim"] * shapes["dtype"].itemsize


def block_size_cost(args, shapes: dict) -> dict:
    rng = random.Random(0)
    lens = [min(1700, int(rng.lognormvariate(5.8, 0.8))) for _ in range(27)]
    results = {}
    print(f"{len(lens)} decode rows, {sum(lens)} context tokens, {args.dtype}, {args.threads} threads, "
          f"{args.layers} layer caches of {2 / args.layers:.3f} GiB; ms per layer call")
    for block_size in args.block_sizes:
        spare = int((2 << 30) / args.layers / kv_bytes(shapes, block_size))
        layers = [make_batch([1] * len(lens), lens, **{**shapes, "block_size": block_size, "spare_blocks": spare},
                             seed=i) for i in range(args.layers)]
        turn = itertools.count()

        def call():
            b = layers[next(turn) % args.layers]
            torch_attention.paged_attention(b.query, b.kv_cache, b.meta, 64 ** -0.5)
        ms = time_ms(call, args.reps * args.layers)
        rate = sum(lens) * kv_bytes(shapes, 1) / (ms / 1e3) / 1e9
        results[str(block_size)] = {"ms": ms, "kv_gb_per_s": rate}
        print(f"  block size {block_size:4d}: {ms:7.3f} ms  {rate:6.2f} GB/s of K/V")
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--short", type=int, default=150)
    ap.add_argument("--long", type=int, default=2000)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--cache-gib", type=float, default=0.0,
                    help="spread the blocks over a K+V cache of this size (0: just the blocks the batch needs)")
    ap.add_argument("--prefill", action="store_true", help="time long-chunk (prefill) attention instead of decode")
    ap.add_argument("--block-sizes", type=int, nargs="+", default=None,
                    help="time the C++ row op per block size on DRAM-resident caches instead")
    ap.add_argument("--layers", type=int, default=30, help="with --block-sizes: caches cycled through")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    shapes = dict(block_size=16, q_heads=9, kv_heads=3, head_dim=64, dtype=dtype)
    shapes["spare_blocks"] = max(3, int(args.cache_gib * (1 << 30) / kv_bytes(shapes, 16)))
    if args.block_sizes and cpu_ops.load() is None:
        sys.exit(f"C++ row op unavailable: {cpu_ops.load_error()}")
    if args.prefill or args.block_sizes:
        results = prefill_cost(args, shapes) if args.prefill else block_size_cost(args, shapes)
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
        return
    short = make_batch([1] * args.batch, [args.short] * args.batch, **shapes)
    skewed = make_batch([1] * args.batch, [args.short] * (args.batch - 1) + [args.long], **shapes)
    scale = 64 ** -0.5
    print(f"{args.batch} decode rows x {args.short} tokens vs one of them {args.long}; {args.dtype}, "
          f"{args.threads} threads, cache {short.kv_cache.nbytes / (1 << 30):.2f} GiB; ms per layer call")
    results = {}
    for name, fn in implementations().items():
        a = time_ms(lambda: fn(short, scale), args.reps)
        b = time_ms(lambda: fn(skewed, scale), args.reps)
        results[name] = {"all_short_ms": a, "one_long_ms": b, "ratio": b / a}
        print(f"  {name:28s} all short {a:8.2f}  one long {b:8.2f}  ratio {b / a:5.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
