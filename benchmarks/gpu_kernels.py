#!/usr/bin/env python3
"""One GPU run (< 10 minutes) for the Triton attention backend: correctness, bandwidth, end to end.

    python benchmarks/gpu_kernels.py [--out gpu_kernels.json] [--model DIR]
    python benchmarks/gpu_kernels.py --dry-run --model TINY_DIR   # CPU, Triton interpreter, tiny shapes

Sections:
  1. correctness: every Triton kernel against the pure-torch path on the device (mixed
     prefill/chunk/decode batches, GQA, head dims 64/96/128, block sizes 1..128, split-KV, all dtypes);
  2. decode bandwidth: batch {1, 32, 256} x context {512, 4096}, two head layouts (SmolLM2-135M's
     9q/3kv x 64 and an 8B-class 32q/8kv x 128), bf16, 16-token blocks shuffled over the cache:
     achieved GB/s = minimum bytes a decode step must read (all K/V of every context, plus q and
     the output) / median device time per call (CUDA-graph replays cycling over enough distinct
     caches to defeat L2), and its share of the device peak (4.8 TB/s on an H200);
  3. end to end: engine tokens/s (``pagedmodel.server.engine.llm.LLM``) on SmolLM2-135M in bf16 against
     HF ``generate`` on the same device and prompts, plus how far their greedy tokens agree;
  4. CUDA graphs: engine tokens/s with decode replayed from CUDA graphs against ``enforce_eager``,
     at decode batch sizes {1, 8, 32, 128} (SmolLM2-135M, bf16), plus capture time and memory.
It prints a table, writes everything to JSON and the tables as Markdown (same name, ``.md``) for
docs/benchmarks.md; the exit status is 1 if a correctness case fails.
``--dry-run`` runs every section on CPU under ``TRITON_INTERPRET=1`` with tiny shapes (section 4
through the CPU stand-in for graphs), so CI keeps the script from rotting
(tests/kernels/test_gpu_kernels_dry_run.py, tests/kernels/test_gpu_kernels_graphs_dry_run.py).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

H200_PEAK_GBPS = 4800.0
SECTIONS = ("correctness", "bandwidth", "e2e", "graphs")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU + Triton interpreter, tiny shapes")
    p.add_argument("--out", default="gpu_kernels.json", help="where to write the JSON results")
    p.add_argument("--model", default=None,
                   help="model dir for the end-to-end section (default: the prepared SmolLM2-135M-Instruct)")
    p.add_argument("--skip-e2e", action="store_true", help="kernel sections only (no engine runs)")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"comma-separated subset of {','.join(SECTIONS)} to run (default: all)")
    p.add_argument("--peak-gbps", type=float, default=H200_PEAK_GBPS, help="device peak HBM bandwidth, GB/s")
    p.add_argument("--e2e-prompts", type=int, default=None, help="prompts in the end-to-end run")
    p.add_argument("--e2e-max-tokens", type=int, default=None, help="tokens generated per prompt")
    p.add_argument("--graph-batches", default=None,
                   help="decode batch sizes of the CUDA-graph section, comma-separated (default 1,8,32,128)")
    args = p.parse_args(argv)
    args.sections = [x.strip() for x in args.sections.split(",") if x.strip()]
    unknown = sorted(set(args.sections) - set(SECTIONS))
    if unknown or not args.sections:
        p.error(f"--sections takes a comma-separated subset of {','.join(SECTIONS)}, got {unknown or 'nothing'}")
    if args.skip_e2e:
        args.sections = [x for x in args.sections if x not in ("e2e", "graphs")]
    try:
        args.graph_batches = [int(x) for x in args.graph_batches.split(",")] if args.graph_batches else None
    except ValueError:
        p.error(f"--graph-batches takes comma-separated integers, got {args.graph_batches!r}")
    if args.graph_batches is not None and (not args.graph_batches or min(args.graph_batches) < 1):
        p.error("--graph-batches sizes must be >= 1")
    return args


ARGS = parse_args()
if ARGS.dry_run:
    # before triton is imported anywhere: the kernels are wrapped for the interpreter at import
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["PAGEDMODEL_ATTENTION_BACKEND"] = "triton"

import torch  # noqa: E402

from pagedmodel.kernels import torch_attention  # noqa: E402
from pagedmodel.kernels import triton_attention  # noqa: E402
from pagedmodel.kernels.attention_metadata import AttentionMetadata  # noqa: E402


# ---------------------------------------------------------------------------------------------
# batches

@dataclass
class Batch:
    query: torch.Tensor
    kv_cache: torch.Tensor
    meta: AttentionMetadata


def make_batch(query_lens: list[int], seq_lens: list[int], *, block_size: int, q_heads: int, kv_heads: int,
               head_dim: int, dtype: torch.dtype, device: torch.device, seed: int = 0) -> Batch:
    """Random cache (block 0 and tails included, so stray reads show) with shuffled physical blocks."""
    rng = random.Random(seed)
    needed = [-(-s // block_size) for s in seq_lens]
    total = sum(needed) + 1
    order = list(range(1, total))
    rng.shuffle(order)
    tables, slots, at = [], [], 0
    for q_len, s_len, n in zip(query_lens, seq_lens, needed):
        table = order[at:at + n]
        at += n
        tables.append(table)
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(s_len - q_len, s_len))
    gen = torch.Generator(device=device).manual_seed(seed)
    cache = torch.randn(2, total, block_size, kv_heads, head_dim, generator=gen, device=device, dtype=dtype)
    query = torch.randn(sum(query_lens), q_heads, head_dim, generator=gen, device=device, dtype=dtype)
    return Batch(query, cache, AttentionMetadata.build(query_lens, seq_lens, tables, slots, device))


def decode_bytes(batch: Batch) -> int:
    """Least HBM traffic of one attention call: every context token's K and V once, q in, out back."""
    _, _, _, kv_heads, head_dim = batch.kv_cache.shape
    elem = batch.kv_cache.element_size()
    return (2 * sum(batch.meta.seq_lens_cpu) * kv_heads * head_dim + 2 * batch.query.numel()) * elem


