"""Gumbel-max watermarking: the keyed noise, the watermarked draw, and which steps carry the watermark.

A watermarked row picks ``argmax(log p(t) + G(t))`` over the tokens its truncated distribution keeps, where
``G(t) = -log(-log u(t))`` and ``u(t)`` is a keyed pseudorandom number of (key, the previous
``context_width`` generated tokens, t). With ``u`` uniform this is an exact draw from ``p`` (the Gumbel-max
trick), so no single output is distorted; but ``u`` is a function of the text, so whoever holds the key can
recompute it and sees that the chosen tokens have unusually large ``u`` (watermark_detector.py).

The PRF: a 64-bit seed per context is SHA-256(domain, key, context) (one hash per row per step), and each
token's number is the splitmix64 finaliser of seed + (token + 1) x golden ratio, computed for the whole
vocabulary at once in int64 tensors (multiplication wraps mod 2**64, as the finaliser wants). The pure
Python ``token_uniform`` is the reference the tensor version is tested against, and what the detector uses.

Contexts are generated tokens only (the prompt is not text the detector sees), padded with -1 at the
start. A context already seen in the sample's history (``ContextHistory``) is drawn without the watermark:
reusing its noise would repeat its token, and repeated evidence is not independent.
"""
from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Sequence

import torch

from .watermark_config import WatermarkConfig

if TYPE_CHECKING:
    from .sampling_params import SamplingParams

DOMAIN = b"pagedmodel-watermark-gumbel-v1"
MASK64 = 2**64 - 1
GOLDEN = 0x9E3779B97F4A7C15
MIX1, MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
PAD = -1   # a context position before the first generated token


def context_seed(key: int, context: Sequence[int]) -> int:
    """The 64-bit seed of one context (its tokens, oldest first, -1 for padding)."""
    h = hashlib.sha256(DOMAIN)
    h.update(key.to_bytes(8, "big"))
    for token in context:
        h.update(int(token).to_bytes(8, "big", signed=True))
    return int.from_bytes(h.digest()[:8], "big")


def _splitmix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * MIX1) & MASK64
    z = ((z ^ (z >> 27)) * MIX2) & MASK64
    return z ^ (z >> 31)


def _to_unit(h: int) -> float:
    """The top 53 bits as a float strictly inside (0, 1): log(u) and log(1 - u) stay finite."""
    return ((h >> 11) + 0.5) / 2.0**53


def token_uniform(seed: int, token: int) -> float:
    """``u(token)`` under a context's seed: the reference for ``uniforms``."""
    return _to_unit(_splitmix64((seed + (token + 1) * GOLDEN) & MASK64))


def _signed(x: int) -> int:
    return x - 2**64 if x >= 2**63 else x


