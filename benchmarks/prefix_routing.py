"""Prefix-cache hit rate and time to first token through the router, per routing strategy.

    python benchmarks/prefix_routing.py [--model DIR|smollm2] [--requests 64] [--warmup 12] [--rate 0.25] [--skew 1.0]
                                        [--kv-fraction 0.4] [--strategies prefix,prefix-cache,least-load,round-robin]
    python benchmarks/prefix_routing.py --quick      # a small smoke run (tests/router/test_prefix_routing_bench.py)

Workload (prefix_workload.py, all from --seed): 16 tenants, each with its own system prompt of 1-2k
tokens; a request is one tenant's system prompt plus a short user turn; tenants are Zipf-skewed
(--skew, a few hot tenants and a long tail); Poisson arrivals at --rate. Every strategy replays the
same requests at the same offsets against 3 fresh engines (prefix caching on, each engine's KV cache
holding --kv-fraction of all system prompts' tokens, so no engine can hold every prompt and the
routing decides what is cached where) behind a fresh `pagedmodel router --strategy S`.

Warm-up: the first --warmup requests of the schedule run first and are drained; then the engines'
counters are read and the measured requests start. Both phases are the same for every strategy; the
warm-up only keeps the compulsory first-touch misses of an empty cluster out of the comparison.

Reported for the measured requests: the engines' own prefix-cache hit rate (the
vllm:prefix_cache_hits / vllm:prefix_cache_queries deltas, in prompt tokens, summed over the 3
engines) and TTFT mean / p50 / p99, client-side through the router with streaming (request sent to
the first chunk carrying generated text; the role-only opening chunk does not count).

Without --model the engines serve a random Llama of 4 layers x 256 hidden with the SmolLM2
tokenizer and chat template: routing and caching see real prompts (a random model only changes
the generated words, not what is cached), while prefill stays cheap enough for 3 engines x 4
strategies on 2 shared cores (SmolLM2-135M, 30 layers x 576, is some 30x the compute per token).
A benchmark, not a test: it prints a table and, with --json, the raw numbers.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from kv_event_trace import KVEventTrace, first_blocks  # noqa: E402
from prefix_workload import Request, requests, system_prompts, tenant_weights  # noqa: E402
from support import free_port, stop_process, wait_healthy  # noqa: E402  (shared with the tests)

STRATEGIES = ("prefix", "prefix-cache", "least-load", "round-robin")   # the run's order: the pair compared first
MODEL_NAME = "bench"
BLOCK_SIZE = 16
RANDOM_LLAMA = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)
QUICK = dict(prompts=4, min_prompt_tokens=150, max_prompt_tokens=250, requests=12, warmup=4, rate=4.0,
             engines=2, kv_fraction=0.8, strategies="prefix-cache", max_tokens=2)


def build_model(out: Path, quick: bool) -> Path:
    from tiny_models import make_tiny_model_dir
    return make_tiny_model_dir(out, "llama", **({} if quick else RANDOM_LLAMA))


def start(args: list[str], log: Path, threads: int = 1) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(threads))
    with open(log, "ab") as f:
        return subprocess.Popen([sys.executable, "-m", "pagedmodel.cli", *args], stdout=f, stderr=subprocess.STDOUT,
                                env=env)


def prefix_counters(text: str) -> tuple[float, float]:
    """(hits, queries) in prompt tokens from one engine's /metrics text."""
    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.M))
    return total("vllm:prefix_cache_hits_total"), total("vllm:prefix_cache_queries_total")


def first_text(payload: bytes) -> bool:
    """Whether one SSE data payload carries generated output (text or a finish)."""
    chunk = json.loads(payload)
    return any((c.get("delta") or {}).get("content") or c.get("finish_reason") for c in chunk.get("choices", ()))


async def one_request(session: aiohttp.ClientSession, url: str, system: str, user: str, max_tokens: int) -> float:
    """Seconds from sending the request to the first chunk with generated output."""
    body = {"model": MODEL_NAME, "stream": True, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}
    t0 = time.perf_counter()
    ttft = None
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
        async for line in resp.content:
            payload = line.strip()[len(b"data: "):] if line.startswith(b"data: ") else b""
            if ttft is None and payload and payload != b"[DONE]" and first_text(payload):
                ttft = time.perf_counter() - t0
    if ttft is None:
        raise RuntimeError("the stream ended without generated output")
    return ttft