# ---------------------------------------------------------------------------------------------
# timing

def time_ms(fn: Callable[[], Any], dry: bool) -> float:
    """Median milliseconds per call, host overhead included (L2 flushed between calls)."""
    if dry:  # the interpreter is ~1e5x slower; one call tells that the path runs, not its speed
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def graph_time_ms(fn: Callable[[], Any], calls: int, dry: bool) -> float:
    """Median device milliseconds per call: ``fn`` makes ``calls`` calls and is replayed as one
    CUDA graph, so host launch overhead is out of the figure."""
    if dry:
        return time_ms(fn, dry) / calls
    from triton.testing import do_bench_cudagraph

    return float(do_bench_cudagraph(fn, rep=100, return_mode="median")) / calls


# ---------------------------------------------------------------------------------------------
# 1. correctness

TOLERANCE = {  # native half-precision dots on GPUs (P is rounded before P@V); interpreter is tighter
    torch.float32: 1e-4,
    torch.float16: 4e-3,
    torch.bfloat16: 3e-2,
}


def correctness_cases(dry: bool) -> list[dict[str, Any]]:
    f16, bf16, f32 = torch.float16, torch.bfloat16, torch.float32
    if dry:
        mixed = dict(query_lens=[1, 4, 3, 0, 1], seq_lens=[9, 4, 12, 2, 1])
        return [
            dict(name="mixed gqa3 d64 bs16", **mixed, block_size=16, q_heads=3, kv_heads=1, head_dim=64, dtype=f32),
            dict(name="mixed gqa2 d96 bs8", **mixed, block_size=8, q_heads=4, kv_heads=2, head_dim=96, dtype=bf16),
            dict(name="mixed gqa1 d128 bs1", **mixed, block_size=1, q_heads=1, kv_heads=1, head_dim=128, dtype=f16),
            dict(name="decode split4 bs8", query_lens=[1, 1], seq_lens=[30, 5], block_size=8, q_heads=2,
                 kv_heads=1, head_dim=64, dtype=bf16, num_splits=4),
        ]
    decode = [1] * 24
    mixed_q = decode + [1, 300, 57, 512, 0]
    mixed_s = [random.Random(i).randint(1, 3000) for i in range(24)] + [1, 300, 1100, 2048, 77]
    cases = []
    for dtype in (bf16, f16, f32):
        for block_size in (16, 32):
            cases.append(dict(name=f"mixed gqa3 d64 bs{block_size}", query_lens=mixed_q, seq_lens=mixed_s,
                              block_size=block_size, q_heads=9, kv_heads=3, head_dim=64, dtype=dtype))
        cases.append(dict(name="mixed gqa4 d128 bs16", query_lens=mixed_q, seq_lens=mixed_s, block_size=16,
                          q_heads=32, kv_heads=8, head_dim=128, dtype=dtype))
    cases += [
        dict(name="mixed gqa1 d96 bs8", query_lens=mixed_q, seq_lens=mixed_s, block_size=8, q_heads=12,
             kv_heads=12, head_dim=96, dtype=bf16),
        dict(name="mixed gqa8 d128 bs128", query_lens=mixed_q, seq_lens=mixed_s, block_size=128, q_heads=64,
             kv_heads=8, head_dim=128, dtype=bf16),
        dict(name="mixed gqa2 d64 bs1", query_lens=[1, 1, 33, 7], seq_lens=[1, 200, 33, 90], block_size=1,
             q_heads=4, kv_heads=2, head_dim=64, dtype=bf16),
        dict(name="decode 16k split heuristic", query_lens=[1, 1], seq_lens=[16384, 9000], block_size=16,
             q_heads=32, kv_heads=8, head_dim=128, dtype=bf16),
        dict(name="decode 4k split8", query_lens=[1] * 4, seq_lens=[4096, 4000, 17, 1], block_size=16,
             q_heads=9, kv_heads=3, head_dim=64, dtype=bf16, num_splits=8),
    ]
    return cases


