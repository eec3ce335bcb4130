"""The soak's traffic: a fixed-seed request mix, one HTTP client that plays it, and the outcome of each request.

Pure parts (the mix, classifying an answer, percentiles) are separate from the one I/O function,
`play`, so that tests/reliability can check them without a server.

Every request gets exactly one outcome:
  completed  200 with a well-formed answer (non-streamed: JSON with `n` choices; streamed: events
             ending in `data: [DONE]` and no error event)
  aborted    we dropped the connection on purpose (mid-stream or while waiting), 10 % of requests
  rejected   a hostile request (2 %) answered with a 4xx and an OpenAI-style error body
  429 / 503  back-pressure (rate limit, queue full / no replica), counted apart
  other      anything else: a 5xx, a 4xx to a valid request, a 200 to a hostile one, a malformed
             answer, a connection error, a timeout. A healthy system has 0 of these.
"""
from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

OUTCOMES = ("completed", "aborted", "rejected_4xx", "429", "503", "other")

# Share of the mix per kind of valid request (hostile and aborted ones are drawn on top).
KIND_WEIGHTS = {
    "chat": 14, "chat_stream": 14, "completion": 14, "completion_stream": 14,
    "n_samples": 10, "beam": 6, "prefix_chat": 14, "long": 14,
}
ABORT_SHARE = 0.10
HOSTILE_SHARE = 0.02
HOSTILE_KINDS = ("malformed_json", "bad_param", "oversized_prompt", "not_an_object", "bad_messages")

_WORDS = ("river", "engine", "paper", "cloud", "garden", "signal", "copper", "window", "orbit", "lantern",
          "harbor", "meadow", "violet", "pixel", "canyon", "quartz", "ember", "falcon", "tundra", "saddle")
# Four long shared system prompts: requests with the same one share prefix-cache blocks.
SYSTEM_PROMPTS = tuple("You are assistant %d. " % i + " ".join(_WORDS[(i + j) % len(_WORDS)] for j in range(120))
                       for i in range(4))


@dataclass(frozen=True)
class Planned:
    """One request of the mix: what to send and how the client behaves."""
    index: int
    kind: str                    # a KIND_WEIGHTS key, or "hostile:<HOSTILE_KINDS member>"
    path: str                    # /v1/completions or /v1/chat/completions
    body: bytes
    stream: bool
    n: int = 1
    abort_after_events: int | None = None    # streamed: drop the connection after this many events
    abort_after_s: float | None = None       # non-streamed: drop it after this long

    @property
    def hostile(self) -> bool:
        return self.kind.startswith("hostile:")

    @property
    def aborts(self) -> bool:
        return self.abort_after_events is not None or self.abort_after_s is not None


@dataclass
class Result:
    planned: Planned
    outcome: str
    status: int | None
    latency_s: float
    completion_tokens: int = 0
    detail: str = ""


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def _body(kind: str, rng: random.Random, model: str, long_words: int) -> tuple[str, dict[str, Any], int]:
    """(path, JSON body, n) of one valid request of `kind`."""
    chat = kind in ("chat", "chat_stream", "prefix_chat")
    max_tokens = rng.randint(8, 48)
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": rng.choice((0.0, 0.7, 1.0)),
                            "seed": rng.randint(0, 2**31 - 1)}
    n = 1
    if kind == "prefix_chat":
        body["messages"] = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)},
                            {"role": "user", "content": _words(rng, rng.randint(3, 12))}]
    elif chat:
        body["messages"] = [{"role": "user", "content": _words(rng, rng.randint(4, 40))}]
    else:
        body["prompt"] = _words(rng, rng.randint(4, 60))
    if kind == "n_samples":
        n = rng.randint(2, 4)
        body.update(n=n, temperature=0.8)
    elif kind == "beam":
        n = 2
        body.update(n=n, best_of=rng.randint(2, 3), use_beam_search=True, temperature=0.0,
                    max_tokens=rng.randint(6, 16))
    elif kind == "long":
        # long prompt and long output: several of these at once overflow the KV cache -> preemption
        body.update(prompt=_words(rng, long_words), max_tokens=rng.randint(96, 160), ignore_eos=True)
    return ("/v1/chat/completions" if chat else "/v1/completions"), body, n


def _hostile(kind: str, rng: random.Random, model: str, max_model_len: int) -> tuple[str, bytes]:
    path = "/v1/completions"
    if kind == "malformed_json":
        return path, b'{"model": "' + model.encode() + b'", "prompt": "unterminated'
    if kind == "not_an_object":
        return path, b"[1, 2, 3]"
    if kind == "bad_param":
        bad = rng.choice(({"temperature": -1}, {"n": 0}, {"max_tokens": -5}, {"top_p": 7}, {"max_tokens": "many"}))
        return path, json.dumps({"model": model, "prompt": "hello", **bad}).encode()
    if kind == "oversized_prompt":
        return path, json.dumps({"model": model, "prompt": _words(rng, 2 * max_model_len), "max_tokens": 4}).encode()
    return "/v1/chat/completions", json.dumps({"model": model, "messages": "not a list"}).encode()


