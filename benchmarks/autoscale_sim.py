"""Autoscaler simulation: replicas with KV capacity under a load trace, scaled by the REAL policy.

    python benchmarks/autoscale_sim.py [--plot docs/autoscale_sim.png] [--json out.json] [--seed 1]
    python benchmarks/autoscale_sim.py --quick [--plot PATH] [--json PATH]     # short trace, seconds
    python benchmarks/autoscale_sim.py --signal queue      # without the router's arrival rate (the old rule)

A queueing model, stepped once per simulated second:

* Requests arrive as a Poisson process whose rate follows the trace: base load, ramp up, plateau,
  spike, plateau, ramp down, tail. Each has a prompt and a generation length (log-normal).
* The router (as `pagedmodel router` does) caps requests open to one engine at its max_num_seqs and
  queues the rest, dispatching to the ready engine with the fewest open requests.
* Each engine admits queued requests while a slot is free and the prompt's KV blocks fit, decodes
  every running sequence at a speed that falls with the batch size, grows each sequence's blocks as
  it generates, and preempts the newest sequence (recompute) when a block cannot be allocated.
* The router's arrival-rate gauge is the router's own estimator (server/router/arrival_rate.py) fed with
  every arrival at its time.
* Every `interval` seconds the operator's scrape is modelled: an `Observation` of the ready engines
  (mean KV usage, engine waiting + router queue, running, counter increments, the router's arrival
  rate unless `--signal queue`), and
  `pagedmodel.operator.autoscaler.decide` picks the replica count, with its state fed back through JSON
  as the operator persists it. New replicas serve after `startup` seconds; removed ones drain.

It reports over-provisioning (provisioned replica-seconds against an oracle that knows the arrival
rate and an engine's throughput at the target KV usage, with zero startup time) and the time to
react to the spike, and plots replicas, KV usage and waiting over time. A benchmark, not a test:
tests/operator/test_autoscale_sim.py runs `--quick` and checks its outcomes.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

from pagedmodel.operator.autoscaler import AutoscalerState, AutoscalingPolicy, decide, trim
from pagedmodel.operator.observation import Observation
from pagedmodel.server.router.arrival_rate import ArrivalRate


@dataclass(frozen=True)
class SimConfig:
    # Engine model: an engine decodes all running sequences once per step of a + b * running seconds.
    max_num_seqs: int = 32
    kv_blocks: int = 640
    block_size: int = 16
    step_base_s: float = 0.020
    step_per_seq_s: float = 0.0003
    prefill_tok_s: float = 8000.0
    prompt_mean: float = 300.0
    gen_mean: float = 150.0
    # Cluster.
    startup_s: float = 90.0
    # Trace (req/s and phase lengths in seconds).
    base_rate: float = 1.0
    plateau_rate: float = 12.0
    spike_rate: float = 30.0
    base_s: float = 600.0
    ramp_s: float = 900.0
    plateau_s: float = 900.0
    spike_s: float = 300.0
    plateau2_s: float = 600.0
    ramp_down_s: float = 600.0
    tail_s: float = 1500.0
    # Autoscaling spec (camelCase as in spec.autoscaling).
    autoscaling: dict[str, Any] = field(default_factory=lambda: {
        "minReplicas": 1, "maxReplicas": 12, "targetKVCacheUsage": 0.8, "targetWaitingPerReplica": 5,
        "intervalSeconds": 15, "scaleUpStabilizationSeconds": 0, "scaleDownStabilizationSeconds": 300})
    seed: int = 1
    arrival_signal: bool = True      # the router's arrival rate reaches the Observation (False: queue only)

    @property
    def phases(self) -> list[tuple[str, float, float]]:
        """(name, start, end) of each phase of the trace."""
        out, t = [], 0.0
        for name, length in (("base", self.base_s), ("ramp up", self.ramp_s), ("plateau", self.plateau_s),
                             ("spike", self.spike_s), ("plateau 2", self.plateau2_s),
                             ("ramp down", self.ramp_down_s), ("tail", self.tail_s)):
            out.append((name, t, t + length))
            t += length
        return out

    @property
    def duration(self) -> float:
        return self.phases[-1][2]

    def rate(self, t: float) -> float:
        for name, start, end in self.phases:
            if start <= t < end:
                x = (t - start) / (end - start)
                return {"base": self.base_rate, "tail": self.base_rate, "plateau": self.plateau_rate,
                        "plateau 2": self.plateau_rate, "spike": self.spike_rate,
                        "ramp up": self.base_rate + x * (self.plateau_rate - self.base_rate),
                        "ramp down": self.plateau_rate + x * (self.base_rate - self.plateau_rate)}[name]
        return 0.0

    def engine_capacity(self) -> float:
        """Requests/s one engine finishes when it runs at the target KV usage (the oracle's unit)."""
        target = self.autoscaling["targetKVCacheUsage"]
        # Mean blocks a running sequence holds: its prompt plus half its generation, half a block slack.
        blocks = (self.prompt_mean + self.gen_mean / 2) / self.block_size + 0.5
        running = min(self.max_num_seqs, target * self.kv_blocks / blocks)
        seconds = self.prompt_mean / self.prefill_tok_s + self.gen_mean * (
            self.step_base_s + self.step_per_seq_s * running)
        return running / seconds


QUICK = dict(startup_s=30.0, base_s=150.0, ramp_s=240.0, plateau_s=420.0, spike_s=90.0, plateau2_s=150.0,
             ramp_down_s=150.0, tail_s=420.0,
             autoscaling={"minReplicas": 1, "maxReplicas": 12, "targetKVCacheUsage": 0.8,
                          "targetWaitingPerReplica": 5, "intervalSeconds": 5, "scaleUpStabilizationSeconds": 0,
                          "scaleDownStabilizationSeconds": 120})


@dataclass
class _Request:
    arrival: float
    prompt: int
    gen: int
    generated: float = 0.0
    prefill_left: float = 0.0
    first_token: float | None = None
    counted: bool = False

    def blocks(self, block_size: int) -> int:
        return math.ceil((self.prompt + int(self.generated) + 1) / block_size)


@dataclass
class _Engine:
    ready_at: float
    draining: bool = False
    waiting: deque = field(default_factory=deque)    # dispatched by the router, not admitted yet
    running: list = field(default_factory=list)
    used_blocks: int = 0

    def open(self) -> int:
        return len(self.waiting) + len(self.running)


@dataclass
class _Counters:
    preemptions: int = 0
    finished: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0


def _lengths(rng: random.Random, mean: float, sigma: float = 0.6) -> int:
    mu = math.log(mean) - sigma * sigma / 2          # log-normal with the given mean
    return max(1, int(rng.lognormvariate(mu, sigma)))


def _step_engine(e: _Engine, cfg: SimConfig, now: float, dt: float, c: _Counters) -> None:
    # Admit while a slot is free and the prompt's blocks fit (1 % watermark kept for growth).
    watermark = max(1, cfg.kv_blocks // 100)
    while e.waiting and len(e.running) < cfg.max_num_seqs:
        r = e.waiting[0]
        need = r.blocks(cfg.block_size)
        if e.used_blocks + need > cfg.kv_blocks - watermark:
            break
        e.waiting.popleft()
        e.used_blocks += need
        r.prefill_left = (r.prompt + int(r.generated)) / cfg.prefill_tok_s
        e.running.append(r)
    if not e.running:
        return
    step = cfg.step_base_s + cfg.step_per_seq_s * len(e.running)
    i = 0
    while i < len(e.running):
        r = e.running[i]
        budget = dt
        if r.prefill_left > 0:
            spent = min(budget, r.prefill_left)
            r.prefill_left -= spent
            budget -= spent
        if budget > 0:
            before = r.blocks(cfg.block_size)
            if r.first_token is None and r.generated + budget / step >= 1:
                r.first_token = now + (dt - budget) + (1 - r.generated) * step
            r.generated = min(r.gen, r.generated + budget / step)
            grow = r.blocks(cfg.block_size) - before
            while grow > 0 and e.used_blocks + grow > cfg.kv_blocks:
                # Out of blocks: preempt the newest other sequence (recompute), as vLLM does.
                victim = e.running[-1] if e.running[-1] is not r else (e.running[-2] if len(e.running) > 1 else None)
                if victim is None:
                    break
                e.running.remove(victim)
                e.used_blocks -= victim.blocks(cfg.block_size)
                victim.generated = 0.0
                e.waiting.appendleft(victim)
                c.preemptions += 1
                i = e.running.index(r)
            e.used_blocks += max(0, grow)
        if r.generated >= r.gen:
            e.running.pop(i)
            e.used_blocks -= r.blocks(cfg.block_size)
            c.finished += 1
            c.prompt_tokens += r.prompt
            c.generation_tokens += r.gen
            continue
        i += 1


def _arrivals(rng: random.Random, lam: float) -> int:
    """A Poisson draw (Knuth's method: fine for the small rates here)."""
    n = 0
    threshold, p = math.exp(-lam), 1.0
    while True:
        p *= rng.random()
        if p <= threshold:
            return n
        n += 1


def _dispatch(router: deque[_Request], engines: list[_Engine], cfg: SimConfig, t: float) -> None:
    """The router hands queued requests to the least loaded ready engine with a free slot."""
    ready = [e for e in engines if e.ready_at <= t and not e.draining]
    while router and ready:
        target = min(ready, key=lambda e: e.open())
        if target.open() >= cfg.max_num_seqs:
            break
        target.waiting.append(router.popleft())


def _observe(engines: list[_Engine], router: deque[_Request], cfg: SimConfig, t: float,
             inc: _Counters, arrival_rate: float) -> Observation:
    ready = [e for e in engines if e.ready_at <= t and not e.draining]
    routers = 1 if cfg.arrival_signal else 0
    rate = round(arrival_rate, 6) if cfg.arrival_signal else 0.0
    if not ready:
        return Observation(t, 0, 0.0, len(router), 0, arrival_rate=rate, routers=routers)
    # The router queues in front of the engines: its queue counts as waiting (docs/autoscaling.md).
    kv = min(1.0, sum(e.used_blocks for e in ready) / len(ready) / cfg.kv_blocks)
    return Observation(t, len(ready), kv, sum(len(e.waiting) for e in ready) + len(router),
                       sum(len(e.running) for e in ready), cfg.max_num_seqs, cfg.block_size,
                       float(inc.preemptions), 0.0, float(inc.finished), float(inc.prompt_tokens),
                       float(inc.generation_tokens), rate, routers)


def _resize(engines: list[_Engine], desired: int, current: int, cfg: SimConfig, t: float) -> None:
    if desired > current:
        engines += [_Engine(ready_at=t + cfg.startup_s) for _ in range(desired - current)]
    elif desired < current:
        # Remove the least loaded (starting ones first): they drain, taking no new requests.
        live = sorted((e for e in engines if not e.draining), key=lambda e: (e.ready_at <= t, e.open()))
        for e in live[: current - desired]:
            e.draining = True
            if e.ready_at > t:
                engines.remove(e)


def _summary(cfg: SimConfig, policy: AutoscalingPolicy, events: list[dict[str, Any]],
             timeline: list[dict[str, Any]], waits: list[float], counters: _Counters, capacity: float,
             provisioned_s: float, oracle_s: float) -> dict[str, Any]:
    phases = {name: (start, end) for name, start, end in cfg.phases}
    spike_start, spike_end = phases["spike"]
    plateau_settled = phases["plateau"][0] + policy.scale_down_stabilization_s + policy.stable_window
    need_spike = max(policy.min_replicas, math.ceil(cfg.spike_rate / capacity))
    first_up = next((e["t"] for e in events if e["t"] >= spike_start and e["to"] > e["from"]), None)
    capacity_at = next((r["t"] for r in timeline if r["t"] >= spike_start
                        and r["ready"] >= min(need_spike, policy.max_replicas)), None)
    waits = sorted(waits)
    # The spike's peak: replicas asked for from its start until the scale-down window after it has passed.
    peak = max(r["replicas"] for r in timeline
               if spike_start <= r["t"] <= spike_end + policy.scale_down_stabilization_s)
    return {
        "engine_capacity_req_s": round(capacity, 3),
        "replica_seconds": provisioned_s, "oracle_replica_seconds": oracle_s,
        "over_provisioning": round(provisioned_s / oracle_s - 1, 4),
        "spike_start": spike_start,
        "spike_decision_s": None if first_up is None else first_up - spike_start,
        "spike_capacity_s": None if capacity_at is None else capacity_at - spike_start,
        "spike_replicas_needed": need_spike,
        "spike_peak_replicas": peak,
        "spike_peak_vs_needed": round(peak / need_spike, 3),
        "scale_events": len(events),
        # Once the ramp's leftovers have aged out of the down window, a steady plateau moves nothing.
        "plateau_settled_from": plateau_settled,
        "plateau_scale_events": sum(1 for e in events if plateau_settled <= e["t"] < spike_start),
        "max_replicas": max(r["replicas"] for r in timeline),
        "final_replicas": timeline[-1]["replicas"],
        "preemptions": counters.preemptions, "finished": counters.finished,
        "ttft_p50_s": waits[len(waits) // 2] if waits else None,
        "ttft_p95_s": waits[int(len(waits) * 0.95)] if waits else None,
    }


def simulate(cfg: SimConfig) -> dict[str, Any]:
    """Run the trace; returns the timeline (one row per scrape), the events and the summary numbers."""
    rng = random.Random(cfg.seed)
    policy = AutoscalingPolicy.from_spec(cfg.autoscaling)
    interval = policy.interval_s
    dt = 1.0
    engines = [_Engine(ready_at=-math.inf) for _ in range(max(1, policy.min_replicas))]
    router: deque[_Request] = deque()
    counters, last = _Counters(), _Counters()
    state = AutoscalerState()
    window: list[Observation] = []
    timeline: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    waits: list[float] = []
    provisioned_s = oracle_s = 0.0
    capacity = cfg.engine_capacity()
    next_scrape = interval
    t = 0.0
    clock = [0.0]
    arrivals = ArrivalRate(clock=lambda: clock[0])
    while t < cfg.duration:
        # Arrivals of this second, queued at the router (and counted by its arrival-rate gauge).
        n = _arrivals(rng, cfg.rate(t) * dt)
        for i in range(n):
            router.append(_Request(t, _lengths(rng, cfg.prompt_mean), _lengths(rng, cfg.gen_mean)))
            clock[0] = t + (i + 0.5) * dt / n
            arrivals.add()
        _dispatch(router, engines, cfg, t)
        for e in engines:
            if e.ready_at <= t:
                _step_engine(e, cfg, t, dt, counters)
        for e in engines:
            for r in e.running:
                if r.first_token is not None and not r.counted:
                    r.counted = True
                    waits.append(r.first_token - r.arrival)
        engines = [e for e in engines if not (e.draining and e.open() == 0)]
        provisioned_s += sum(1 for e in engines) * dt
        oracle_s += max(policy.min_replicas, math.ceil(cfg.rate(t) / capacity)) * dt
        t += dt
        if t < next_scrape:
            continue
        next_scrape += interval
        ready = [e for e in engines if e.ready_at <= t and not e.draining]
        current = sum(1 for e in engines if not e.draining)
        inc = _Counters(counters.preemptions - last.preemptions, counters.finished - last.finished,
                        counters.prompt_tokens - last.prompt_tokens,
                        counters.generation_tokens - last.generation_tokens)
        last = _Counters(**asdict(counters))
        clock[0] = t
        obs = _observe(engines, router, cfg, t, inc, arrivals.rate())
        window = trim([*window, obs], policy, t)
        d = decide(policy, window, current, state, t)
        state = AutoscalerState.from_json(json.loads(json.dumps(d.state.to_json())))
        _resize(engines, d.desired, current, cfg, t)
        if d.desired != current:
            events.append({"t": t, "from": current, "to": d.desired, "panic": d.panic, "reason": d.reason})
        rate = cfg.rate(t - dt)     # the rate of the second just simulated
        timeline.append({"t": t, "replicas": d.desired, "ready": len(ready), "rate": rate,
                         "oracle": max(policy.min_replicas, math.ceil(rate / capacity)),
                         "kv": obs.kv_cache_usage, "waiting": obs.waiting, "running": obs.running,
                         "preemptions": inc.preemptions, "panic": d.panic, "frozen": d.frozen,
                         "limited": d.limited})
    summary = _summary(cfg, policy, events, timeline, waits, counters, capacity, provisioned_s, oracle_s)
    return {"config": asdict(cfg), "phases": cfg.phases, "summary": summary, "events": events,
            "timeline": timeline}


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = result["timeline"]
    t = [r["t"] / 60 for r in tl]
    fig, axes = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    ax = axes[0]
    ax.step(t, [r["replicas"] for r in tl], where="post", label="replicas (desired)")
    ax.step(t, [r["ready"] for r in tl], where="post", label="ready engines", alpha=0.7)
    ax.step(t, [r["oracle"] for r in tl], where="post", label="oracle minimum", linestyle="--", color="grey")
    ax2 = ax.twinx()
    ax2.plot(t, [r["rate"] for r in tl], color="tab:red", alpha=0.3, label="arrival rate (req/s)")
    ax2.set_ylabel("req/s")
    panics = [e["t"] / 60 for e in result["events"] if e["panic"]]
    for i, x in enumerate(panics):
        ax.axvline(x, color="tab:red", alpha=0.35, linestyle=":", label="panic scale-up" if i == 0 else None)
    ax.set_ylabel("replicas")
    ax.legend(loc="upper left", fontsize=8)
    ax2.legend(loc="upper right", fontsize=8)
    target = result["config"]["autoscaling"]["targetKVCacheUsage"]
    axes[1].plot(t, [r["kv"] for r in tl], label="mean KV cache usage")
    axes[1].axhline(target, color="grey", linestyle="--", label=f"target {target}")
    axes[1].set_ylim(0, 1.05)
    axes[1].set_ylabel("KV usage")
    axes[1].legend(loc="upper left", fontsize=8)
    axes[2].plot(t, [r["waiting"] for r in tl], label="waiting (engines + router)")
    axes[2].plot(t, [r["running"] for r in tl], label="running", alpha=0.7)
    axes[2].set_yscale("symlog", linthresh=10)
    axes[2].set_ylabel("requests (symlog)")
    axes[2].set_xlabel("minutes")
    axes[2].legend(loc="upper left", fontsize=8)
    for name, start, end in result["phases"]:
        for a in axes:
            a.axvline(start / 60, color="black", alpha=0.08)
        axes[0].text((start + end) / 120, axes[0].get_ylim()[1] * 0.95, name, ha="center", fontsize=7, alpha=0.6)
    s = result["summary"]
    fig.suptitle(f"autoscaler simulation: over-provisioning {s['over_provisioning']:+.0%} vs oracle, "
                 f"spike: decision {s['spike_decision_s']:.0f} s, capacity {s['spike_capacity_s']:.0f} s, "
                 f"{s['scale_events']} scale events", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(result: dict[str, Any]) -> str:
    s = result["summary"]
    cfg = result["config"]
    lines = [
        f"engine capacity at target KV {cfg['autoscaling']['targetKVCacheUsage']}: {s['engine_capacity_req_s']} req/s; "
        f"startup {cfg['startup_s']:g} s; interval {cfg['autoscaling']['intervalSeconds']} s",
        f"replica-seconds {s['replica_seconds']:.0f} vs oracle {s['oracle_replica_seconds']:.0f}: "
        f"over-provisioning {s['over_provisioning']:+.1%}",
        f"spike at {s['spike_start']:.0f} s needs {s['spike_replicas_needed']} replicas: first scale-up decision after "
        f"{s['spike_decision_s']} s, enough ready engines after {s['spike_capacity_s']} s; peak "
        f"{s['spike_peak_replicas']} replicas ({s['spike_peak_vs_needed']:.2f}x the need)",
        f"scale events {s['scale_events']} (on the plateau once settled, from {s['plateau_settled_from']:.0f} s: "
        f"{s['plateau_scale_events']}); "
        f"max replicas {s['max_replicas']}, final {s['final_replicas']}",
        f"finished {s['finished']}, preemptions {s['preemptions']}, "
        f"TTFT p50 {s['ttft_p50_s']:.2f} s, p95 {s['ttft_p95_s']:.2f} s",
        "events:",
    ]
    lines += [f"  {e['t']:7.0f} s  {e['from']:2d} -> {e['to']:2d}{'  PANIC' if e['panic'] else ''}  {e['reason']}"
              for e in result["events"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="short trace (a few seconds), for the test")
    ap.add_argument("--plot", default=None, help="PNG path (default docs/autoscale_sim.png; none with --quick)")
    ap.add_argument("--json", default=None, help="write the full result here")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--signal", choices=("arrival", "queue"), default="arrival",
                    help="scale up on the router's arrival rate (default) or on its queue only")
    args = ap.parse_args(argv)
    cfg = SimConfig(seed=args.seed, arrival_signal=args.signal == "arrival", **(QUICK if args.quick else {}))
    result = simulate(cfg)
    print(report(result))
    path = args.plot if args.plot is not None else (None if args.quick else "docs/autoscale_sim.png")
    if path:
        plot(result, path)
        print(f"plot: {path}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
