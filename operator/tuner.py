"""The engine tuner: a pure policy from a window of observations to better engine flags.

It proposes `maxNumSeqs` and `blockSize` from live load, applies a proposal at most once per cooldown
(mode Auto) and reverts a change that measurably hurt. No I/O, no clock reads. Rules and constants are
documented in docs/autoscaling.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Any, Sequence

from .observation import Observation
from .spec import CPU_BLOCK_SIZE
from .validation import check_int, check_number, failer, finite, is_int

MODES = ("Off", "Recommend", "Auto")
DEFAULT_BLOCK_SIZES = (8, 16, 32)
# On CPU the block size sets decode attention's read length (docs/engine.md, KV cache): the tuner keeps
# the 128-token default unless spec.tuning.blockSizes lists others.
CPU_DEFAULT_BLOCK_SIZES = (CPU_BLOCK_SIZE,)
TUNED_FIELDS = ("maxNumSeqs", "blockSize")

# Rule constants (docs/autoscaling.md explains each).
SLOTS_FULL = 0.95          # running / (engines x maxNumSeqs) at or above this: slots are the cap
KV_HEADROOM = 0.6          # ... while mean KV usage stays at or below this: memory is not the cap
KV_AIM = 0.8               # a raise aims the KV usage here (the seeds' 80 %)
MAX_RAISE = 2.0            # at most double per change
MIN_RAISE = 1.25           # smaller raises are not worth a rolling restart (hysteresis)
THRASH_MIN_EVENTS = 3      # preemptions + swap-outs in the window before it counts as thrash...
THRASH_SHARE = 0.05        # ... and at least this share of the finished requests
LOWER_TO = 0.75            # a thrash fix caps concurrency at this share of the peak running per engine
TOKENS_PER_BLOCK_WASTE = 16  # block b fits when the mean sequence is >= 16 b tokens (waste b/2 <= 1/32)
BLOCK_HYSTERESIS = 1.25    # the length must clear the boundary by 25 % to change the block size
WORSE_FACTOR = 1.5         # after / before above this (and above the absolute margins) is "worse"
WORSE_THRASH_PER_S = 1 / 60  # absolute margin: one more preemption per engine per minute
WORSE_WAITING = 1.0        # absolute margin: one more waiting request per engine
SAME_LOAD = 1.1            # after-load up to 10 % above the baseline still counts as equal load


@dataclass(frozen=True)
class TuningPolicy:
    """spec.tuning (with spec.engine for default bounds) plus documented constants."""

    mode: str                         # Off | Recommend | Auto
    min_max_num_seqs: int
    max_max_num_seqs: int
    block_sizes: tuple[int, ...] = DEFAULT_BLOCK_SIZES
    cooldown_s: float = 1800.0
    window: float = 300.0             # observations the tuner judges from (the operator keeps this much)
    min_scrapes: int = 4              # fewer usable scrapes: no judgement at all
    min_finished: int = 20            # finished requests needed to judge the sequence-length mix
    rejection_s: float | None = None  # a reverted direction is not proposed again for this long;
                                      # None: max(4 cooldowns, 1 h)

    def __post_init__(self) -> None:
        raise_ = failer("tuning policy")
        if self.mode not in MODES:
            raise_(f"mode must be one of {list(MODES)}, not {self.mode!r}")
        for name in ("min_max_num_seqs", "max_max_num_seqs", "min_scrapes", "min_finished"):
            check_int(raise_, name, getattr(self, name), 1)
        if self.min_max_num_seqs > self.max_max_num_seqs:
            raise_(f"maxNumSeqs min ({self.min_max_num_seqs}) must not exceed max ({self.max_max_num_seqs})")
        if not self.block_sizes or any(not is_int(b) or b < 1
                                       or b & (b - 1) for b in self.block_sizes):
            raise_(f"block_sizes must be a non-empty list of powers of two, not {self.block_sizes!r}")
        if self.min_scrapes < 2:
            raise_(f"min_scrapes must be >= 2 (rates need two scrapes), not {self.min_scrapes}")
        for name in ("cooldown_s", "window", "rejection_s"):
            v = getattr(self, name)
            if v is None and name == "rejection_s":
                continue
            check_number(raise_, name, v)
        object.__setattr__(self, "block_sizes", tuple(sorted(set(self.block_sizes))))

    @classmethod
    def from_spec(cls, tuning: dict[str, Any], engine: dict[str, Any], device: str = "cuda") -> "TuningPolicy":
        """From spec.tuning and spec.engine (camelCase, CRD defaults filled), for engines on `device`
        (`cpu` or `cuda`, resolved): without spec.tuning.blockSizes the candidates are
        DEFAULT_BLOCK_SIZES on GPUs and CPU_DEFAULT_BLOCK_SIZES on CPU.

        Without spec.tuning.maxNumSeqs the bounds are [current / 4, current * 4] (at least 1, at most
        4096, the CRD's limit): far enough to fix a badly chosen value, near enough that one bad
        judgement cannot starve or flood an engine.
        """
        if not isinstance(tuning, dict) or not isinstance(engine, dict):
            raise ValueError("spec.tuning and spec.engine must be objects")
        current = engine.get("maxNumSeqs")
        if not is_int(current) or current < 1:
            raise ValueError(f"spec.engine.maxNumSeqs must be an integer >= 1, not {current!r}")
        rng = tuning.get("maxNumSeqs")
        if rng is None:
            lo, hi = max(1, current // 4), min(4096, current * 4)
        elif isinstance(rng, dict) and "min" in rng and "max" in rng:
            lo, hi = rng["min"], rng["max"]
        else:
            raise ValueError("spec.tuning.maxNumSeqs needs integer min and max")
        sizes = tuning.get("blockSizes", list(CPU_DEFAULT_BLOCK_SIZES if device == "cpu" else DEFAULT_BLOCK_SIZES))
        if not isinstance(sizes, (list, tuple)):
            raise ValueError(f"spec.tuning.blockSizes must be a list, not {sizes!r}")
        return cls(mode=tuning.get("mode", "Off"), min_max_num_seqs=lo, max_max_num_seqs=hi,
                   block_sizes=tuple(sizes), cooldown_s=tuning.get("cooldownSeconds", 1800))

    def window_s(self) -> float:
        """How far back observations are needed (the operator keeps max of this and the autoscaler's)."""
        return self.window

    @property
    def rejection(self) -> float:
        return self.rejection_s if self.rejection_s is not None else max(4 * self.cooldown_s, 3600.0)


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class TunerState:
    """Persisted in status; survives operator restarts so a cooldown or a pending judgement is never lost."""

    last_change_time: float | None = None
    last_change: dict[str, list[int]] | None = None  # {"maxNumSeqs": [old, new], ...} of the last APPLIED change
    baseline: dict[str, float] | None = None         # load/health summary before that change
    reverted: bool = False                           # the last change was a revert
    settled_time: float | None = None                # first pass after the change with its rollout done
    judged: bool = False                             # the last change has been judged (kept or reverted)
    change_kind: str | None = None                   # why it was made: "slots", "thrash", "blocks" joined by +
    rejected: dict[str, int] | None = None           # field -> value a revert took back
    rejected_until: float | None = None              # ... not proposed again in that direction before this

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in (("lastChangeTime", self.last_change_time), ("settledTime", self.settled_time),
                           ("rejectedUntil", self.rejected_until)):
            if value is not None:
                out[key] = value      # unrounded: the state round-trips exactly
        if self.last_change is not None:
            out["lastChange"] = {k: list(v) for k, v in self.last_change.items()}
        if self.baseline is not None:
            out["baseline"] = dict(self.baseline)
        if self.change_kind is not None:
            out["changeKind"] = self.change_kind
        if self.rejected is not None:
            out["rejected"] = dict(self.rejected)
        if self.reverted:
            out["reverted"] = True
        if self.judged:
            out["judged"] = True
        return out

    @classmethod
    def from_json(cls, raw: dict[str, Any] | None) -> "TunerState":
        """Tolerant: unreadable parts are dropped (a lost baseline means the change is not judged)."""
        if not isinstance(raw, dict):
            return cls()

        def num(key: str) -> float | None:
            v = raw.get(key)
            return float(v) if finite(v) else None
        change = raw.get("lastChange")
        last_change = ({k: [int(v[0]), int(v[1])] for k, v in change.items()}
                       if isinstance(change, dict) and change and all(
                           k in TUNED_FIELDS and isinstance(v, list) and len(v) == 2
                           and all(is_int(x) and x > 0 for x in v) for k, v in change.items()) else None)
        base = raw.get("baseline")
        baseline = ({k: float(v) for k, v in base.items()} if isinstance(base, dict) and base
                    and all(isinstance(k, str) and finite(v) for k, v in base.items()) else None)
        rej = raw.get("rejected")
        rejected = ({k: int(v) for k, v in rej.items()} if isinstance(rej, dict) and rej
                    and all(k in TUNED_FIELDS and is_int(v) and v > 0 for k, v in rej.items()) else None)
        kind = raw.get("changeKind")
        return cls(last_change_time=num("lastChangeTime"), last_change=last_change, baseline=baseline,
                   reverted=raw.get("reverted") is True, settled_time=num("settledTime"),
                   judged=raw.get("judged") is True, change_kind=kind if isinstance(kind, str) else None,
                   rejected=rejected, rejected_until=num("rejectedUntil"))


@dataclass(frozen=True)
class TuningDecision:
    recommendation: dict[str, int]   # engine fields (camelCase) -> proposed value; {} when none
    reason: str                       # words with numbers
    apply: bool                       # Auto mode and allowed now
    revert: bool                      # the last applied change measurably hurt; recommendation = old values
    held: str | None                  # why a recommendation is not applied now
    state: TunerState


@dataclass(frozen=True)
class _Summary:
    """Load and health of a stretch of observations, per engine so replica changes do not skew it."""

    load: float        # prompt + generation tokens of finished requests per second per engine
    thrash: float      # preemptions + swap-outs per second per engine
    waiting: float     # mean waiting requests per engine
    kv: float          # mean KV usage
    engines: float     # mean engines answering

    def to_json(self) -> dict[str, float]:
        return {"load": self.load, "thrash": self.thrash, "waiting": self.waiting, "kvCacheUsage": self.kv,
                "engines": self.engines}

    @classmethod
    def from_json(cls, raw: dict[str, float]) -> "_Summary | None":
        try:
            return cls(raw["load"], raw["thrash"], raw["waiting"], raw["kvCacheUsage"], raw["engines"])
        except KeyError:
            return None

    def __str__(self) -> str:
        return (f"{self.load:.0f} tok/s, {self.thrash * 60:.1f} preemptions/min, {self.waiting:.1f} waiting, "
                f"kv {self.kv:.2f} per engine")


def _summarize(obs: Sequence[Observation]) -> _Summary:
    # Counter fields are increments since the previous scrape, so the first one in the window covers
    # time before it: rates use the rest over the window's span.
    span = obs[-1].time - obs[0].time
    engines = sum(o.engines for o in obs) / len(obs)
    rest = obs[1:]
    per = span * engines if span > 0 else math.inf   # scrapes all at one instant: no rate to read
    return _Summary(load=sum(o.prompt_tokens + o.generation_tokens for o in rest) / per,
                    thrash=sum(o.thrash_events for o in rest) / per,
                    waiting=sum(o.waiting_per_engine for o in obs) / len(obs),
                    kv=sum(o.kv_cache_usage for o in obs) / len(obs), engines=engines)


def _worse(before: _Summary, after: _Summary, kind: str) -> str | None:
    """What got measurably worse at equal or lower load, in words; None if nothing did."""
    if after.load > before.load * SAME_LOAD + 1e-9:
        return None
    worse = []
    if after.thrash > before.thrash * WORSE_FACTOR and after.thrash - before.thrash >= WORSE_THRASH_PER_S:
        worse.append(f"preemptions {before.thrash * 60:.1f} -> {after.thrash * 60:.1f}/min per engine")
    # A thrash fix trades some queueing for no recomputation: more waiting is its expected price
    # as long as the thrash it was made for went away.
    excused = "thrash" in kind and after.thrash <= before.thrash / 2
    if (not excused and after.waiting > before.waiting * WORSE_FACTOR
            and after.waiting - before.waiting >= WORSE_WAITING):
        worse.append(f"waiting {before.waiting:.1f} -> {after.waiting:.1f} per engine")
    return "; ".join(worse) or None


def _round8(n: float, up: bool) -> int:
    """Round to a multiple of 8 (batch sizes the kernels like) once past 16."""
    if n < 16:
        return max(1, math.ceil(n) if up else math.floor(n))
    return 8 * (math.ceil(n / 8) if up else math.floor(n / 8))


def _pick_block(length: float, sizes: tuple[int, ...]) -> int:
    fitting = [b for b in sizes if TOKENS_PER_BLOCK_WASTE * b <= length]
    return max(fitting) if fitting else min(sizes)


def _engine_int(engine: dict[str, Any], key: str) -> int:
    v = engine.get(key)
    if not is_int(v) or v < 1:
        raise ValueError(f"engine.{key} must be an integer >= 1, not {v!r}")
    return v


def tune(policy: TuningPolicy, window: Sequence[Observation], engine: dict[str, Any], state: TunerState,
         now: float, *, rolling_out: bool = False, panicking: bool = False) -> TuningDecision:
    """Recommend (and in Auto mode apply or revert) engine flags; the rules are in docs/autoscaling.md.

    `engine` is the effective engine config (camelCase, including earlier tuner changes). When
    `apply` is True the returned state already records the change as applied: the operator must roll
    it out (or not persist that state).
    """
    if not finite(now):
        raise ValueError(f"now must be a finite number, not {now!r}")
    if not isinstance(engine, dict):
        raise ValueError(f"engine must be an object, not {type(engine).__name__}")
    current = {"maxNumSeqs": _engine_int(engine, "maxNumSeqs"), "blockSize": _engine_int(engine, "blockSize")}
    if policy.mode == "Off":
        return TuningDecision({}, "tuning is Off", False, False, None, state)

    obs = sorted((o for o in window if now - policy.window < o.time <= now and o.engines > 0),
                 key=lambda o: o.time)

    # 1. A change we applied is judged before anything new is proposed: one experiment at a time.
    if state.last_change and not state.judged:
        verdict = _judge(policy, obs, current, state, now, rolling_out=rolling_out, panicking=panicking)
        if isinstance(verdict, TuningDecision):
            return verdict
        return _propose(policy, obs, current, replace(state, judged=True), now, rolling_out, panicking,
                        prefix=verdict)
    return _propose(policy, obs, current, state, now, rolling_out, panicking, prefix="")


def _judge(policy: TuningPolicy, obs: list[Observation], current: dict[str, int], state: TunerState, now: float,
           *, rolling_out: bool, panicking: bool) -> TuningDecision | str:
    """A decision while the last change is under judgement, or (once it is kept) a note for the reason."""
    change = state.last_change or {}
    desc = ", ".join(f"{k} {old} -> {new}" for k, (old, new) in change.items())
    if any(current[k] == old != new for k, (old, new) in change.items()) and \
            all(current[k] in (old, new) for k, (old, new) in change.items()):
        # Applied but not in the config yet (the override not written, a failed patch): wait, but not
        # forever, or one lost write would stop the tuner for good.
        if state.last_change_time is not None and now - state.last_change_time > max(policy.cooldown_s,
                                                                                      policy.window):
            return f"the change {desc} never took effect; not judging it; "
        return _hold(state, f"the change {desc} is not in effect yet")
    if any(current[k] != new for k, (_, new) in change.items()):
        return f"the engine config moved on from {desc}; not judging it; "
    if state.reverted or state.baseline is None:
        return ""   # a revert restores a known state; a lost baseline cannot be judged
    if rolling_out:
        return _hold(replace(state, settled_time=None), f"judging {desc} waits for its rollout")
    settled = state.settled_time if state.settled_time is not None else now
    state = replace(state, settled_time=settled)
    # Only scrapes of engines that run the new config (when they report it) count as "after".
    after_obs = [o for o in obs if o.time > settled
                 and (not o.max_num_seqs or o.max_num_seqs == current["maxNumSeqs"])
                 and (not o.block_size or o.block_size == current["blockSize"])]
    before = _Summary.from_json(state.baseline)
    if before is None:
        return ""
    if len(after_obs) < policy.min_scrapes:
        return _hold(state, f"judging {desc}: {len(after_obs)} of {policy.min_scrapes} scrapes since the rollout")
    after = _summarize(after_obs)
    worse = _worse(before, after, state.change_kind or "")
    if worse is None:
        if after.load > before.load * SAME_LOAD and _worse(replace(before, load=after.load), after,
                                                           state.change_kind or ""):
            # Worse but under more load: not comparable. Keep watching until the cooldown ends.
            if state.last_change_time is not None and now < state.last_change_time + policy.cooldown_s:
                return _hold(state, f"judging {desc}: load rose ({before.load:.0f} -> {after.load:.0f} tok/s "
                                    "per engine), not comparable yet")
        return f"kept {desc} (before: {before}; after: {after}); "
    revert = {k: old for k, (old, _) in change.items()}
    reason = (f"revert {desc}: at equal or lower load ({before.load:.0f} -> {after.load:.0f} tok/s per engine) "
              f"{worse}")
    held = _held_reason(policy, now, state, rolling_out=False, panicking=panicking, ignore_cooldown=True)
    if held:
        return TuningDecision(revert, reason, False, True, held, state)
    new_state = TunerState(last_change_time=now, last_change={k: [new, old] for k, (old, new) in change.items()},
                           baseline=None, reverted=True, judged=True, change_kind="revert",
                           rejected={k: new for k, (_, new) in change.items()},
                           rejected_until=now + policy.rejection)
    return TuningDecision(revert, reason, True, True, None, new_state)


def _hold(state: TunerState, why: str) -> TuningDecision:
    return TuningDecision({}, why, False, False, None, state)


def _held_reason(policy: TuningPolicy, now: float, state: TunerState, *, rolling_out: bool, panicking: bool,
                 ignore_cooldown: bool = False) -> str | None:
    if policy.mode == "Recommend":
        return "mode Recommend: proposal only"
    if rolling_out:
        return "a rollout is in progress"
    if panicking:
        return "the autoscaler is panicking"
    if not ignore_cooldown and state.last_change_time is not None \
            and now < state.last_change_time + policy.cooldown_s:
        return (f"cooldown until {_iso(state.last_change_time + policy.cooldown_s)} "
                f"(cooldownSeconds {policy.cooldown_s:g} after the last change)")
    return None


def _propose(policy: TuningPolicy, obs: list[Observation], current: dict[str, int], state: TunerState,
             now: float, rolling_out: bool, panicking: bool, prefix: str) -> TuningDecision:
    if len(obs) < policy.min_scrapes:
        return _hold(state, f"{prefix}not enough data: {len(obs)} of {policy.min_scrapes} scrapes "
                            f"in the last {policy.window:g} s")
    for key, attr in (("maxNumSeqs", "max_num_seqs"), ("blockSize", "block_size")):
        reported = {getattr(o, attr) for o in obs if getattr(o, attr)}
        if reported and reported != {current[key]}:
            return _hold(state, f"{prefix}engines report {key} {sorted(reported)}, the config says {current[key]}: "
                                "waiting for them to agree")
    summary = _summarize(obs)
    rejected = state.rejected if state.rejected_until is not None and now < state.rejected_until else {}
    rec: dict[str, int] = {}
    why: list[str] = []
    kinds: list[str] = []

    msn = current["maxNumSeqs"]
    rest = obs[1:]
    events = sum(o.thrash_events for o in rest)
    finished = sum(o.finished for o in rest)
    fill = sum(o.running / (o.engines * msn) for o in obs) / len(obs)
    if events >= THRASH_MIN_EVENTS and events >= THRASH_SHARE * max(finished, 1):
        peak = max(o.running / o.engines for o in obs)
        new = max(policy.min_max_num_seqs, min(policy.max_max_num_seqs, _round8(LOWER_TO * min(msn, peak), up=False)))
        blocked = "maxNumSeqs" in rejected and rejected["maxNumSeqs"] < msn
        # A cap at or above the peak would not bind: no point restarting the engines for it.
        if new < msn and new < peak and not blocked:
            rec["maxNumSeqs"] = new
            kinds.append("thrash")
            why.append(f"memory thrash: {events:.0f} preemptions/swap-outs for {finished:.0f} finished requests; "
                       f"peak {peak:.0f} running per engine: maxNumSeqs {msn} -> {new}")
    elif fill >= SLOTS_FULL and summary.waiting >= 1 and summary.kv <= KV_HEADROOM:
        factor = min(MAX_RAISE, KV_AIM / max(summary.kv, 0.05))
        new = min(policy.max_max_num_seqs, _round8(msn * factor, up=True))
        blocked = "maxNumSeqs" in rejected and rejected["maxNumSeqs"] > msn
        if new >= msn * MIN_RAISE and not blocked:
            rec["maxNumSeqs"] = new
            kinds.append("slots")
            why.append(f"slots are the bottleneck: running at {fill:.0%} of {msn} slots per engine with "
                       f"{summary.waiting:.1f} waiting while kv usage is {summary.kv:.2f}: maxNumSeqs {msn} -> {new}")

    all_finished = sum(o.finished for o in obs)
    if all_finished >= policy.min_finished:
        length = sum(o.prompt_tokens + o.generation_tokens for o in obs) / all_finished
        b = current["blockSize"]
        up, down = _pick_block(length / BLOCK_HYSTERESIS, policy.block_sizes), \
            _pick_block(length * BLOCK_HYSTERESIS, policy.block_sizes)
        if b not in policy.block_sizes:
            new_b = _pick_block(length, policy.block_sizes)
        else:
            new_b = up if up > b else down if down < b else b
        if new_b != b and rejected.get("blockSize") != new_b:
            rec["blockSize"] = new_b
            kinds.append("blocks")
            why.append(f"mean sequence {length:.0f} tokens over {all_finished:.0f} finished requests "
                       f"({'long' if new_b > b else 'short'} for block size {b}): blockSize {b} -> {new_b}")

    if not rec:
        return _hold(state, f"{prefix}no change: {summary}, {fill:.0%} of slots busy")
    reason = prefix + "; ".join(why)
    held = _held_reason(policy, now, state, rolling_out=rolling_out, panicking=panicking)
    if held:
        return TuningDecision(rec, reason, False, False, held, state)
    new_state = TunerState(last_change_time=now, last_change={k: [current[k], v] for k, v in rec.items()},
                           baseline=summary.to_json(), change_kind="+".join(kinds),
                           rejected=state.rejected, rejected_until=state.rejected_until)
    return TuningDecision(rec, reason, True, False, None, new_state)