def plan(index: int, seed: int, model: str, max_model_len: int, long_words: int) -> Planned:
    """Request number `index` of the mix for `seed`: the same arguments always give the same request."""
    rng = random.Random(seed * 1_000_003 + index)
    if rng.random() < HOSTILE_SHARE:
        kind = rng.choice(HOSTILE_KINDS)
        path, raw = _hostile(kind, rng, model, max_model_len)
        return Planned(index, "hostile:" + kind, path, raw, stream=False)
    kind = rng.choices(list(KIND_WEIGHTS), weights=list(KIND_WEIGHTS.values()))[0]
    path, body, n = _body(kind, rng, model, long_words)
    stream = kind.endswith("_stream") or (kind in ("prefix_chat", "long", "n_samples") and rng.random() < 0.5)
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    after_events = after_s = None
    if rng.random() < ABORT_SHARE:
        if stream:
            after_events = rng.randint(1, 6)
        else:
            after_s = rng.uniform(0.02, 1.5)
    return Planned(index, kind, path, json.dumps(body).encode(), stream, n, after_events, after_s)


# ---- classifying answers (pure)

def classify_json(p: Planned, status: int, payload: Any) -> tuple[str, int, str]:
    """(outcome, completion tokens, detail) of a non-streamed answer."""
    if status in (429, 503):
        return str(status), 0, ""
    if p.hostile:
        if 400 <= status < 500 and _is_error_body(payload):
            return "rejected_4xx", 0, ""
        return "other", 0, f"hostile request answered {status}: {str(payload)[:200]}"
    if status != 200:
        return "other", 0, f"status {status}: {str(payload)[:200]}"
    choices = payload.get("choices") if isinstance(payload, dict) else None
    if not isinstance(choices, list) or len(choices) != p.n or any(c.get("finish_reason") is None for c in choices):
        return "other", 0, f"malformed answer: {str(payload)[:200]}"
    return "completed", int((payload.get("usage") or {}).get("completion_tokens") or 0), ""


def _is_error_body(payload: Any) -> bool:
    err = payload.get("error") if isinstance(payload, dict) else None
    return isinstance(err, dict) and isinstance(err.get("message"), str) and "type" in err


def classify_stream(p: Planned, events: list[str], done: bool) -> tuple[str, int, str]:
    """(outcome, completion tokens, detail) of a streamed 200 that ran to its end."""
    tokens = 0
    seen_choices: set[int] = set()
    for data in events:
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError:
            return "other", 0, f"non-JSON event {data[:120]!r}"
        if "error" in chunk:
            return "other", 0, f"error event {data[:200]}"
        for c in chunk.get("choices") or ():
            seen_choices.add(c.get("index", 0))
        if chunk.get("usage"):
            tokens = int(chunk["usage"].get("completion_tokens") or 0)
    if not done:
        return "other", tokens, "stream ended without data: [DONE]"
    if len(seen_choices) != p.n:
        return "other", tokens, f"stream carried choices {sorted(seen_choices)}, expected {p.n}"
    return "completed", tokens, ""


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); nan for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(q / 100 * len(ordered))))
    return ordered[rank - 1]


# ---- the client (I/O)

async def _read_stream(p: Planned, resp: Any) -> tuple[str, int, str]:
    events: list[str] = []
    done = False
    async for line in resp.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            done = True
            break
        events.append(data)
        if p.abort_after_events is not None and len(events) >= p.abort_after_events:
            return "aborted", 0, ""   # leaving the `async with` closes the connection mid-stream
    return classify_stream(p, events, done)


async def _send(client: Any, base_url: str, p: Planned) -> tuple[str, int | None, int, str]:
    headers = {"Content-Type": "application/json"}
    async with client.stream("POST", base_url + p.path, content=p.body, headers=headers) as resp:
        if resp.status_code == 200 and p.stream and not p.hostile:
            outcome, tokens, detail = await _read_stream(p, resp)
            return outcome, resp.status_code, tokens, detail
        raw = await resp.aread()
        try:
            payload = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            payload = raw[:200].decode(errors="replace")
        outcome, tokens, detail = classify_json(p, resp.status_code, payload)
        return outcome, resp.status_code, tokens, detail


async def play(client: Any, base_url: str, p: Planned, timeout_s: float) -> Result:
    """Send `p`, behave as planned (abort, or wait at most `timeout_s`) and classify what came back."""
    import httpx

    start = time.perf_counter()
    status: int | None = None
    try:
        if p.abort_after_s is not None:
            try:
                outcome, status, tokens, detail = await asyncio.wait_for(_send(client, base_url, p), p.abort_after_s)
            except asyncio.TimeoutError:   # wait_for cancelled the request: httpx drops the connection
                outcome, tokens, detail = "aborted", 0, ""
        else:
            outcome, status, tokens, detail = await asyncio.wait_for(_send(client, base_url, p), timeout_s)
    except asyncio.TimeoutError:
        outcome, tokens, detail = "other", 0, f"no answer within {timeout_s:.0f} s"
    except httpx.HTTPError as exc:
        outcome, tokens, detail = "other", 0, f"{type(exc).__name__}: {exc}"
    return Result(p, outcome, status, time.perf_counter() - start, tokens, detail)


@dataclass
class Tally:
    """Results of one phase, summarised."""
    results: list[Result] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        out = dict.fromkeys(OUTCOMES, 0)
        for r in self.results:
            out[r.outcome] += 1
        return out

    def latency_by_kind(self) -> dict[str, tuple[int, float, float]]:
        """kind -> (completed count, p50 s, p99 s), over completed requests."""
        by: dict[str, list[float]] = {}
        for r in self.results:
            if r.outcome == "completed":
                by.setdefault(r.planned.kind, []).append(r.latency_s)
        return {k: (len(v), percentile(v, 50), percentile(v, 99)) for k, v in sorted(by.items())}

    def completion_tokens(self) -> int:
        return sum(r.completion_tokens for r in self.results if r.outcome == "completed")

    def others(self) -> list[Result]:
        return [r for r in self.results if r.outcome == "other"]
