"""`pagedmodel bench serve`: load-test an OpenAI-compatible server the way `vllm bench serve` does.

Requests arrive as a Poisson process at --request-rate (or a gamma process with --burstiness: < 1 is
burstier, > 1 steadier), optionally capped at --max-concurrency in flight. Prompts are synthetic (lengths
drawn uniformly within --range-ratio of --input-len/--output-len) or read from a JSONL file. Every request
streams, so the client sees time to first token (TTFT), inter-token latencies (ITL), time per output token
after the first (TPOT) and end-to-end latency (E2EL); token counts come from the server's usage report.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Common English words that byte-level BPE vocabularies (Llama, SmolLM2, GPT-2...) keep as one token with
# their leading space, so n words make a prompt of about n tokens; the server's usage gives the exact count.
_WORDS = (
    "the of and to in is was for on that with as by at from his her they this which or had are not but be "
    "have one all were when we there can an your what their if would will each about how up out them then "
    "she many some so these could time very make like him into has look two more write go see number no way "
    "people my than first water been call who its now find long down day did get come made may part over new "
    "sound take only little work know place year live me back give most very after thing our just name good "
    "sentence man think say great where help through much before line right too mean old any same tell boy "
    "follow came want show also around form three small set put end does another well large must big even "
    "such because turn here why ask went men read need land different home us move try kind hand picture "
    "again change off play spell air away animal house point page letter mother answer found study still "
    "learn should world high every near add food between own below country plant last school father keep "
    "tree never start city earth eye light thought head under story saw left few while along might close "
    "something seem next hard open example begin life always those both paper together got group often run"
).split()


class BenchError(ValueError):
    """Bad benchmark arguments or input file; the CLI prints it and exits 2."""


@dataclass
class BenchRequest:
    prompt: str | list[dict[str, str]]   # text for /v1/completions, messages for /v1/chat/completions
    max_tokens: int
    expected_input_len: int | None = None


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    status: int | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)
    start: float = 0.0

    @property
    def tpot(self) -> float | None:
        return (self.e2el - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


# ------------------------------------------------------------------ workloads

def _length(rng: random.Random, mean: int, ratio: float) -> int:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return rng.randint(lo, hi)


def synthetic_requests(num: int, input_len: int, output_len: int, range_ratio: float, seed: int,
                       chat: bool) -> list[BenchRequest]:
    rng = random.Random(seed)
    out = []
    for i in range(num):
        n_in = _length(rng, input_len, range_ratio)
        # a distinct opening per request keeps prefix caching from turning the benchmark into a cache test
        words = [f"{i}:"] + [rng.choice(_WORDS) for _ in range(max(0, n_in - 2))]
        text = " ".join(words)
        prompt: str | list[dict[str, str]] = [{"role": "user", "content": text}] if chat else text
        out.append(BenchRequest(prompt, _length(rng, output_len, range_ratio), n_in))
    return out


def jsonl_requests(path: Path, num: int, default_output_len: int, seed: int, chat: bool) -> list[BenchRequest]:
    """Lines of {"prompt": str} or {"messages": [...]}, with optional "max_tokens" / "output_len"."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise BenchError(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise BenchError(f"{path} is not UTF-8 text") from None
    rows: list[BenchRequest] = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise BenchError(f"{path}:{lineno}: invalid JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise BenchError(f"{path}:{lineno}: expected a JSON object")
        max_tokens = row.get("max_tokens", row.get("output_len", default_output_len))
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise BenchError(f"{path}:{lineno}: max_tokens must be a positive integer")
        if isinstance(row.get("messages"), list):
            prompt: str | list[dict[str, str]] = row["messages"] if chat else "\n".join(
                str(m.get("content", "")) for m in row["messages"] if isinstance(m, dict))
        elif isinstance(row.get("prompt"), str) and row["prompt"]:
            prompt = [{"role": "user", "content": row["prompt"]}] if chat else row["prompt"]
        else:
            raise BenchError(f"{path}:{lineno}: needs a non-empty \"prompt\" string or a \"messages\" list")
        rows.append(BenchRequest(prompt, max_tokens))
    if not rows:
        raise BenchError(f"{path} holds no requests")
    rng = random.Random(seed)
    # cycle through the file (shuffled) until num requests
    picked = []
    while len(picked) < num:
        batch = rows[:]
        rng.shuffle(batch)
        picked.extend(batch)
    return picked[:num]


def arrival_delays(num: int, rate: float, burstiness: float, seed: int) -> Iterator[float]:
    """Gaps between consecutive requests: gamma(shape=burstiness, mean=1/rate); burstiness 1 = Poisson."""
    rng = random.Random(seed + 1)
    for _ in range(num):
        if math.isinf(rate):
            yield 0.0
        else:
            yield rng.gammavariate(burstiness, 1.0 / (rate * burstiness))


# ------------------------------------------------------------------ client

async def _sse_events(resp: Any) -> AsyncIterator[str]:
    buf = b""
    async for chunk in resp.content.iter_any():
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    yield line[5:].strip().decode("utf-8", "replace")


async def send_request(session: Any, url: str, headers: dict[str, str], model: str, req: BenchRequest,
                       chat: bool, ignore_eos: bool) -> RequestResult:
    import aiohttp

    body: dict[str, Any] = {"model": model, "max_tokens": req.max_tokens, "stream": True,
                            "stream_options": {"include_usage": True}, "temperature": 0.0}
    if ignore_eos:
        body["ignore_eos"] = True
    body["messages" if chat else "prompt"] = req.prompt
    res = RequestResult(start=time.perf_counter())
    t0 = res.start
    last = t0
    chunks = 0
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            res.status = resp.status
            if resp.status != 200:
                text = await resp.text()
                try:
                    res.error = f"HTTP {resp.status}: {json.loads(text)['error']['message']}"
                except (ValueError, KeyError, TypeError):
                    res.error = f"HTTP {resp.status}: {text[:200]}"
                return res
            async for data in _sse_events(resp):
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if "error" in msg:
                    res.error = f"stream error: {msg['error'].get('message')}"
                    return res
                if msg.get("usage"):
                    res.prompt_tokens = msg["usage"].get("prompt_tokens", 0)
                    res.output_tokens = msg["usage"].get("completion_tokens", 0)
                for choice in msg.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    if piece:
                        now = time.perf_counter()
                        if chunks == 0:
                            res.ttft = now - t0
                        else:
                            res.itl.append(now - last)
                        last = now
                        chunks += 1
        res.e2el = time.perf_counter() - t0
        if not res.output_tokens:
            res.output_tokens = chunks   # server without include_usage: one chunk ~ one token
        res.ok = chunks > 0 or res.output_tokens > 0
        if not res.ok:
            res.error = "empty response"
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    return res


async def _fetch_model(session: Any, base_url: str, headers: dict[str, str]) -> str:
    async with session.get(base_url + "/v1/models", headers=headers) as resp:
        if resp.status != 200:
            raise BenchError(f"GET {base_url}/v1/models answered {resp.status}; pass --model")
        data = await resp.json()
    models = [m.get("id") for m in data.get("data", [])]
    if not models:
        raise BenchError(f"{base_url}/v1/models lists no model; pass --model")
    return models[0]


async def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    import aiohttp

    chat = args.endpoint.rstrip("/").endswith("chat/completions")
    if args.dataset_path:
        requests = jsonl_requests(Path(args.dataset_path), args.num_prompts, args.output_len, args.seed, chat)
    else:
        requests = synthetic_requests(args.num_prompts, args.input_len, args.output_len, args.range_ratio,
                                      args.seed, chat)
    base = args.base_url.rstrip("/")
    url = base + args.endpoint
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    connector = aiohttp.TCPConnector(limit=args.max_concurrency or 0)
    ignore_eos = not args.no_ignore_eos
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        try:
            model = args.model or await _fetch_model(session, base, headers)
        except aiohttp.ClientError as exc:
            raise BenchError(f"cannot reach {base}: {exc}") from None
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        bar = None
        if not args.no_progress:
            from tqdm import tqdm
            bar = tqdm(total=len(requests), desc="requests", unit="req", file=sys.stderr)

        async def one(req: BenchRequest) -> RequestResult:
            if sem is None:
                res = await send_request(session, url, headers, model, req, chat, ignore_eos)
            else:
                async with sem:
                    res = await send_request(session, url, headers, model, req, chat, ignore_eos)
            if bar is not None:
                bar.update(1)
            return res

        start = time.perf_counter()
        tasks = []
        for req, delay in zip(requests, arrival_delays(len(requests), args.request_rate, args.burstiness, args.seed)):
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        if bar is not None:
            bar.close()
    return summarize(results, duration, model=model, args=args)


# ------------------------------------------------------------------ report

def _stats(values: list[float], percentiles: list[float]) -> dict[str, float]:
    """mean / median / std and the asked percentiles, in milliseconds (0 when there is no data)."""
    if not values:
        return {"mean": 0.0, "median": 0.0, "std": 0.0, **{f"p{_fmt_p(p)}": 0.0 for p in percentiles}}
    ms = sorted(v * 1000 for v in values)
    out = {"mean": statistics.fmean(ms), "median": statistics.median(ms),
           "std": statistics.pstdev(ms) if len(ms) > 1 else 0.0}
    for p in percentiles:
        # linear interpolation between the two closest ranks (numpy's default method)
        k = (len(ms) - 1) * p / 100
        lo, hi = math.floor(k), math.ceil(k)
        out[f"p{_fmt_p(p)}"] = ms[lo] + (ms[hi] - ms[lo]) * (k - lo)
    return out


def _fmt_p(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def summarize(results: list[RequestResult], duration: float, *, model: str, args: argparse.Namespace) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    percentiles = args.percentiles
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    errors: dict[str, int] = {}
    for r in failed:
        key = r.error.split(":")[0] if r.error else "unknown"
        errors[key] = errors.get(key, 0) + 1
    return {
        "model": model, "base_url": args.base_url, "endpoint": args.endpoint,
        "num_prompts": len(results), "request_rate": None if math.isinf(args.request_rate) else args.request_rate,
        "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
        "duration_s": duration, "completed": len(ok), "failed": len(failed), "errors": errors,
        "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "input_throughput": input_tokens / duration if duration > 0 else 0.0,
        "output_throughput": output_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": (input_tokens + output_tokens) / duration if duration > 0 else 0.0,
        "ttft_ms": _stats([r.ttft for r in ok], percentiles),
        "tpot_ms": _stats([t for r in ok if (t := r.tpot) is not None], percentiles),
        "itl_ms": _stats([x for r in ok for x in r.itl], percentiles),
        "e2el_ms": _stats([r.e2el for r in ok], percentiles),
        "per_request": [{"ok": r.ok, "error": r.error or None, "prompt_tokens": r.prompt_tokens,
                         "output_tokens": r.output_tokens, "ttft_s": r.ttft, "e2el_s": r.e2el}
                        for r in results],
    }


def format_report(result: dict[str, Any]) -> str:
    w = 46
    lines = [" Serving benchmark ".center(w + 14, "=")]

    def row(name: str, value: Any) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{name:<{w}}{text:>14}")

    row("Model:", result["model"])
    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    for err, count in result["errors"].items():
        row(f"  {err}:", count)
    row("Benchmark duration (s):", result["duration_s"])
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"])
    row("Output token throughput (tok/s):", result["output_throughput"])
    row("Total token throughput (tok/s):", result["total_token_throughput"])
    for key, title in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                       ("itl_ms", "Inter-token Latency"), ("e2el_ms", "End-to-end Latency")):
        lines.append(f" {title} ".center(w + 14, "-"))
        for stat, value in result[key].items():
            label = {"mean": "Mean", "median": "Median", "std": "Std"}.get(stat, stat.upper())
            row(f"{label} {key.split('_')[0].upper()} (ms):", value)
    lines.append("=" * (w + 14))
    return "\n".join(lines)


# ------------------------------------------------------------------ CLI

def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def _rate(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'inf', got {text!r}") from None
    if not v > 0 or math.isnan(v):
        raise argparse.ArgumentTypeError(f"must be > 0 (or 'inf'), got {text}")
    return v


def _percentiles(text: str) -> list[float]:
    try:
        ps = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not ps or any(not 0 <= p <= 100 for p in ps):
        raise argparse.ArgumentTypeError("percentiles must be in [0, 100]")
    return ps


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)
    p = sub.add_parser("serve", help="load-test a running OpenAI-compatible server",
                       description=__doc__.splitlines()[0])
    a = p.add_argument
    a("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    a("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    a("--model", default=None, help="model name (default: the first one /v1/models lists)")
    a("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    a("--num-prompts", type=_positive_int, default=100, help="requests to send")
    a("--request-rate", type=_rate, default=float("inf"), help="mean requests per second; inf = all at once")
    a("--burstiness", type=_rate, default=1.0, help="gamma shape of arrivals: 1 = Poisson, <1 burstier, >1 steadier")
    a("--max-concurrency", type=_positive_int, default=None, help="most requests in flight at once")
    a("--dataset-path", default=None, help="JSONL of {\"prompt\"|\"messages\", \"max_tokens\"?}; default: synthetic")
    a("--input-len", type=_positive_int, default=128, help="synthetic prompt length, in tokens (about)")
    a("--output-len", type=_positive_int, default=128, help="tokens to generate per request (max_tokens)")
    a("--range-ratio", type=float, default=0.0, help="lengths are uniform in len*(1-r) .. len*(1+r)")
    a("--no-ignore-eos", action="store_true", help="let requests stop at EOS (default: run to max_tokens)")
    a("--seed", type=int, default=0)
    a("--timeout", type=float, default=600.0, help="seconds before one request counts as failed")
    a("--percentiles", type=_percentiles, default=[50.0, 90.0, 99.0], help="comma-separated, e.g. 50,90,99")
    a("--json", dest="json_path", default=None, help="write the full result (summary + per request) here")
    a("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    if args.bench_command != "serve":
        print(f"pagedmodel bench: unknown benchmark {args.bench_command!r}", file=sys.stderr)
        return 2
    if not 0 <= args.range_ratio < 1:
        print(f"pagedmodel bench serve: error: --range-ratio must be in [0, 1), got {args.range_ratio}", file=sys.stderr)
        return 2
    try:
        result = asyncio.run(run_benchmark(args))
    except BenchError as exc:
        print(f"pagedmodel bench serve: error: {exc}", file=sys.stderr)
        return 2
    print(format_report(result))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=2))
    if result["completed"] == 0:
        print("pagedmodel bench serve: every request failed", file=sys.stderr)
        return 1
    return 0