def run_correctness(device: torch.device, dry: bool) -> list[dict[str, Any]]:
    rows = []
    for case in correctness_cases(dry):
        case = dict(case)
        name, dtype, splits = case.pop("name"), case["dtype"], case.pop("num_splits", None)
        row: dict[str, Any] = {"name": name, "kernel": "paged_attention", "dtype": str(dtype).removeprefix("torch.")}
        try:
            b = make_batch(**case, device=device)
            scale = case["head_dim"] ** -0.5
            out = triton_attention.paged_attention(b.query, b.kv_cache, b.meta, scale, num_splits=splits)
            ref = torch_attention.paged_attention(b.query.float(), b.kv_cache.float(), b.meta, scale)
            err = float((out.float() - ref).abs().max()) if out.numel() else 0.0
            row.update(max_abs_err=err, tolerance=TOLERANCE[dtype], ok=err <= TOLERANCE[dtype])
        except Exception as exc:  # one broken case must not hide the others
            row.update(ok=False, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
        rows.append(row)
    rows += _check_cache_ops(device, dry)
    return rows


def _check_cache_ops(device: torch.device, dry: bool) -> list[dict[str, Any]]:
    rows = []
    num_blocks, block_size, heads, dim = (6, 8, 2, 64) if dry else (512, 16, 8, 128)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        name = str(dtype).removeprefix("torch.")
        try:
            caches = [torch.randn(2, num_blocks, block_size, heads, dim, device=device).to(dtype) for _ in range(2)]
            tokens = num_blocks * block_size // 2
            slots = torch.randperm(num_blocks * block_size, device=device)[:tokens]
            slots[::7] = -1
            k = torch.randn(tokens, heads, dim, device=device).to(dtype)
            v = torch.randn(tokens, heads, dim, device=device).to(dtype)
            ref = [c.clone() for c in caches]
            triton_attention.write_kv(k, v, caches[0], slots)
            torch_attention.write_kv(k, v, ref[0], slots)
            rows.append({"name": f"write_kv {name}", "kernel": "write_kv", "dtype": name,
                         "ok": bool(torch.equal(caches[0], ref[0]))})
            half = num_blocks // 2
            pairs = torch.stack([torch.arange(half), torch.arange(half, 2 * half)], 1).to(device)
            triton_attention.copy_blocks(caches, pairs)
            torch_attention.copy_blocks(ref, pairs)
            rows.append({"name": f"copy_blocks {name}", "kernel": "copy_blocks", "dtype": name,
                         "ok": all(torch.equal(a, b) for a, b in zip(caches, ref))})
        except Exception as exc:
            rows.append({"name": f"cache ops {name}", "kernel": "write_kv/copy_blocks", "dtype": name, "ok": False,
                         "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
    return rows


# ---------------------------------------------------------------------------------------------
# 2. decode bandwidth

LAYOUTS = {"smollm2-135m (9q/3kv x 64)": (9, 3, 64), "8b-class (32q/8kv x 128)": (32, 8, 128)}
# A graph replay does not flush L2 (50 MB on an H100/H200): small working sets are cycled over
# this many bytes of distinct caches, so the bandwidth figure is HBM's, not L2's.
L2_DEFEAT_BYTES = 128 << 20


def run_bandwidth(device: torch.device, dry: bool, peak_gbps: float) -> list[dict[str, Any]]:
    from pagedmodel.kernels.triton_paged_attention import plan_launch

    batches, contexts = ((1, 2), (16, 40)) if dry else ((1, 32, 256), (512, 4096))
    layouts = {"tiny (2q/1kv x 64)": (2, 1, 64)} if dry else LAYOUTS
    dtype = torch.float32 if dry else torch.bfloat16
    rows = []
    for layout, (q_heads, kv_heads, head_dim) in layouts.items():
        scale = head_dim ** -0.5
        for batch_size in batches:
            for ctx in contexts:
                row: dict[str, Any] = {"layout": layout, "batch": batch_size, "context": ctx}
                try:
                    shape = dict(block_size=16, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                                 dtype=dtype, device=device)
                    first = make_batch([1] * batch_size, [ctx] * batch_size, seed=0, **shape)
                    nbytes = decode_bytes(first)
                    copies = 1 if dry else max(1, min(256, -(-L2_DEFEAT_BYTES // nbytes)))
                    batches_ = [first] + [make_batch([1] * batch_size, [ctx] * batch_size, seed=i, **shape)
                                          for i in range(1, copies)]

                    def all_copies() -> None:
                        for b in batches_:
                            triton_attention.paged_attention(b.query, b.kv_cache, b.meta, scale)

                    kernel_ms = graph_time_ms(all_copies, copies, dry)
                    call_ms = time_ms(lambda: triton_attention.paged_attention(
                        first.query, first.kv_cache, first.meta, scale), dry)
                    torch_ms = time_ms(lambda: torch_attention.paged_attention(
                        first.query, first.kv_cache, first.meta, scale), dry)
                    gbps = nbytes / (kernel_ms * 1e-3) / 1e9
                    row.update(
                        bytes=nbytes, l2_copies=copies, kernel_us=kernel_ms * 1e3, call_us=call_ms * 1e3,
                        torch_us=torch_ms * 1e3, gbps=gbps, peak_pct=100.0 * gbps / peak_gbps,
                        speedup_vs_torch=torch_ms / call_ms,
                        num_splits=plan_launch(first.query, first.kv_cache, first.meta).num_splits,
                    )
                    del first, batches_
                except Exception as exc:
                    row.update(error=f"{type(exc).__name__}: {exc}")
                rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------
# 3. end to end

PROMPT_STEMS = [
    "The capital of France is", "Write a haiku about the sea.", "Explain what a KV cache is.",
    "List three prime numbers:", "Once upon a time", "The quick brown fox", "def fibonacci(n):",
    "Translate to French: good morning", "What is 17 times 23?", "Summarize the plot of Hamlet.",
]


def run_e2e(device: torch.device, dry: bool, model: str | None, num_prompts: int | None,
            max_tokens: int | None) -> dict[str, Any]:
    from pagedmodel import LLM, SamplingParams
    model, skipped = _resolve_model(model, dry)
    if skipped:
        return {"skipped": skipped}
    num_prompts = num_prompts or (2 if dry else 64)
    max_tokens = max_tokens or (3 if dry else 128)
    prompts = [f"{PROMPT_STEMS[i % len(PROMPT_STEMS)]} ({i})" for i in range(num_prompts)]
    dtype = torch.float32 if dry else torch.bfloat16
    result: dict[str, Any] = {"model": model, "prompts": num_prompts, "max_tokens": max_tokens,
                              "dtype": str(dtype).removeprefix("torch.")}
    hf_tokens = None
    try:
        hf_tokens, result["hf_tokens_per_s"] = _hf_generate(model, prompts, max_tokens, dtype, device)
    except Exception as exc:
        result["hf_error"] = f"{type(exc).__name__}: {exc}"
    try:
        engine_args = dict(model=model, device=device.type, dtype=str(dtype).removeprefix("torch."),
                           **({"kv_cache_memory": 64 << 20} if dry else {}))
        try:
            llm = LLM(**engine_args)
        except Exception as exc:
            # the engine captures decode graphs at start-up by default: should that fail on this
            # device, still measure the engine (eagerly) against HF, and say why (section 4 retries)
            result["graph_capture_error"] = f"{type(exc).__name__}: {exc}"
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            llm = LLM(**engine_args, enforce_eager=True)
        result["backend"] = llm.engine.backend.name
        graphs = llm.engine.runner.graph_runner
        result["decode_graphs"] = graphs.graphs.name if graphs is not None else "none (eager)"
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))  # warm up/compile
        _sync(device)
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        _sync(device)
        elapsed = time.perf_counter() - start
        generated = sum(len(o.outputs[0].token_ids) for o in outs)
        result.update(engine_tokens_per_s=generated / elapsed, engine_seconds=elapsed, generated_tokens=generated)
        if hf_tokens is not None:
            engine_tokens = [list(o.outputs[0].token_ids) for o in outs]
            prefix = [_common_prefix(a, b) for a, b in zip(engine_tokens, hf_tokens)]
            result["greedy_agreement"] = {
                "identical": sum(p == max_tokens for p in prefix),
                "mean_common_prefix": statistics.fmean(prefix),
                "of": len(prefix),
            }
        if "hf_tokens_per_s" in result:
            result["speedup_vs_hf"] = result["engine_tokens_per_s"] / result["hf_tokens_per_s"]
        del llm
        gc.collect()   # later sections size their engines' KV caches from the free memory
        if device.type == "cuda":
            torch.cuda.empty_cache()
    except Exception as exc:
        result["engine_error"] = f"{type(exc).__name__}: {exc}"
        result["engine_traceback"] = traceback.format_exc()
    return result


def _resolve_model(model: str | None, dry: bool) -> tuple[str | None, str | None]:
    """(model dir, None) or (None, why the engine sections are skipped)."""
    if model is not None:
        return model, None
    if dry:
        return None, "dry run without --model (pass a tiny model dir)"
    try:
        from pagedmodel.server.engine.model_store import resolve_model

        return str(resolve_model(None)), None
    except Exception as exc:
        return None, f"no model: {type(exc).__name__}: {exc}"


def _hf_generate(model: str, prompts: list[str], max_tokens: int, dtype: torch.dtype,
                 device: torch.device) -> tuple[list[list[int]], float]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model, padding_side="left")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(device).eval()
    enc = tok(prompts, return_tensors="pt", padding=True).to(device)
    kwargs = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                  pad_token_id=tok.pad_token_id)
    with torch.inference_mode():
        hf.generate(**tok(prompts[:2], return_tensors="pt", padding=True).to(device), **{**kwargs,
                    "max_new_tokens": 2, "min_new_tokens": 2})  # warm up
        _sync(device)
        start = time.perf_counter()
        out = hf.generate(**enc, **kwargs)
        _sync(device)
        elapsed = time.perf_counter() - start
    new = out[:, enc["input_ids"].shape[1]:].tolist()
    del hf
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return new, sum(len(t) for t in new) / elapsed


# ---------------------------------------------------------------------------------------------
# 4. CUDA graphs vs eager

def run_graphs(device: torch.device, dry: bool, model: str | None, batches: list[int] | None) -> dict[str, Any]:
    """Engine tokens/s at fixed decode batch sizes, decode replayed from CUDA graphs vs eager.

    Each batch is ``b`` prompts generating ``max_tokens`` tokens each (greedy, ``ignore_eos``), so
    all but the first step are decode steps of ``b`` rows. One engine per mode serves every batch
    size; the graph engine captures its ladder (up to the largest batch) at start-up. In a dry run
    the graphs are the CPU stand-in (``PAGEDMODEL_CUDA_GRAPHS=emulate``): it proves the path runs,
    not that it is fast."""
    from pagedmodel import LLM, SamplingParams
    from pagedmodel.server.engine.cuda_graph_runner import GRAPHS_ENV
    model, skipped = _resolve_model(model, dry)
    if skipped:
        return {"skipped": skipped}
    batches = batches or ([1, 3] if dry else [1, 8, 32, 128])
    max_tokens = 3 if dry else 128
    dtype = torch.float32 if dry else torch.bfloat16
    result: dict[str, Any] = {"model": model, "dtype": str(dtype).removeprefix("torch."), "max_tokens": max_tokens,
                              "batches": batches}
    tokens: dict[str, dict[int, list[list[int]]]] = {}
    speed: dict[str, dict[int, float]] = {}
    saved_env = os.environ.get(GRAPHS_ENV)
    for mode in ("eager", "graphs"):
        try:
            if dry and mode == "graphs":
                os.environ[GRAPHS_ENV] = "emulate"   # no CUDA: replay through the CPU stand-in
            # dry: at least a 1, 2, 4 ladder, so the 3-row batch runs padded to 4
            llm = LLM(model=model, device=device.type, dtype=str(dtype).removeprefix("torch."),
                      enforce_eager=(mode == "eager"), max_num_seqs=max(max(batches), 4) if dry else max(batches),
                      **({"kv_cache_memory": 64 << 20} if dry else {}))
            runner = llm.engine.runner.graph_runner
            if mode == "graphs":
                if runner is None:
                    raise RuntimeError("the engine captured no decode graphs")
                result.update(graph_backend=runner.graphs.name, graph_sizes=runner.sizes,
                              capture_seconds=runner.stats.capture_seconds,
                              capture_mib=None if runner.stats.capture_bytes is None
                              else runner.stats.capture_bytes / 2**20)
            llm.generate(PROMPT_STEMS[:2], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))  # warm up
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            tokens[mode], speed[mode] = _time_batches(llm, params, device, batches)
            if mode == "graphs":
                result["graph_replays"] = sum(runner.stats.replays.values())
                result["graph_replays_by_size"] = {str(k): v for k, v in sorted(runner.stats.replays.items())}
                result["eager_fallback_steps"] = dict(runner.stats.eager_steps)
            del llm, runner
            gc.collect()   # the next engine sizes its KV cache from free memory: this one must be gone
            if device.type == "cuda":
                torch.cuda.empty_cache()
        except Exception as exc:
            result[f"{mode}_error"] = f"{type(exc).__name__}: {exc}"
            result[f"{mode}_traceback"] = traceback.format_exc()
        finally:
            if saved_env is None:
                os.environ.pop(GRAPHS_ENV, None)
            else:
                os.environ[GRAPHS_ENV] = saved_env
    result["rows"] = _graph_rows(batches, tokens, speed)
    return result


def _time_batches(llm: Any, params: Any, device: torch.device,
                  batches: list[int]) -> tuple[dict[int, list[list[int]]], dict[int, float]]:
    """Per batch size: every prompt's generated tokens, and the batch's tokens/s."""
    tokens: dict[int, list[list[int]]] = {}
    speed: dict[int, float] = {}
    for b in batches:
        prompts = [f"{PROMPT_STEMS[i % len(PROMPT_STEMS)]} ({i})" for i in range(b)]
        _sync(device)
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        _sync(device)
        elapsed = time.perf_counter() - start
        tokens[b] = [list(o.outputs[0].token_ids) for o in outs]
        speed[b] = sum(len(t) for t in tokens[b]) / elapsed
    return tokens, speed


def _graph_rows(batches: list[int], tokens: dict[str, dict[int, list[list[int]]]],
                speed: dict[str, dict[int, float]]) -> list[dict[str, Any]]:
    """One row per batch size: each mode's tokens/s, and the speed-up and agreement when both ran."""
    rows = []
    for b in batches:
        row: dict[str, Any] = {"batch": b}
        for mode in ("eager", "graphs"):
            if b in speed.get(mode, {}):
                row[f"{mode}_tokens_per_s"] = speed[mode][b]
        if "eager_tokens_per_s" in row and "graphs_tokens_per_s" in row:
            row["speedup"] = row["graphs_tokens_per_s"] / row["eager_tokens_per_s"]
            row["identical"] = sum(a == g for a, g in zip(tokens["eager"][b], tokens["graphs"][b]))
            row["of"] = b
        rows.append(row)
    return rows


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# ---------------------------------------------------------------------------------------------
# report

def print_report(results: dict[str, Any]) -> None:
    print(f"\n== {results['device']}  torch {results['torch']}  triton {results['triton']}"
          f"{'  (DRY RUN: interpreter, tiny shapes; numbers are not performance)' if results['dry_run'] else ''}")
    print("\n-- correctness vs torch")
    if results["correctness"] is None:
        print("  skipped (not in --sections)")
    for r in results["correctness"] or []:
        detail = f"max|err| {r['max_abs_err']:.2e} (tol {r['tolerance']:.0e})" if "max_abs_err" in r else "exact"
        print(f"  {'PASS' if r['ok'] else 'FAIL'}  {r['name']:<34} {r.get('dtype', ''):<9} "
              f"{r.get('error', detail)}")
    print(f"\n-- decode attention bandwidth ({results['bandwidth_dtype']}, 16-token blocks, shuffled)")
    if results["decode_bandwidth"] is None:
        print("  skipped (not in --sections)")
    else:
        print("  kernel us: device time per call (CUDA-graph replay, L2 defeated); GB/s and % peak from it.")
        print("  call us: one eager call incl. host work (cold L2); vs torch compares eager calls.")
        print(f"  {'layout':<28} {'batch':>5} {'ctx':>6} {'splits':>6} {'kernel us':>10} {'call us':>9} "
              f"{'torch us':>10} {'GB/s':>8} {'% peak':>7} {'vs torch':>8}")
    for r in results["decode_bandwidth"] or []:
        if "error" in r:
            print(f"  {r['layout']:<28} {r['batch']:>5} {r['context']:>6}  ERROR {r['error']}")
            continue
        print(f"  {r['layout']:<28} {r['batch']:>5} {r['context']:>6} {r['num_splits']:>6} {r['kernel_us']:>10.1f} "
              f"{r['call_us']:>9.1f} {r['torch_us']:>10.1f} {r['gbps']:>8.1f} {r['peak_pct']:>6.1f}% "
              f"{r['speedup_vs_torch']:>7.2f}x")
    e2e = results["e2e"]
    print("\n-- end to end")
    if "skipped" in e2e:
        print(f"  skipped: {e2e['skipped']}")
    else:
        for key in ("model", "dtype", "backend", "decode_graphs", "prompts", "max_tokens", "engine_tokens_per_s",
                    "hf_tokens_per_s", "speedup_vs_hf", "greedy_agreement", "graph_capture_error", "engine_error",
                    "hf_error"):
            if key in e2e:
                value = e2e[key]
                print(f"  {key:<22} {value:.1f}" if isinstance(value, float) else f"  {key:<22} {value}")
    _print_graphs(results["graphs"])


def _graph_row_cells(r: dict[str, Any]) -> tuple[str, str, str, str]:
    """eager tok/s, graphs tok/s, speedup, identical outputs: '-' where that run failed."""
    eager, graph = r.get("eager_tokens_per_s"), r.get("graphs_tokens_per_s")
    return ("-" if eager is None else f"{eager:.1f}", "-" if graph is None else f"{graph:.1f}",
            f"{r['speedup']:.2f}x" if "speedup" in r else "-", f"{r['identical']}/{r['of']}" if "of" in r else "-")


def _print_graphs(graphs: dict[str, Any]) -> None:
    print("\n-- CUDA graphs vs eager (engine tokens/s, decode batches)")
    if "skipped" in graphs:
        print(f"  skipped: {graphs['skipped']}")
        return
    for key in ("graph_backend", "graph_sizes", "capture_seconds", "capture_mib", "graph_replays",
                "eager_fallback_steps", "eager_error", "graphs_error"):
        if key in graphs:
            value = graphs[key]
            print(f"  {key:<22} {value:.2f}" if isinstance(value, float) else f"  {key:<22} {value}")
    print(f"  {'batch':>5} {'eager tok/s':>12} {'graphs tok/s':>13} {'speedup':>8} {'identical':>10}")
    for r in graphs.get("rows", []):
        eager, graph, speedup, identical = _graph_row_cells(r)
        print(f"  {r['batch']:>5} {eager:>12} {graph:>13} {speedup:>8} {identical:>10}")


def _markdown_graphs(graphs: dict[str, Any]) -> list[str]:
    if "skipped" in graphs:
        return [f"CUDA graphs: skipped ({graphs['skipped']})."]
    errors = [f"{mode}: {graphs[mode + '_error']}" for mode in ("eager", "graphs") if mode + "_error" in graphs]
    capture = ""
    if "capture_seconds" in graphs:
        sizes = graphs["graph_sizes"]
        memory = "" if graphs.get("capture_mib") is None else f", {graphs['capture_mib']:.0f} MiB"
        capture = (f" {graphs['graph_backend']} graphs for decode batches {sizes[0]}..{sizes[-1]} "
                   f"({len(sizes)} sizes) captured in {graphs['capture_seconds']:.1f} s{memory}.")
    lines = [f"CUDA graphs vs eager ({graphs['dtype']}, {graphs['max_tokens']} tokens per prompt, greedy):{capture}"
             + (f" Errors: {'; '.join(errors)}." if errors else ""), "",
             "| decode batch | eager tok/s | graphs tok/s | speedup | identical outputs |",
             "|---:|---:|---:|---:|---:|"]
    for r in graphs.get("rows", []):
        lines.append("| {} | {} | {} | {} | {} |".format(r["batch"], *_graph_row_cells(r)))
    return lines


def markdown_report(results: dict[str, Any]) -> str:
    """The tables as Markdown, headed by date and device, ready for docs/benchmarks.md."""
    lines = [f"### GPU kernels: {results['device']}, {results['date']}", "",
             f"torch {results['torch']}, triton {results['triton']}"
             + (" (DRY RUN on CPU: not performance)" if results["dry_run"] else ""), ""]
    correctness = results["correctness"]
    if correctness is None:
        lines += ["Correctness vs the torch path: skipped.", ""]
    else:
        failed = [r["name"] for r in correctness if not r["ok"]]
        lines += [f"Correctness vs the torch path: {len(correctness) - len(failed)}/{len(correctness)} cases pass"
                  + (f"; FAILED: {', '.join(failed)}" if failed else "."), ""]
    if results["decode_bandwidth"] is None:
        lines.append("Decode attention bandwidth: skipped.")
    else:
        lines += [f"Decode attention, {results['bandwidth_dtype']}, 16-token blocks (kernel us: CUDA-graph replay, "
                  "L2 defeated; GB/s from it; call us: eager incl. host):", "",
                  "| layout | batch | context | splits | kernel us | call us | torch us | GB/s | % peak | vs torch |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results["decode_bandwidth"] or []:
        if "error" in r:
            lines.append(f"| {r['layout']} | {r['batch']} | {r['context']} | error: {r['error']} ||||||")
        else:
            lines.append(f"| {r['layout']} | {r['batch']} | {r['context']} | {r['num_splits']} | {r['kernel_us']:.1f} "
                         f"| {r['call_us']:.1f} | {r['torch_us']:.1f} | {r['gbps']:.0f} | {r['peak_pct']:.1f} % "
                         f"| {r['speedup_vs_torch']:.2f}x |")
    e2e = results["e2e"]
    lines.append("")
    if "skipped" in e2e:
        lines.append(f"End to end: skipped ({e2e['skipped']}).")
    elif "engine_tokens_per_s" in e2e:
        hf = e2e.get("hf_tokens_per_s")
        agree = e2e.get("greedy_agreement", {})
        lines.append(f"End to end ({e2e['dtype']}, {e2e['prompts']} prompts x {e2e['max_tokens']} tokens, greedy, "
                     f"decode graphs: {e2e.get('decode_graphs', '?')}"
                     + (f" after a capture error: {e2e['graph_capture_error']}" if "graph_capture_error" in e2e else "")
                     + "): "
                     f"engine {e2e['engine_tokens_per_s']:.0f} tok/s"
                     + (f", HF generate {hf:.0f} tok/s ({e2e['speedup_vs_hf']:.2f}x)" if hf else "")
                     + (f"; identical greedy outputs {agree['identical']}/{agree['of']}" if agree else "") + ".")
    else:
        lines.append(f"End to end: failed ({e2e.get('engine_error')}).")
    lines.append("")
    lines += _markdown_graphs(results["graphs"])
    return "\n".join(lines) + "\n"


def main() -> int:
    dry = ARGS.dry_run
    if not dry and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run for the CPU interpreter check", file=sys.stderr)
        return 2
    device = torch.device("cpu" if dry else "cuda")
    import triton

    started = time.perf_counter()
    results: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": "cpu (Triton interpreter)" if dry else torch.cuda.get_device_name(device),
        "host": platform.node(), "torch": torch.__version__, "triton": triton.__version__,
        "dry_run": dry, "peak_gbps": ARGS.peak_gbps,
        "bandwidth_dtype": "float32" if dry else "bfloat16",
    }
    sections = ARGS.sections
    skipped = {"skipped": "--skip-e2e" if ARGS.skip_e2e else "not in --sections"}
    results["sections"] = sections
    results["correctness"] = run_correctness(device, dry) if "correctness" in sections else None
    results["decode_bandwidth"] = run_bandwidth(device, dry, ARGS.peak_gbps) if "bandwidth" in sections else None
    results["e2e"] = (run_e2e(device, dry, ARGS.model, ARGS.e2e_prompts, ARGS.e2e_max_tokens)
                      if "e2e" in sections else dict(skipped))
    results["graphs"] = (run_graphs(device, dry, ARGS.model, ARGS.graph_batches)
                         if "graphs" in sections else dict(skipped))
    results["seconds"] = time.perf_counter() - started
    print_report(results)
    Path(ARGS.out).write_text(json.dumps(results, indent=2) + "\n")
    markdown = Path(ARGS.out).with_suffix(".md")
    markdown.write_text(markdown_report(results))
    print(f"\nwrote {ARGS.out} and {markdown} ({results['seconds']:.0f} s)")
    return 0 if all(r["ok"] for r in results["correctness"] or []) else 1


if __name__ == "__main__":
    sys.exit(main())