async def replay(session: aiohttp.ClientSession, router_url: str, prompts: list[str], load: list[Request],
                 max_tokens: int) -> list[float]:
    """Send each request at its offset from now; returns their TTFTs in schedule order."""
    t0 = time.perf_counter()

    async def at(r: Request) -> float:
        await asyncio.sleep(max(0.0, r.at - (time.perf_counter() - t0)))
        return await one_request(session, router_url, prompts[r.tenant], r.user, max_tokens)
    return list(await asyncio.gather(*(at(r) for r in load)))


async def drive(router_url: str, engine_urls: list[str], prompts: list[str], warmup: list[Request],
                measured: list[Request], max_tokens: int, trace: KVEventTrace) -> dict[str, Any]:
    # One connection per request: a pooled keep-alive connection can be reused just as the server's
    # keep-alive timeout (5 s) closes it, a reset that Poisson gaps of seconds would hit sooner or later.
    connector = aiohttp.TCPConnector(force_close=True, limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=900)) as session:
        async def counters() -> list[tuple[float, float]]:
            await asyncio.sleep(1.5)   # the engines publish their stats to /metrics about once a second
            hq = []
            for u in engine_urls:
                async with session.get(u + "/metrics") as resp:
                    hq.append(prefix_counters(await resp.text()))
            return hq
        await replay(session, router_url, prompts, warmup, max_tokens)
        before = await counters()
        trace.start(session, engine_urls)
        t0 = time.perf_counter()
        ttfts = await replay(session, router_url, prompts, measured, max_tokens)
        wall = time.perf_counter() - t0
        after = await counters()
        placement = await trace.stop()
    per_engine = [(h1 - h0, q1 - q0) for (h0, q0), (h1, q1) in zip(before, after)]
    h0, q0 = sum(h for h, _ in before), sum(q for _, q in before)
    h1, q1 = sum(h for h, _ in after), sum(q for _, q in after)
    if q1 <= q0:
        raise RuntimeError("the engines counted no prefix-cache queries: is --enable-prefix-caching on?")
    ordered = sorted(ttfts)
    return {"hit_rate": (h1 - h0) / (q1 - q0), "ttft_mean": statistics.fmean(ttfts),
            "ttft_p50": statistics.median(ttfts), "ttft_p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
            "wall_s": wall, "requests": len(ttfts), "hit_tokens": h1 - h0, "query_tokens": q1 - q0,
            "per_engine_hit_query_tokens": per_engine, "placement": placement,
            "ttfts": ttfts, "tenants": [r.tenant for r in measured]}   # per request, in schedule order (--json)