def _shr(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 seen as uint64 (torch's >> is arithmetic)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def uniforms(seeds: Sequence[int], token_ids: torch.Tensor) -> torch.Tensor:
    """``u`` as float64 ``[len(seeds), n]`` for each seed and each token of ``token_ids`` (``[n]`` or
    ``[len(seeds), n]``), on ``token_ids``' device."""
    device = token_ids.device
    seed = torch.tensor([_signed(s) for s in seeds], dtype=torch.int64, device=device)[:, None]
    z = seed + (token_ids.to(torch.int64) + 1) * _signed(GOLDEN)
    z = (z ^ _shr(z, 30)) * _signed(MIX1)
    z = (z ^ _shr(z, 27)) * _signed(MIX2)
    z = z ^ _shr(z, 31)
    return (_shr(z, 11).to(torch.float64) + 0.5) / 2.0**53


def context_of(output_token_ids: Sequence[int], width: int) -> tuple[int, ...]:
    """The ``width`` generated tokens before the next one, -1-padded at the start."""
    tail = list(output_token_ids[max(0, len(output_token_ids) - width):])
    return (PAD,) * (width - len(tail)) + tuple(tail)


def gumbel_choice(logprobs: torch.Tensor, seeds: Sequence[int], ids: torch.Tensor | None = None) -> list[int]:
    """Per row, the token maximising ``logprobs + G``: ``logprobs`` ``[R, width]`` (-inf: not drawable) over
    the token ids ``ids`` ``[R, width]`` (None: the whole vocabulary, in order)."""
    width = logprobs.shape[-1]
    tokens = ids if ids is not None else torch.arange(width, device=logprobs.device)
    u = uniforms(seeds, tokens)
    scores = logprobs.to(torch.float64) - torch.log(-torch.log(u))
    picked = scores.argmax(dim=-1)
    if ids is not None:
        picked = ids.gather(1, picked[:, None])[:, 0]
    return picked.tolist()


class ContextHistory:
    """One sample's contexts seen so far, updated as its tokens come, so "was this context seen within the
    last ``max_history`` positions" is one dict lookup per step (a scan would be quadratic in the output).

    Position p of the searched sequence has the context of the ``width`` tokens before it (-1-padded); the
    searched sequence is the output (scope ``single_turn``) or prompt + output (``all``: the contexts drawn
    from are still the output's, and the first ``width`` outputs, whose contexts are padded, go
    unwatermarked, so every sample starts differently and a prompt cannot pick the answer's first noise)."""

    def __init__(self, config: WatermarkConfig, prompt_token_ids: Sequence[int]):
        self.width = config.context_width
        self.scope = config.deduplicate_contexts
        self.max_history = config.deduplicate_contexts_max_history
        self.prompt = list(prompt_token_ids) if self.scope == "all" else []
        self._reset()

    def _reset(self) -> None:
        self.last_seen: dict[tuple[int, ...], int] = {}   # context -> its latest position
        self.outputs_indexed = 0
        for p in range(len(self.prompt)):
            self.last_seen[context_of(self.prompt[:p], self.width)] = p

    def _context_before(self, output_token_ids: Sequence[int], p: int) -> tuple[int, ...]:
        """The context of output position p: output tokens before it, then the prompt's tail if searched."""
        before = list(output_token_ids[max(0, p - self.width):p])
        missing = self.width - len(before)
        if missing > 0 and self.prompt:
            before = self.prompt[max(0, len(self.prompt) - missing):] + before
        return context_of(before, self.width)

    def repeated(self, output_token_ids: Sequence[int]) -> bool:
        """Whether the next token's context already occurred (then it is drawn without the watermark)."""
        if self.scope == "none":
            return False
        if self.scope == "all" and len(output_token_ids) < self.width:
            return True
        if len(output_token_ids) < self.outputs_indexed:   # the sample's tokens were replaced: start again
            self._reset()
        base = len(self.prompt)
        for p in range(self.outputs_indexed, len(output_token_ids)):
            self.last_seen[self._context_before(output_token_ids, p)] = base + p
        self.outputs_indexed = len(output_token_ids)
        seen = self.last_seen.get(context_of(output_token_ids, self.width))
        if seen is None:
            return False
        return self.max_history is None or seen >= base + len(output_token_ids) - self.max_history


def watermark_applies(config: WatermarkConfig | None, params: "SamplingParams") -> bool:
    """Whether a request's samples carry the watermark: the engine has one, the request did not opt out
    (``watermarking: false``), and its tokens are drawn. Greedy and beam-search tokens are the argmax,
    with no randomness for the key to replace, so they stay unwatermarked (as in vLLM)."""
    return (config is not None and params.watermarking is not False
            and not params.greedy and not params.use_beam_search)


def unwatermarked_reason(config: WatermarkConfig | None, params: "SamplingParams") -> str | None:
    """Why a request that asked for the watermark (or left it to the engine's) will not carry it; None when
    it will, or when it opted out."""
    if params.watermarking is False or watermark_applies(config, params):
        return None
    if config is None:
        return "the engine has no --watermark-config" if params.watermarking else None
    if params.use_beam_search:
        return "beam search picks the likeliest beams and cannot be watermarked"
    return "greedy decoding (temperature 0) picks the argmax and cannot be watermarked"


def samples_share_noise(config: WatermarkConfig | None, params: "SamplingParams") -> str | None:
    """Why a watermarked request's n or best_of > 1 samples come out alike, or None: they start from the
    same (padded) context, so the same noise picks the same first token, and so on, unless scope "all"
    draws each sample's first ``context_width`` tokens without the watermark."""
    if params.best_of < 2 or not watermark_applies(config, params) or config.deduplicate_contexts == "all":
        return None
    return ("the samples of a request with n or best_of > 1 share their contexts and so their tokens; "
            "deduplicate_contexts \"all\" draws each sample's first tokens freely")


def watermarked_draw(logits: torch.Tensor, params: Sequence["SamplingParams"], seeds: Sequence[int]) -> list[int]:
    """One token per row of ``logits`` ``[R, vocab]`` (not modified): the gumbel-max choice under each row's
    context seed among the tokens temperature, top-k, min-p and top-p keep (random_sampling's truncation,
    so the watermark draws from exactly the distribution an ordinary draw would)."""
    from .random_sampling import truncate

    tokens = [0] * len(params)
    for group in truncate(logits.float(), params):
        picked = gumbel_choice(torch.log(group.probs), [seeds[i] for i in group.rows], group.ids)
        for i, token in zip(group.rows, picked):
            tokens[i] = token
    return tokens
