"""Soak: hours (or, with --quick, a minute) of mixed traffic against real `pagedmodel serve` processes, one
engine alone and then two behind `pagedmodel router`, with leak checks at the end of each phase.

    python3 benchmarks/soak.py --quick                  # tiny random model, about 2 minutes (the suite runs it)
    python3 benchmarks/soak.py --duration 30            # SmolLM2 (the default model), 30 minutes in all

The traffic (benchmarks/soak_traffic.py) is a fixed-seed mix of streamed and non-streamed chat and
completions, n > 1, beam search, shared system prompts (prefix caching on), long requests that
overflow the deliberately small KV cache (preemption: the lone engine and one routed engine swap,
the other routed engine recomputes), 10 % client aborts at random points and 2 % hostile requests.

A phase runs on past its time (at most MAX_EXTENSION_S) until the mix has exercised every check below
(a hostile request, an abort, a preemption on each engine). After each phase, once idle, it asserts and
prints: requests by outcome ("other" must be 0); on every engine the KV gauge back to 0 blocks in use
and GET /debug/kv_blocks (the block manager's invariant check, served with --enable-debug-endpoints)
clean, with preemptions and prefix-cache hits seen; process RSS after the phase within RSS_BOUND of its
value after warm-up; the router's client connections, upstream connections and asyncio tasks back to
their idle level. Exit status 0 only if every check held; the last line printed is `SOAK PASS` or `SOAK FAIL: <checks>`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import soak_traffic as traffic  # noqa: E402
from support import free_port, stop_process, wait_healthy, wait_until  # noqa: E402

from pagedmodel import metrics_contract as mc  # noqa: E402
from pagedmodel.kernels.cpu_features import has_native_bf16  # noqa: E402

BLOCK_SIZE = 16
KV_BLOCKS = 48            # small on purpose: the mix's long requests cannot all fit -> preemption
MAX_MODEL_LEN = 512
LONG_WORDS = 260          # prompt words of a "long" request (~1 token each with this vocabulary)
RSS_BOUND_MIB = 64        # allowed growth after warm-up: RSS_BOUND_MIB + RSS_BOUND_SHARE of the warm RSS
RSS_BOUND_SHARE = 0.10
IDLE_SLACK_TASKS = 2      # router tasks above its idle count still tolerated once idle again
REQUEST_TIMEOUT_S = 180.0
MAX_EXTENSION_S = 180.0   # the longest a phase runs past its time while the mix has not exercised every check
SERVED_NAME = "soak"
# What --dtype auto picks on this CPU (bf16 only where it is native: AMX / AVX512-BF16; emulated bf16 ran the
# SmolLM2 soak at a few requests a minute and timed requests out), pinned so the KV size is known.
DTYPE, DTYPE_BYTES = ("bfloat16", 2) if has_native_bf16() else ("float32", 4)


@dataclass
class Proc:
    name: str
    url: str
    popen: subprocess.Popen[bytes]
    log: Path
    mode: str = ""                  # an engine's --preemption-mode
    rss_warm: int | None = None
    rss_max: int = 0


@dataclass
class PhaseReport:
    name: str
    seconds: float
    tally: traffic.Tally
    failures: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)


# ---- processes

def _start(name: str, args: list[str], logdir: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    with open(logdir / f"{name}.log", "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "pagedmodel.cli", *args], stdout=out,
                                stderr=subprocess.STDOUT, env=env)


def kv_cache_bytes(model_dir: Path, blocks: int) -> int:
    """--kv-cache-memory for `blocks` blocks of this model in DTYPE."""
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_block = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * BLOCK_SIZE * DTYPE_BYTES
    return blocks * per_block + per_block // 2   # half a block of slack against rounding down


def start_engine(name: str, model_dir: Path, mode: str, logdir: Path) -> Proc:
    port = free_port()
    kv_bytes = kv_cache_bytes(model_dir, KV_BLOCKS)
    # swap space for twice the device blocks: enough to swap, and small, since RSS grows as it is first touched
    swap_gib = f"{2 * kv_bytes / 2**30:.6f}"
    popen = _start(name, ["serve", "--model", str(model_dir), "--device", "cpu", "--host", "127.0.0.1",
                          "--port", str(port), "--served-model-name", SERVED_NAME, "--block-size", str(BLOCK_SIZE),
                          "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "16", "--dtype", DTYPE,
                          "--kv-cache-memory", str(kv_bytes), "--swap-space", swap_gib,
                          "--preemption-mode", mode, "--enable-prefix-caching", "--enable-debug-endpoints"], logdir)
    return Proc(name, f"http://127.0.0.1:{port}", popen, logdir / f"{name}.log", mode)


def start_router(upstreams: list[Proc], logdir: Path) -> Proc:
    port = free_port()
    args = ["router", "--host", "127.0.0.1", "--port", str(port), "--strategy", "kv-aware", "--queue-timeout", "60"]
    for up in upstreams:
        args += ["--upstream", up.url]
    return Proc("router", f"http://127.0.0.1:{port}", _start("router", args, logdir), logdir / "router.log")


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def sample_rss(procs: list[Proc], warm: bool) -> None:
    for p in procs:
        if p.popen.poll() is None:
            rss = rss_bytes(p.popen.pid)
            p.rss_max = max(p.rss_max, rss)
            if warm and p.rss_warm is None:
                p.rss_warm = rss


# ---- scraping

def _get(url: str, timeout: float = 10.0) -> Any:
    import httpx
    return httpx.get(url, timeout=timeout)


def metric_sums(url: str, names: list[str]) -> dict[str, float]:
    return mc.sums(_get(url + "/metrics").text, names)


def engine_idle(url: str) -> bool:
    got = metric_sums(url, ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:num_requests_swapped"])
    return sum(got.values()) == 0


# ---- load

async def drive(base_url: str, seconds: float, concurrency: int, seed: int, first_index: int,
                procs: list[Proc], warmup_s: float,
                covered: Callable[[traffic.Tally], bool] = lambda _t: True) -> traffic.Tally:
    """Closed loop: `concurrency` clients play the mix from request `first_index` on for `seconds`, and on
    (at most MAX_EXTENSION_S more) until `covered(tally)`: on a loaded machine a short phase may not yet
    have drawn a hostile request or forced a preemption, and the checks need both to mean anything."""
    import httpx

    tally = traffic.Tally()
    counter = iter(range(first_index, 10**9))
    start = time.monotonic()
    deadline = start + seconds
    done = asyncio.Event()

    async def client() -> None:
        limits = httpx.Limits(max_connections=4, max_keepalive_connections=2)
        async with httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=10.0), limits=limits) as c:
            while not done.is_set():
                p = traffic.plan(next(counter), seed, SERVED_NAME, MAX_MODEL_LEN, LONG_WORDS)
                tally.results.append(await traffic.play(c, base_url, p, REQUEST_TIMEOUT_S))

    async def until_covered() -> None:
        await asyncio.sleep(seconds)
        while time.monotonic() < deadline + MAX_EXTENSION_S and not await asyncio.to_thread(covered, tally):
            await asyncio.sleep(2.0)
        if time.monotonic() - deadline > 1.0:
            print(f"  phase extended by {time.monotonic() - deadline:.0f} s until the mix had exercised every "
                  f"check (or {MAX_EXTENSION_S:.0f} s passed)", flush=True)
        done.set()

    async def watch_rss() -> None:
        last_print = start
        while not done.is_set():
            await asyncio.sleep(2.0)
            sample_rss(procs, warm=time.monotonic() - start >= warmup_s)
            if time.monotonic() - last_print >= 60:   # a progress line a minute: the RSS curve, for the record
                last_print = time.monotonic()
                rss = ", ".join(f"{p.name} {rss_bytes(p.popen.pid) / 2**20:.0f}" for p in procs if p.popen.poll() is None)
                print(f"  t={last_print - start:5.0f}s requests {len(tally.results)} outcomes {tally.counts()} "
                      f"RSS MiB: {rss}; load average {os.getloadavg()[0]:.1f}", flush=True)

    watcher = asyncio.create_task(watch_rss())
    await asyncio.gather(until_covered(), *(client() for _ in range(concurrency)))
    watcher.cancel()
    return tally


# ---- checks after a phase

COUNTERS = ["vllm:num_preemptions_total", "pagedmodel:num_swap_outs_total", "vllm:prefix_cache_hits_total"]


def check_engine(e: Proc, before: dict[str, float], report: PhaseReport) -> None:
    fail = report.failures.append
    if not wait_until(lambda: engine_idle(e.url), timeout=60, interval=0.5):
        fail(f"{e.name}: requests still running/waiting 60 s after the load stopped")
    got = metric_sums(e.url, ["vllm:kv_cache_usage_perc", "pagedmodel:kv_cache_blocks_total",
                              "pagedmodel:kv_cache_blocks_free", *COUNTERS])
    for name in COUNTERS:   # this phase's share of the engine's cumulative counters
        got[name] = got.get(name, 0) - before.get(name, 0)
    dbg = _get(e.url + "/debug/kv_blocks").json()
    leaked = int(got.get("pagedmodel:kv_cache_blocks_total", -1) - got.get("pagedmodel:kv_cache_blocks_free", 0))
    report.lines.append(
        f"{e.name}: kv_cache_usage_perc {got.get('vllm:kv_cache_usage_perc')}, blocks in use {leaked} (gauge) / "
        f"{dbg['blocks_in_use']} (pool), cpu blocks in use {dbg['cpu_blocks_in_use']}, invariants "
        f"{'ok' if dbg['invariants_ok'] else dbg['invariant_error']}, preemptions "
        f"{int(got.get('vllm:num_preemptions_total', 0))} (swap-outs {int(got['pagedmodel:num_swap_outs_total'])}), "
        f"prefix-cache hit tokens "
        f"{int(got.get('vllm:prefix_cache_hits_total', 0))}")
    if got.get("vllm:kv_cache_usage_perc") != 0 or leaked != 0:
        fail(f"{e.name}: KV gauge not back to 0 once idle ({got})")
    if dbg["blocks_in_use"] or dbg["cpu_blocks_in_use"] or not dbg["invariants_ok"] or dbg["unfinished_requests"]:
        fail(f"{e.name}: /debug/kv_blocks not clean once idle: {dbg}")
    if got.get("vllm:num_preemptions_total", 0) < 1:
        fail(f"{e.name}: no preemption happened (the mix is meant to force some)")
    if e.mode == "swap" and got["pagedmodel:num_swap_outs_total"] < 1:
        fail(f"{e.name}: preempted without ever swapping (--preemption-mode swap)")
    if e.mode == "recompute" and got["pagedmodel:num_swap_outs_total"] > 0:
        fail(f"{e.name}: swapped under --preemption-mode recompute")
    if got.get("vllm:prefix_cache_hits_total", 0) < 1:
        fail(f"{e.name}: no prefix-cache hit (the shared system prompts are meant to hit)")


def check_rss(procs: list[Proc], report: PhaseReport) -> None:
    sample_rss(procs, warm=True)
    for p in procs:
        if p.popen.poll() is not None:
            report.failures.append(f"{p.name}: exited with {p.popen.returncode} during the phase")
            continue
        end = rss_bytes(p.popen.pid)
        warm = p.rss_warm or end
        bound = warm * (1 + RSS_BOUND_SHARE) + RSS_BOUND_MIB * 2**20
        report.lines.append(f"{p.name}: RSS warm {warm / 2**20:.0f} MiB, max {p.rss_max / 2**20:.0f} MiB, "
                            f"end {end / 2**20:.0f} MiB (bound {bound / 2**20:.0f} MiB)")
        if end > bound:
            report.failures.append(f"{p.name}: RSS grew from {warm / 2**20:.0f} to {end / 2**20:.0f} MiB "
                                   f"after warm-up (bound {bound / 2**20:.0f} MiB)")


def router_gauges(url: str) -> dict[str, float]:
    """client connections, upstream connections in use / idle (pooled), asyncio tasks."""
    out: dict[str, float] = {}
    for s in mc.parse(_get(url + "/metrics").text):
        if s.name == "pagedmodel_router_upstream_connections":
            out["upstream_" + s.labels.get("state", "")] = s.value
        elif s.name in ("pagedmodel_router_client_connections", "pagedmodel_router_asyncio_tasks"):
            out[s.name.removeprefix("pagedmodel_router_")] = s.value
    return out


def check_router(router: Proc, idle_before: dict[str, float], concurrency: int, upstreams: int,
                 report: PhaseReport) -> None:
    """Client connections, upstream connections in use and tasks back to their idle level before the load;
    pooled idle upstream connections bounded by the load's concurrency per upstream: each upstream's pool keeps
    at most as many as were open to it at once (reused, not leaked), and that peak may come for each at another
    time."""
    def settled() -> dict[str, float] | None:
        now = router_gauges(router.url)
        ok = (now["client_connections"] <= idle_before["client_connections"]
              and now["upstream_in_use"] <= idle_before["upstream_in_use"]
              and now["upstream_idle"] <= upstreams * (concurrency + 2)
              and now["asyncio_tasks"] <= idle_before["asyncio_tasks"] + IDLE_SLACK_TASKS)
        return now if ok else None
    now = wait_until(settled, timeout=30, interval=1.0)
    last = now or router_gauges(router.url)
    report.lines.append("router idle before/after load: " + ", ".join(
        f"{k} {idle_before.get(k, 0):.0f}/{last.get(k, 0):.0f}" for k in sorted(last)))
    if now is None:
        report.failures.append(f"router: connections/tasks did not return to the idle level {idle_before}: {last}")


# ---- phases

def run_phase(name: str, target: Proc, engines: list[Proc], router: Proc | None, args: argparse.Namespace,
              seconds: float, first_index: int) -> PhaseReport:
    """Load `target` for `seconds`, then check `engines` (and `router`) once idle."""
    procs = engines + ([router] if router else [])
    idle_before = router_gauges(router.url) if router else {}
    counters_before = {e.name: metric_sums(e.url, COUNTERS) for e in engines}
    for p in procs:   # each phase has its own warm-up
        p.rss_warm, p.rss_max = None, 0
    def covered(tally: traffic.Tally) -> bool:
        """Every outcome the checks need has happened, and every engine preempted (swapped) and hit its cache."""
        counts = tally.counts()
        if not all(counts[k] for k in ("completed", "aborted", "rejected_4xx")):
            return False
        for e in engines:
            got = metric_sums(e.url, COUNTERS)
            grew = {n: got.get(n, 0) - counters_before[e.name].get(n, 0) for n in COUNTERS}
            if grew["vllm:num_preemptions_total"] < 1 or grew["vllm:prefix_cache_hits_total"] < 1:
                return False
            if e.mode == "swap" and grew["pagedmodel:num_swap_outs_total"] < 1:
                return False
        return True

    t0 = time.monotonic()
    tally = asyncio.run(drive(target.url, seconds, args.concurrency, args.seed, first_index, procs,
                              warmup_s=min(120.0, seconds * 0.5), covered=covered))
    report = PhaseReport(name, time.monotonic() - t0, tally)
    for e in engines:
        check_engine(e, counters_before[e.name], report)
    if router is not None:
        check_router(router, idle_before, args.concurrency, len(engines), report)
    check_rss(procs, report)
    if tally.counts()["other"]:
        report.failures.append(f"{tally.counts()['other']} request(s) ended as 'other'")
    for kind in ("completed", "aborted", "rejected_4xx"):
        if not tally.counts()[kind]:
            report.failures.append(f"no request ended as {kind!r}: the mix did not exercise it")
    return report


def print_report(r: PhaseReport) -> None:
    counts = r.tally.counts()
    print(f"\n== phase {r.name}: {len(r.tally.results)} requests in {r.seconds:.0f} s")
    print("outcome       " + " ".join(f"{k:>12}" for k in traffic.OUTCOMES))
    print("requests      " + " ".join(f"{counts[k]:>12}" for k in traffic.OUTCOMES))
    by_kind: dict[str, dict[str, int]] = {}
    for res in r.tally.results:   # hostile kinds share one row
        kind = "hostile" if res.planned.hostile else res.planned.kind
        row = by_kind.setdefault(kind, dict.fromkeys(traffic.OUTCOMES, 0))
        row[res.outcome] += 1
    latency = r.tally.latency_by_kind()
    print(f"{'kind':<18} " + " ".join(f"{k:>12}" for k in traffic.OUTCOMES) + f" {'p50 s':>8} {'p99 s':>8}")
    for kind, row in sorted(by_kind.items()):
        _n, p50, p99 = latency.get(kind, (0, float("nan"), float("nan")))
        print(f"{kind:<18} " + " ".join(f"{row[k]:>12}" for k in traffic.OUTCOMES) + f" {p50:>8.2f} {p99:>8.2f}")
    print(f"completion tokens/s {r.tally.completion_tokens() / max(r.seconds, 1e-9):.1f} "
          f"({r.tally.completion_tokens()} tokens)")
    for line in r.lines:
        print(line)
    for res in r.tally.others()[:10]:
        print(f"  other: #{res.planned.index} {res.planned.kind}: {res.detail}")
    for f in r.failures:
        print(f"  FAILED: {f}")


def resolve_model(args: argparse.Namespace, workdir: Path) -> Path:
    if args.model == "tiny":
        from tiny_models import make_tiny_model_dir
        return make_tiny_model_dir(workdir / "tiny-llama", "llama", max_position_embeddings=MAX_MODEL_LEN)
    from pagedmodel.server.engine.model_store import resolve_model as resolve
    return Path(resolve(None if args.model == "smollm2" else args.model))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, 2 x 30 s of load (under 2 minutes in all)")
    ap.add_argument("--duration", type=float, default=None, metavar="MIN",
                    help="minutes of load in all, split evenly between the two phases (default 30; --quick: 60 s)")
    ap.add_argument("--model", default=None, help="tiny | smollm2 | a model directory (default: smollm2; --quick: tiny)")
    ap.add_argument("--concurrency", type=int, default=8, help="concurrent clients")
    ap.add_argument("--seed", type=int, default=0, help="seed of the request mix")
    ap.add_argument("--logdir", type=Path, default=None, help="keep the servers' logs here")
    args = ap.parse_args(argv)
    args.model = args.model or ("tiny" if args.quick else "smollm2")
    minutes = args.duration if args.duration is not None else (1.0 if args.quick else 30.0)
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        logdir = args.logdir or Path(tmp)
        logdir.mkdir(parents=True, exist_ok=True)
        return run_all(args, resolve_model(args, Path(tmp)), minutes * 60 / 2, logdir)


def run_all(args: argparse.Namespace, model_dir: Path, phase_s: float, logdir: Path) -> int:
    print(f"soak: model {model_dir}, {phase_s:.0f} s per phase, concurrency {args.concurrency}, seed {args.seed}, "
          f"{DTYPE}, KV {KV_BLOCKS} blocks x {BLOCK_SIZE} tokens, logs in {logdir}; started "
          f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, {os.cpu_count()} CPUs, load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
    reports: list[PhaseReport] = []
    procs: list[Proc] = []
    try:
        # Both engines start together (startup is most of --quick's time); the first phase uses one alone.
        a = start_engine("engine-a-swap", model_dir, "swap", logdir)
        b = start_engine("engine-b-recompute", model_dir, "recompute", logdir)
        procs += [a, b]
        for e in (a, b):
            wait_healthy(e.url, e.popen, 300, e.log)
        reports.append(run_phase("one engine (swap)", a, [a], None, args, phase_s, 0))
        print_report(reports[-1])
        router = start_router([a, b], logdir)
        procs.append(router)
        wait_healthy(router.url, router.popen, 60, router.log)
        time.sleep(2.5)   # let the router's first scrape land, so the idle baseline is its steady state
        reports.append(run_phase("router, two engines (swap + recompute)", router, [a, b], router, args,
                                 phase_s, 10**6))
        print_report(reports[-1])
    finally:
        for p in procs:
            stop_process(p.popen)
    failures = [f"{r.name}: {f}" for r in reports for f in r.failures]
    print(f"\nended {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
    print("\nSOAK PASS" if not failures else "\nSOAK FAIL: " + "; ".join(failures), flush=True)
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