def run_strategy(strategy: str, model: Path, args: argparse.Namespace, prompts: list[str],
                 warmup: list[Request], measured: list[Request], logs: Path,
                 tenants_by_block: dict[bytes, int]) -> dict[str, Any]:
    ports = args.engine_ports
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    engines = [start(["serve", "--model", str(model), "--device", "cpu", "--host", "127.0.0.1", "--port", str(p),
                      "--max-model-len", str(args.max_model_len), "--kv-cache-memory", str(args.kv_bytes),
                      "--enable-prefix-caching", "--block-size", str(BLOCK_SIZE), "--served-model-name", MODEL_NAME,
                      "--dtype", args.dtype], logs / f"{strategy}-engine{i}.log", args.threads)
               for i, p in enumerate(ports)]
    router = None
    try:
        for i, (url, proc) in enumerate(zip(urls, engines)):
            wait_healthy(url, proc, 600, logs / f"{strategy}-engine{i}.log")
        rport = free_port()
        router_url = f"http://127.0.0.1:{rport}"
        extra = ["--tokenizer", str(model)] if strategy == "prefix-cache" else []
        router = start(["router", *[a for u in urls for a in ("--upstream", u)], "--host", "127.0.0.1",
                        "--port", str(rport), "--strategy", strategy, "--max-queue-len", "1024",
                        "--queue-timeout", "600", "--log-level", args.router_log_level, *extra],
                       logs / f"{strategy}-router.log")
        wait_healthy(router_url, router, 120, logs / f"{strategy}-router.log")
        time.sleep(1.0)   # KV-event subscriptions open and the first metrics scrape lands
        return asyncio.run(drive(router_url, urls, prompts, warmup, measured, args.max_tokens,
                                 KVEventTrace(tenants_by_block)))
    finally:
        if router is not None:
            stop_process(router)
        for proc in engines:
            stop_process(proc)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model dir or name (default: a random 4x256 Llama)")
    ap.add_argument("--quick", action="store_true", help="a small smoke run: " + ", ".join(f"{k}={v}" for k, v in QUICK.items()))
    ap.add_argument("--requests", type=int, default=64, help="measured requests")
    ap.add_argument("--warmup", type=int, default=12, help="requests run and drained before measuring")
    ap.add_argument("--rate", type=float, default=0.25, help="arrivals per second (Poisson)")
    ap.add_argument("--prompts", type=int, default=16, help="tenants, one system prompt each")
    ap.add_argument("--min-prompt-tokens", type=int, default=1000)
    ap.add_argument("--max-prompt-tokens", type=int, default=2000)
    ap.add_argument("--skew", type=float, default=1.0, help="Zipf exponent of tenant popularity (0: uniform)")
    ap.add_argument("--engines", type=int, default=3)
    ap.add_argument("--kv-fraction", type=float, default=0.4,
                    help="each engine's KV cache as a fraction of all system prompts' tokens")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1, help="OMP threads per engine")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1,
                    help="run every strategy this many times, interleaved (s1 s2 .. s1 s2 ..); the summary pools "
                         "each strategy's requests over its runs")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--logs", type=Path, default=None, help="keep the engine and router logs here (default: a temp dir)")
    ap.add_argument("--router-log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = ap.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    bad = [s for s in args.strategies.split(",") if s not in STRATEGIES]
    if bad:
        ap.error(f"unknown strategies {bad}; choose from {', '.join(STRATEGIES)}")
    if not 0 < args.kv_fraction <= 1 or args.requests < 1 or args.warmup < 0 or args.engines < 1 or args.repeats < 1:
        ap.error("need 0 < --kv-fraction <= 1, --requests >= 1, --warmup >= 0, --engines >= 1, --repeats >= 1")
    return args


def kv_bytes_per_token(model: Path, dtype: str) -> int:
    from transformers import AutoConfig
    cfg = AutoConfig.from_pretrained(model)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * (4 if dtype == "float32" else 2)


def resolve(args: argparse.Namespace, work: Path) -> Path:
    if args.model is None:
        return build_model(work / "model", args.quick)
    if Path(args.model).is_dir():
        return Path(args.model)
    from pagedmodel.server.engine.model_store import resolve_model
    return Path(resolve_model(args.model))


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole benchmark: the workload, then each strategy on fresh engines; returns the results."""
    from transformers import AutoTokenizer
    work = args.logs or Path(tempfile.mkdtemp(prefix="prefix_routing_"))
    work.mkdir(parents=True, exist_ok=True)
    model = resolve(args, work)
    tok = AutoTokenizer.from_pretrained(model)
    rng = random.Random(args.seed)
    count = lambda text: len(tok(text, add_special_tokens=False).input_ids)   # noqa: E731
    prompts = system_prompts(count, args.prompts, args.min_prompt_tokens, args.max_prompt_tokens, rng)
    weights = tenant_weights(len(prompts), args.skew, rng)
    schedule = requests(args.warmup + args.requests, args.rate, weights, rng)
    warmup, measured = schedule[:args.warmup], schedule[args.warmup:]
    offset = measured[0].at
    measured = [Request(r.at - offset, r.tenant, r.user) for r in measured]
    lengths = [count(p) for p in prompts]
    kv_tokens = int(args.kv_fraction * sum(lengths)) // BLOCK_SIZE * BLOCK_SIZE
    args.kv_bytes = kv_tokens * kv_bytes_per_token(model, args.dtype)
    args.max_model_len = args.max_prompt_tokens + 256
    hot = sorted(weights, reverse=True)
    tenants_by_block = first_blocks(tok, prompts, MODEL_NAME, BLOCK_SIZE)
    print(f"model {model} ({args.model or ('random 2x64 llama' if args.quick else 'random 4x256 llama')}), {args.engines} engines x {kv_tokens} KV tokens "
          f"({args.kv_fraction:.0%} of the {sum(lengths)} system-prompt tokens), {len(prompts)} system prompts of "
          f"{min(lengths)}-{max(lengths)} tokens, tenant shares {hot[0]:.0%} .. {hot[-1]:.1%} (skew {args.skew}); "
          f"{args.warmup} warm-up + {args.requests} measured requests at {args.rate}/s, seed {args.seed}", flush=True)
    # The same engine addresses for every strategy and run: the hash strategies place a prompt by a
    # rendezvous hash over the upstream URLs, so fresh random ports would give each strategy its own
    # placement luck (one run's hottest tenants sharing an engine, another's not).
    args.engine_ports = [free_port() for _ in range(args.engines)]
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in args.strategies.split(",")}
    for rep in range(args.repeats):
        for strategy in runs:
            load0 = os.getloadavg()[0]
            logs = work / f"run{rep}"
            logs.mkdir(exist_ok=True)
            r = run_strategy(strategy, model, args, prompts, warmup, measured, logs, tenants_by_block)
            r["loadavg_before"], r["loadavg_after"] = load0, os.getloadavg()[0]
            runs[strategy].append(r)
            report_run(strategy, rep, r)
    results = {s: pooled(rs) for s, rs in runs.items()}
    return {"kv_tokens": kv_tokens, "prompt_tokens": lengths, "tenant_weights": weights, "results": results,
            "runs": runs}


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One strategy's runs as one sample: hit rate over all their tokens, TTFTs over all their requests."""
    ttfts = sorted(t for r in runs for t in r["ttfts"])
    hits, queries = sum(r["hit_tokens"] for r in runs), sum(r["query_tokens"] for r in runs)
    return {"hit_rate": hits / queries, "hit_tokens": hits, "query_tokens": queries,
            "ttft_mean": statistics.fmean(ttfts), "ttft_p50": statistics.median(ttfts),
            "ttft_p99": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], "requests": len(ttfts), "runs": len(runs)}


