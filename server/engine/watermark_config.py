"""`--watermark-config`: which watermark the engine puts on sampled text, parsed and checked once at start.

The fields are vLLM's (``WatermarkConfig``), so a vLLM command line's JSON carries over. What a field
would change in a way this engine cannot honour is refused with a message naming it: an unknown key, a
bad value, vLLM's speculative-decoding-only ``dual_key_gumbel`` and vLLM's ``philox`` PRF (our noise comes
from our own keyed PRF, so vLLM's detector would not find it; ``pagedmodel watermark detect`` does).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Literal

from .json_flag import json_object_flag

log = logging.getLogger("pagedmodel.engine")

ALGORITHMS = ("gumbel",)
DEDUPLICATE_SCOPES = ("none", "single_turn", "all")
PRFS = ("splitmix64",)          # watermark.py: SHA-256 of (key, context), then splitmix64 per token
MAX_KEY = 2**64 - 1
MAX_CONTEXT_WIDTH = 64          # beyond 16 an edit already spoils many contexts; 64 bounds the per-step work
ROBUST_CONTEXT_WIDTH = 16
MIN_RECOMMENDED_HISTORY = 1024  # shorter dedup windows let repetition loops through (vLLM warns alike)
REFUSED = {
    ("algorithm", "dual_key_gumbel"): "dual_key_gumbel exists to watermark speculative decoding's drafts, "
                                      "which this engine does not run; use \"gumbel\"",
    ("prf", "philox"): "pagedmodel's gumbel noise comes from its own keyed PRF (\"splitmix64\"), not vLLM's "
                       "Philox: leave prf out (text is then checked with `pagedmodel watermark detect`)",
}


class WatermarkConfigError(ValueError):
    """A --watermark-config that cannot be served; the message names the field."""


@dataclass(frozen=True)
class WatermarkConfig:
    key: int = field(repr=False)    # the secret: never logged, never in a repr
    algorithm: Literal["gumbel"] = "gumbel"
    context_width: int = 4          # previous generated tokens that, with the key, seed a token's noise
    deduplicate_contexts: Literal["none", "single_turn", "all"] = "single_turn"
    deduplicate_contexts_max_history: int | None = 8192
    prf: str = "splitmix64"
    alpha: float = 0.1              # vLLM's dual-key mixing weight: accepted, unused by gumbel
    allow_target_only_watermarking: bool = False   # vLLM's speculative-decoding switch: nothing to allow here

    def describe(self) -> str:
        """The startup log line's settings, without the key."""
        return (f"{self.algorithm}, context_width {self.context_width}, deduplicate_contexts "
                f"{self.deduplicate_contexts} (history {self.deduplicate_contexts_max_history}), prf {self.prf}")


def parse_watermark_config(value: str | dict[str, Any] | WatermarkConfig | None) -> WatermarkConfig | None:
    """The flag's JSON text (or an offline caller's dict) as a checked WatermarkConfig; None stays None."""
    if value is None or isinstance(value, WatermarkConfig):
        return value
    value = json_object_flag("--watermark-config", value, WatermarkConfigError,
                             "such as '{\"algorithm\": \"gumbel\", \"key\": 42}'")
    known = set(WatermarkConfig.__dataclass_fields__)
    unknown = sorted(set(value) - known)
    if unknown:
        raise WatermarkConfigError(f"--watermark-config: unknown field(s) {', '.join(map(repr, unknown))}; "
                                   f"the fields are {', '.join(sorted(known))}")
    if "key" not in value:
        raise WatermarkConfigError("--watermark-config needs \"key\": the secret integer (0 to 2**64-1) that "
                                   "seeds the watermark and that detection needs")
    _check_fields(value)
    return WatermarkConfig(**value)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_fields(value: dict[str, Any]) -> None:
    def fail(name: str, why: str) -> None:
        raise WatermarkConfigError(f"--watermark-config: {name} {why}, got {value[name]!r}")

    for (name, bad), why in REFUSED.items():
        if value.get(name) == bad:
            raise WatermarkConfigError(f"--watermark-config: {name} {bad!r} is not served: {why}")
    if not _is_int(value["key"]) or not 0 <= value["key"] <= MAX_KEY:
        raise WatermarkConfigError("--watermark-config: key must be an integer from 0 to 2**64-1")   # not echoed
    choices = {"algorithm": ALGORITHMS, "deduplicate_contexts": DEDUPLICATE_SCOPES, "prf": PRFS}
    for name, allowed in choices.items():
        if name in value and value[name] not in allowed:
            fail(name, f"must be one of {', '.join(map(repr, allowed))}")
    width = value.get("context_width", 4)
    if not _is_int(width) or not 1 <= width <= MAX_CONTEXT_WIDTH:
        fail("context_width", f"must be an integer from 1 to {MAX_CONTEXT_WIDTH}")
    history = value.get("deduplicate_contexts_max_history", 8192)
    if history is not None and (not _is_int(history) or history < 1):
        fail("deduplicate_contexts_max_history", "must be a positive integer or null (the whole history)")
    alpha = value.get("alpha", 0.1)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not 0 <= alpha <= 1:
        fail("alpha", "must be a number in [0, 1]")
    if not isinstance(value.get("allow_target_only_watermarking", False), bool):
        fail("allow_target_only_watermarking", "must be true or false")


def warn_weak(config: WatermarkConfig) -> None:
    """Settings that work but weaken the watermark or the text: said once, by the engine at start (parsing
    runs each time EngineArgs is validated)."""
    if config.context_width > ROBUST_CONTEXT_WIDTH:
        log.warning("watermark context_width %d > %d: each edited token spoils that many contexts' evidence",
                    config.context_width, ROBUST_CONTEXT_WIDTH)
    history = config.deduplicate_contexts_max_history
    if config.deduplicate_contexts == "none" or (history is not None and history < MIN_RECOMMENDED_HISTORY):
        log.warning("watermark deduplication is off or shorter than %d positions: a repeated context then "
                    "repeats its token, which can lock generations into loops", MIN_RECOMMENDED_HISTORY)
