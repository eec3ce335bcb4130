"""One scrape pass over a PagedModel's ready engines, as the autoscaler and the tuner read it.

The operator aggregates the per-pod samples of one pass into an `Observation` and keeps a short
window of them in the PagedModel's status, so a restarted operator resumes with the same history.
That is why the JSON form is a compact positional list: a status holding dozens of passes stays small.
"""
from __future__ import annotations

import math
from dataclasses import astuple, dataclass, fields
from typing import Any

# Order of the compact JSON list; appending a field at the end keeps old persisted windows readable
# (missing trailing entries take the field's default).
_FIELDS = ("time", "engines", "kv_cache_usage", "waiting", "running", "max_num_seqs", "block_size",
           "preemptions", "swap_outs", "finished", "prompt_tokens", "generation_tokens", "arrival_rate", "routers")
_INT_FIELDS = frozenset({"engines", "waiting", "running", "max_num_seqs", "block_size", "routers"})
_REQUIRED = 5  # time, engines, kv_cache_usage, waiting, running


@dataclass(frozen=True)
class Observation:
    """One scrape pass over a PagedModel's ready engines (aggregated by the operator).

    Gauges are the values at scrape time; the counter fields are increments since the previous pass,
    summed over the engines that answered (the operator drops counter resets of restarted pods).
    """

    time: float               # unix seconds of the pass
    engines: int              # engines that answered
    kv_cache_usage: float     # mean over those engines, 0..1
    waiting: int              # summed over engines
    running: int              # summed
    max_num_seqs: int = 0     # per-engine slots reported by pagedmodel:max_num_seqs (0 unknown)
    block_size: int = 0       # pagedmodel:block_size (0 unknown)
    preemptions: float = 0.0  # vllm:num_preemptions_total
    swap_outs: float = 0.0    # pagedmodel:num_swap_outs_total
    finished: float = 0.0     # vllm:request_prompt_tokens_count (finished requests)
    prompt_tokens: float = 0.0      # vllm:request_prompt_tokens_sum
    generation_tokens: float = 0.0  # vllm:request_generation_tokens_sum
    arrival_rate: float = 0.0       # requests/s admitted, summed over the routers (their arrival gauge)
    routers: int = 0                # routers whose arrival rate was read; 0: no arrival signal this pass

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            # bool is an int subclass; True as an engine count is a bug upstream, not a number.
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"Observation.{f.name} must be a number, not {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"Observation.{f.name} must be finite, not {value!r}")
            if f.name in _INT_FIELDS and value != int(value):
                raise ValueError(f"Observation.{f.name} must be a whole number, not {value!r}")
            if f.name != "time" and value < 0:
                raise ValueError(f"Observation.{f.name} must be >= 0, not {value!r}")
        if not 0.0 <= self.kv_cache_usage <= 1.0:
            raise ValueError(f"Observation.kv_cache_usage must be in [0, 1], not {self.kv_cache_usage!r}")
        # With no engine answering, requests can still wait (at the router), but none can run.
        if self.engines == 0 and self.running:
            raise ValueError("Observation with 0 engines cannot report running requests")
        for name in _INT_FIELDS:  # 3.0 from JSON or float sums becomes 3, so equality and JSON stay exact
            object.__setattr__(self, name, int(getattr(self, name)))

    @property
    def waiting_per_engine(self) -> float:
        return self.waiting / self.engines if self.engines else 0.0

    @property
    def thrash_events(self) -> float:
        """Preemptions plus swap-outs: both mean the KV cache ran out of room."""
        return self.preemptions + self.swap_outs

    def to_json(self) -> list[float | int]:
        """Compact positional list (see _FIELDS), trailing defaults dropped."""
        values = list(astuple(self))
        defaults = [f.default for f in fields(self)]
        while len(values) > _REQUIRED and values[-1] == defaults[len(values) - 1]:
            values.pop()
        return [round(v, 6) if isinstance(v, float) else v for v in values]

    @classmethod
    def from_json(cls, raw: Any) -> "Observation":
        """Parse the list form (or a dict keyed by field name); ValueError on anything else."""
        if isinstance(raw, dict):
            unknown = set(raw) - set(_FIELDS)
            if unknown:
                raise ValueError(f"unknown observation fields {sorted(unknown)}")
            missing = [k for k in _FIELDS[:_REQUIRED] if k not in raw]
            if missing:
                raise ValueError(f"observation lacks {missing}")
            return cls(**raw)
        if isinstance(raw, (list, tuple)):
            if not _REQUIRED <= len(raw) <= len(_FIELDS):
                raise ValueError(f"observation list needs {_REQUIRED}..{len(_FIELDS)} entries, got {len(raw)}")
            return cls(*raw)
        raise ValueError(f"observation must be a list or an object, not {type(raw).__name__}")