def report_run(strategy: str, rep: int, r: dict[str, Any]) -> None:
    load0 = r["loadavg_before"]
    shares = " / ".join(f"{q / r['query_tokens']:.0%}" for _, q in r["per_engine_hit_query_tokens"])
    print(f"run {rep} {strategy:>13}: hit rate {r['hit_rate']:6.1%}  TTFT mean {r['ttft_mean']:6.2f}s  "
          f"p50 {r['ttft_p50']:6.2f}s  p99 {r['ttft_p99']:6.2f}s  (wall {r['wall_s']:.0f}s, "
          f"load {load0:.1f} -> {r['loadavg_after']:.1f}, prompt tokens per engine {shares})", flush=True)
    p = r["placement"]
    slow = sorted(zip(r["ttfts"], r["tenants"]), reverse=True)[:3]
    print(f"{'':>13}  slowest: " + ", ".join(f"{t:.2f}s (tenant {n})" for t, n in slow), flush=True)
    print(f"{'':>13}  full misses per engine {list(p['full_misses_per_engine'].values())}, evictions "
          f"{list(p['evictions_per_engine'].values())}, tenants computed on 1/2/3 engines "
          f"{[p['tenants_computed_on_n_engines'].get(k, 0) for k in (1, 2, 3)]}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = run(args)
    print("\n| strategy | runs x requests | prefix-cache hit rate | TTFT mean | TTFT p50 | TTFT p99 |\n"
          "|---|---|---|---|---|---|")
    for s, r in out["results"].items():
        print(f"| `{s}` | {r['runs']} x {r['requests'] // r['runs']} | {r['hit_rate']:.1%} | {r['ttft_mean']:.2f} s | "
              f"{r['ttft_p50']:.2f} s | {r['ttft_p99']:.2f} s |")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, **out}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
