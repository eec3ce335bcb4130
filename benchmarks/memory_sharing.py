"""KV memory saved by sharing blocks, on SmolLM2-135M (CPU, fp32):

1. parallel sampling: one request with n=5 vs n=1 (samples share the prompt's blocks copy-on-write)
2. beam search width 4 vs greedy (beams share their common prefix)
3. 32 requests sharing a 256-token system prompt, with and without --enable-prefix-caching
4. time to first token of a request whose 256-token prefix is cached vs not

Peak blocks = the most KV blocks referenced at once during the run (cached-but-free blocks excluded).

    python benchmarks/memory_sharing.py [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import time

from pagedmodel.server.engine.args import EngineArgs
from pagedmodel.server.engine.llm_engine import LLMEngine
from pagedmodel.server.engine.sampling_params import SamplingParams

BLOCK = 16


def engine(model: str | None, **kw) -> LLMEngine:
    return LLMEngine(EngineArgs(model=model, device="cpu", block_size=BLOCK, max_model_len=2048, **kw))


def referenced_blocks(eng: LLMEngine) -> int:
    return sum(1 for b in eng.scheduler.block_manager.pool.blocks if b.ref_cnt > 0)


def run_peak(eng: LLMEngine, requests) -> int:
    for i, (prompt, params) in enumerate(requests):
        eng.add_request(f"r{len(eng.requests)}-{i}-{time.monotonic_ns()}", prompt, params)
    peak = 0
    while eng.has_unfinished_requests():
        eng.step()
        peak = max(peak, referenced_blocks(eng))
    return peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    results: dict[str, float] = {}

    eng = engine(args.model)
    tok = eng.tokenizer
    text = " ".join(f"Rule {i}: answer politely, cite sources, keep it short and check facts twice." for i in range(40))
    system = tok(text).input_ids[:256]
    prompt = system[:200]

    # 1. parallel sampling
    sample = dict(temperature=0.8, max_tokens=64, ignore_eos=True, seed=0)
    one = run_peak(eng, [(prompt, SamplingParams(n=1, **sample))])
    five = run_peak(eng, [(prompt, SamplingParams(n=5, **sample))])
    results.update(n1_blocks=one, n5_blocks=five, n5_vs_n1=five / one, n5_unshared_blocks=5 * one)
    print(f"parallel sampling, 200-token prompt + 64 tokens: n=1 {one} blocks, n=5 {five} blocks "
          f"({five / one:.2f}x; without sharing {5 * one} blocks = 5.00x)")

    # 2. beam search
    greedy = run_peak(eng, [(prompt, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))])
    try:
        beam = run_peak(eng, [(prompt, SamplingParams(temperature=0, use_beam_search=True, n=1, best_of=4,
                                                      max_tokens=64, ignore_eos=True))])
        results.update(greedy_blocks=greedy, beam4_blocks=beam, beam4_vs_greedy=beam / greedy)
        print(f"beam search width 4 vs greedy: {beam} vs {greedy} blocks ({beam / greedy:.2f}x; without sharing 4.00x)")
    except Exception as exc:  # beam search may be unavailable in this build: say so, don't hide it
        print(f"beam search: not measured ({type(exc).__name__}: {exc})")

    # 3. shared system prompt, 32 requests
    questions = [tok(f" Question {i}: what is rule {i}?").input_ids for i in range(32)]
    reqs = [(system + q, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)) for q in questions]
    no_cache = run_peak(engine(args.model), reqs)
    cached_engine = engine(args.model, enable_prefix_caching=True)
    with_cache = run_peak(cached_engine, reqs)
    bm = cached_engine.scheduler.block_manager
    results.update(shared_prompt_blocks_no_cache=no_cache, shared_prompt_blocks_cache=with_cache,
                   shared_prompt_hit_rate=bm.prefix_hits / bm.prefix_queries)
    print(f"32 requests sharing a 256-token system prompt: {no_cache} blocks without prefix caching, "
          f"{with_cache} with ({with_cache / no_cache:.2f}x), hit rate {bm.prefix_hits / bm.prefix_queries:.0%}")

    # 4. TTFT with a cached prefix (same engine, prefix warmed by a first request)
    def ttft(eng: LLMEngine, p: list[int]) -> float:
        eng.add_request(f"t{time.monotonic_ns()}", p, SamplingParams(temperature=0, max_tokens=1))
        t = time.perf_counter()
        while eng.has_unfinished_requests():
            eng.step()
        return time.perf_counter() - t

    warm = engine(args.model, enable_prefix_caching=True)
    long_system = tok(text * 2).input_ids[:1024]
    ttft(warm, long_system + questions[0])
    hit = min(ttft(warm, long_system + q) for q in questions[1:4])
    cold = engine(args.model)
    miss = min(ttft(cold, long_system + q) for q in questions[1:4])
    results.update(ttft_miss_s=miss, ttft_hit_s=hit, ttft_speedup=miss / hit)
    print(f"TTFT, 1024-token shared prefix: {miss * 1000:.0f} ms uncached, {hit * 1000:.0f} ms cached ({miss / hit:.1f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
