"""The engine tuner: a pure policy from a window of observations to better engine flags.

It proposes `maxNumSeqs` and `blockSize` from live load, applies a proposal at most once per cooldown
(mode Auto) and reverts a change that measurably hurt. No I/O, no clock reads. Rules and constants are
documented in docs/autoscaling.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from .observation import Observation

MODES = ("Off", "Recommend", "Auto")
DEFAULT_BLOCK_SIZES = (8, 16, 32)
TUNED_FIELDS = ("maxNumSeqs", "blockSize")


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

    def __post_init__(self) -> None:
        raise_ = _raiser("tuning policy")
        if self.mode not in MODES:
            raise_(f"mode must be one of {list(MODES)}, not {self.mode!r}")
        for name in ("min_max_num_seqs", "max_max_num_seqs", "min_scrapes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise_(f"{name} must be an integer >= 1, not {v!r}")
        if self.min_max_num_seqs > self.max_max_num_seqs:
            raise_(f"maxNumSeqs min ({self.min_max_num_seqs}) must not exceed max ({self.max_max_num_seqs})")
        if not self.block_sizes or any(isinstance(b, bool) or not isinstance(b, int) or b < 1
                                       or b & (b - 1) for b in self.block_sizes):
            raise_(f"block_sizes must be a non-empty list of powers of two, not {self.block_sizes!r}")
        for name in ("cooldown_s", "window"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise_(f"{name} must be a number >= 0, not {v!r}")
        object.__setattr__(self, "block_sizes", tuple(sorted(set(self.block_sizes))))

    @classmethod
    def from_spec(cls, tuning: dict[str, Any], engine: dict[str, Any]) -> "TuningPolicy":
        """From spec.tuning and spec.engine (camelCase, CRD defaults filled).

        Without spec.tuning.maxNumSeqs the bounds are [current / 4, current * 4] (at least 1, at most
        4096, the CRD's limit): far enough to fix a badly chosen value, near enough that one bad
        judgement cannot starve or flood an engine.
        """
        if not isinstance(tuning, dict) or not isinstance(engine, dict):
            raise ValueError("spec.tuning and spec.engine must be objects")
        current = engine.get("maxNumSeqs")
        if isinstance(current, bool) or not isinstance(current, int) or current < 1:
            raise ValueError(f"spec.engine.maxNumSeqs must be an integer >= 1, not {current!r}")
        rng = tuning.get("maxNumSeqs")
        if rng is None:
            lo, hi = max(1, current // 4), min(4096, current * 4)
        elif isinstance(rng, dict) and "min" in rng and "max" in rng:
            lo, hi = rng["min"], rng["max"]
        else:
            raise ValueError("spec.tuning.maxNumSeqs needs integer min and max")
        sizes = tuning.get("blockSizes", list(DEFAULT_BLOCK_SIZES))
        if not isinstance(sizes, (list, tuple)):
            raise ValueError(f"spec.tuning.blockSizes must be a list, not {sizes!r}")
        return cls(mode=tuning.get("mode", "Off"), min_max_num_seqs=lo, max_max_num_seqs=hi,
                   block_sizes=tuple(sizes), cooldown_s=tuning.get("cooldownSeconds", 1800))

    def window_s(self) -> float:
        """How far back observations are needed (the operator keeps max of this and the autoscaler's)."""
        return self.window


def _raiser(what: str):
    def raise_(msg: str) -> None:
        raise ValueError(f"{what}: {msg}")
    return raise_


@dataclass(frozen=True)
class TunerState:
    """Persisted in status; survives operator restarts so a cooldown is never forgotten."""

    last_change_time: float | None = None
    last_change: dict[str, list[int]] | None = None  # {"maxNumSeqs": [old, new], ...} of the last APPLIED change
    baseline: dict[str, float] | None = None         # load/health summary before that change
    reverted: bool = False                           # the last change was a revert
    settled_time: float | None = None                # first pass after the change with the rollout done
    judged: bool = False                             # the last change has been judged (kept or reverted)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.last_change_time is not None:
            out["lastChangeTime"] = round(self.last_change_time, 3)
        if self.last_change is not None:
            out["lastChange"] = {k: list(v) for k, v in self.last_change.items()}
        if self.baseline is not None:
            out["baseline"] = dict(self.baseline)
        if self.reverted:
            out["reverted"] = True
        if self.settled_time is not None:
            out["settledTime"] = round(self.settled_time, 3)
        if self.judged:
            out["judged"] = True
        return out

    @classmethod
    def from_json(cls, raw: dict[str, Any] | None) -> "TunerState":
        """Tolerant: unreadable parts are dropped (a lost baseline means the change is not judged)."""
        if not isinstance(raw, dict):
            return cls()
        t = raw.get("lastChangeTime")
        change = raw.get("lastChange")
        if isinstance(change, dict) and change and all(
                k in TUNED_FIELDS and isinstance(v, list) and len(v) == 2 and all(_is_int(x) and x > 0 for x in v)
                for k, v in change.items()):
            last_change: dict[str, list[int]] | None = {k: [int(v[0]), int(v[1])] for k, v in change.items()}
        else:
            last_change = None
        base = raw.get("baseline")
        baseline = ({k: float(v) for k, v in base.items()} if isinstance(base, dict) and base
                    and all(isinstance(k, str) and _finite(v) for k, v in base.items()) else None)
        settled = raw.get("settledTime")
        return cls(last_change_time=float(t) if _finite(t) else None, last_change=last_change, baseline=baseline,
                   reverted=raw.get("reverted") is True, settled_time=float(settled) if _finite(settled) else None,
                   judged=raw.get("judged") is True)


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class TuningDecision:
    recommendation: dict[str, int]   # engine fields (camelCase) -> proposed value; {} when none
    reason: str                       # words with numbers
    apply: bool                       # Auto mode and allowed now
    revert: bool                      # the last applied change measurably hurt; recommendation = old values
    held: str | None                  # why a recommendation is not applied now
    state: TunerState


def tune(policy: TuningPolicy, window: Sequence[Observation], engine: dict[str, Any], state: TunerState,
         now: float, *, rolling_out: bool = False, panicking: bool = False) -> TuningDecision:
    """Recommend (and in Auto mode apply or revert) engine flags; see docs/autoscaling.md."""
    raise NotImplementedError
