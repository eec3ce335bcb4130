"""Per-tenant limits in requests and tokens per minute, as OpenAI states them in its headers.

A tenant is named by a configurable request header (for example X-Tenant) or, without one, by its
bearer API key; requests with neither share the tenant "anonymous". Each tenant has two buckets that
refill continuously (a full minute's allowance at most): one takes a request per request, the other
the request's *reservation* -- an estimate of its prompt tokens plus the completion tokens it may
generate (`max_completion_tokens` / `max_tokens` times `n`, or a default). The router has no tokenizer,
so the prompt estimate is cheap (see `estimate_prompt_tokens`). When the request ends, `settle` swaps the
reservation for the tokens actually used, so a tenant pays for what it used, not for what it asked for;
a bucket may go below zero when usage exceeded the reservation (the debt delays the next request).

Pure logic with an injectable clock (as admission.py), so tests drive time without sleeping.
"""
from __future__ import annotations

import hashlib
import json
import math
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .admission import Clock, bearer_token, evict_one, retry_after_seconds

ANONYMOUS = "anonymous"
CHARS_PER_TOKEN = 4          # English BPE text averages about 4 characters a token (OpenAI's rule of thumb)
MESSAGE_OVERHEAD_TOKENS = 4  # role and chat-template markers around each message


@dataclass(frozen=True)
class Limits:
    """One tenant's allowance; None means unlimited in that dimension."""

    requests_per_minute: float | None = None
    tokens_per_minute: float | None = None

    def __post_init__(self) -> None:
        for name in ("requests_per_minute", "tokens_per_minute"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive number, got {value!r}")

    @property
    def any(self) -> bool:
        return self.requests_per_minute is not None or self.tokens_per_minute is not None


def _text_chars(value: Any) -> int:
    """Characters of text in a prompt or message content (strings, content parts, anything else as JSON)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        return sum(_text_chars(part.get("text", "") if isinstance(part, dict) and part.get("type") == "text"
                                else part) for part in value)
    if value is None:
        return 0
    return len(json.dumps(value))


def estimate_prompt_tokens(body: Mapping[str, Any]) -> int:
    """Prompt tokens without a tokenizer: token ids are counted exactly, text as characters / 4, plus a few
    tokens per chat message for the template. Tool definitions and schemas count as their JSON text."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        return sum(len(p) for p in prompt)
    chars = _text_chars(prompt) if prompt is not None else 0
    messages = body.get("messages")
    overhead = 0
    if isinstance(messages, list):
        for m in messages:
            if isinstance(m, dict):
                chars += _text_chars(m.get("content")) + _text_chars(m.get("tool_calls"))
                overhead += MESSAGE_OVERHEAD_TOKENS
    for key in ("tools", "response_format"):
        if body.get(key) is not None:
            chars += _text_chars(body[key])
    return math.ceil(chars / CHARS_PER_TOKEN) + overhead


def _prompts(body: Mapping[str, Any]) -> int:
    """How many prompts a completions request batches (each gets its own choices)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return len(prompt)
    return 1


def completion_budget(body: Mapping[str, Any], default_max_tokens: int) -> int:
    """The completion tokens a request may generate: max_completion_tokens, else max_tokens, else the
    default; times `n` choices (and `best_of` when larger, as every candidate is generated), per prompt."""
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    per_choice = limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else default_max_tokens
    choices = 1
    for key in ("n", "best_of"):
        v = body.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > choices:
            choices = v
    return per_choice * choices * _prompts(body)


def reservation(body: Mapping[str, Any], default_max_tokens: int) -> int:
    """Tokens a request reserves at admission: its estimated prompt plus its completion budget."""
    return estimate_prompt_tokens(body) + completion_budget(body, default_max_tokens)


def go_duration(seconds: float) -> str:
    """A duration as OpenAI writes x-ratelimit-reset-*: "12ms", "1s", "6m0s", "1h2m3.5s"."""
    if seconds <= 0:
        return "0s"
    ms = max(1, round(seconds * 1000))
    if ms < 1000:
        return f"{ms}ms"
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    secs = f"{ms / 1000:.3f}".rstrip("0").rstrip(".")
    out = f"{hours}h" if hours else ""
    if hours or minutes:
        out += f"{minutes}m"
    return out + f"{secs}s"


class MinuteBucket:
    """A bucket holding at most `per_minute`, refilled at `per_minute / 60` a second; may go negative (debt)."""

    def __init__(self, per_minute: float, clock: Clock) -> None:
        self.capacity = float(per_minute)
        self.rate = self.capacity / 60.0
        self._clock = clock
        self._level = self.capacity
        self._last = clock()

    def level(self) -> float:
        now = self._clock()
        if now > self._last:   # a clock stepping back must neither mint nor burn allowance
            self._level = min(self.capacity, self._level + (now - self._last) * self.rate)
            self._last = now
        return self._level

    def wait_for(self, amount: float) -> float:
        """Seconds until `amount` fits (0 when it does now)."""
        missing = amount - self.level()
        return 0.0 if missing <= 1e-9 else missing / self.rate

    def take(self, amount: float) -> None:
        self._level = self.level() - amount

    def give(self, amount: float) -> None:
        self._level = min(self.capacity, self.level() + amount)

    def reset_s(self) -> float:
        """Seconds until the bucket is full again (OpenAI's x-ratelimit-reset-*)."""
        return max(0.0, (self.capacity - self.level()) / self.rate)

    def full(self) -> bool:
        return self.level() >= self.capacity - 1e-9


@dataclass
class _TenantState:
    limits: Limits
    requests: MinuteBucket | None
    tokens: MinuteBucket | None


@dataclass(frozen=True)
class TokenDecision:
    """An admission answer with the rate-limit headers to send (on a refusal and on a success alike)."""

    allowed: bool
    tenant: str
    reserved: int
    headers: dict[str, str] = field(default_factory=dict)
    retry_after: int = 0
    scope: str = ""          # "requests" or "tokens" when refused (OpenAI's error type)
    message: str = ""
    param: str | None = None  # the request field to change, when no wait can help


class TenantLimiter:
    """Buckets per tenant; the default limits apply to every tenant without an override.

    At most `max_tenants` tenants are tracked: past that, the least recently seen tenant whose buckets are
    full (forgetting it changes nothing) is dropped, else the least recently seen one.
    """

    def __init__(self, default: Limits, *, overrides: Mapping[str, Limits] | None = None,
                 header: str | None = None, max_tenants: int = 10_000, clock: Clock = time.monotonic) -> None:
        if max_tenants < 1:
            raise ValueError(f"max_tenants must be >= 1, got {max_tenants}")
        self.default = default
        self.overrides = dict(overrides or {})
        self.header = header.lower() if header else None
        self.max_tenants = max_tenants
        self._clock = clock
        self._tenants: OrderedDict[str, _TenantState] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.default.any or any(limits.any for limits in self.overrides.values())

    def tenant(self, headers: Mapping[str, str]) -> str:
        """The tenant a request belongs to; an API key is never used verbatim (it ends up in metric labels)."""
        lowered = {k.lower(): v for k, v in headers.items()}
        if self.header:
            value = lowered.get(self.header, "").strip()
            if value:
                return value[:128]
        key = bearer_token(lowered)
        return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12] if key else ANONYMOUS

    def _state(self, tenant: str) -> _TenantState:
        st = self._tenants.get(tenant)
        if st is None:
            if len(self._tenants) >= self.max_tenants:
                self._evict()
            limits = self.overrides.get(tenant, self.default)
            st = _TenantState(limits,
                              MinuteBucket(limits.requests_per_minute, self._clock)
                              if limits.requests_per_minute is not None else None,
                              MinuteBucket(limits.tokens_per_minute, self._clock)
                              if limits.tokens_per_minute is not None else None)
            self._tenants[tenant] = st
        self._tenants.move_to_end(tenant)
        return st

    def _evict(self) -> None:
        evict_one(self._tenants, lambda st: all(b is None or b.full() for b in (st.requests, st.tokens)))

    @property
    def tracked_tenants(self) -> int:
        return len(self._tenants)

    def headers(self, tenant: str) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers for the tenant's current state (only the limits that exist)."""
        st = self._state(tenant)
        out: dict[str, str] = {}
        for kind, bucket in (("requests", st.requests), ("tokens", st.tokens)):
            if bucket is not None:
                out[f"x-ratelimit-limit-{kind}"] = str(int(bucket.capacity))
                out[f"x-ratelimit-remaining-{kind}"] = str(max(0, math.floor(bucket.level() + 1e-9)))
                out[f"x-ratelimit-reset-{kind}"] = go_duration(bucket.reset_s())
        return out

    def admit(self, tenant: str, reserved: int) -> TokenDecision:
        """Take one request and `reserved` tokens from the tenant, or refuse without taking anything."""
        st = self._state(tenant)
        if st.tokens is not None and reserved > st.tokens.capacity:
            return TokenDecision(False, tenant, reserved, self.headers(tenant), retry_after=60, scope="tokens",
                                 message=f"request needs {reserved} tokens (prompt estimate + max_tokens), more "
                                         f"than tenant {tenant}'s limit of {int(st.tokens.capacity)} tokens per "
                                         "minute; lower max_tokens or shorten the prompt", param="max_tokens")
        for kind, bucket, amount, limit in (("requests", st.requests, 1, st.limits.requests_per_minute),
                                            ("tokens", st.tokens, reserved, st.limits.tokens_per_minute)):
            if bucket is None:
                continue
            wait = bucket.wait_for(amount)
            if wait > 0:
                used = max(0, math.ceil(bucket.capacity - bucket.level()))
                return TokenDecision(False, tenant, reserved, self.headers(tenant), retry_after_seconds(wait), kind,
                                     f"rate limit reached for tenant {tenant} on {kind} per min: limit "
                                     f"{limit:g}, used {used}, requested {amount}; please try again in "
                                     f"{retry_after_seconds(wait)}s")
        if st.requests is not None:
            st.requests.take(1)
        if st.tokens is not None:
            st.tokens.take(reserved)
        return TokenDecision(True, tenant, reserved, self.headers(tenant))

    def settle(self, tenant: str, reserved: int, used: int) -> None:
        """Swap a finished request's reservation for the tokens it used (a refund, or a debt)."""
        st = self._tenants.get(tenant)
        if st is None or st.tokens is None:
            return
        if used < reserved:
            st.tokens.give(reserved - used)
        elif used > reserved:
            st.tokens.take(used - reserved)

    def cancel(self, tenant: str, reserved: int) -> None:
        """An admitted request another stage refused (queue full, no upstream): give everything back."""
        st = self._tenants.get(tenant)
        if st is None:
            return
        if st.requests is not None:
            st.requests.give(1)
        if st.tokens is not None:
            st.tokens.give(reserved)


def parse_tenant_limit(text: str) -> tuple[str, Limits]:
    """`NAME:requests=RPM,tokens=TPM` (either part may be left out) as given to --tenant-limit."""
    name, sep, spec = text.rpartition(":")
    if not sep or not name.strip():
        raise ValueError(f"expected NAME:requests=RPM,tokens=TPM, got {text!r}")
    values: dict[str, float] = {}
    for part in spec.split(","):
        key, eq, raw = part.partition("=")
        key = key.strip()
        if key not in ("requests", "tokens") or not eq:
            raise ValueError(f"{text!r}: each limit is requests=RPM or tokens=TPM, got {part!r}")
        try:
            values[key] = float(raw)
        except ValueError:
            raise ValueError(f"{text!r}: {key} must be a number, got {raw!r}") from None
    return name.strip(), Limits(values.get("requests"), values.get("tokens"))
