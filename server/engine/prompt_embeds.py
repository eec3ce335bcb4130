"""Prompt positions whose model input is a caller's embedding row instead of a token's (vLLM's
``--enable-prompt-embeds``): a whole prompt given as embeddings, or chat text with embedding parts.

Such a position holds a placeholder token id (0, as in vLLM) in the sequence; the model runner swaps in the
row when it prefills the position (and again when a preempted request is recomputed). Prefix-cache blocks
are keyed by token ids, so a request's embeddings also key its blocks (``digest``, mixed into its cache
salt): two requests share cached KV only when their embeddings are byte-identical.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # torch loads with the engine, not with the API's modules (`pagedmodel --help` stays fast)
    import torch

PLACEHOLDER_TOKEN_ID = 0


@dataclass(frozen=True)
class EmbedSpan:
    start: int            # the prompt position of the first row
    rows: torch.Tensor    # [n, hidden_size], on the CPU, in the model's dtype

    @property
    def end(self) -> int:
        return self.start + self.rows.shape[0]


@dataclass(frozen=True)
class PromptEmbeds:
    """The embedding spans of one prompt, in order and disjoint."""

    spans: tuple[EmbedSpan, ...]

    @classmethod
    def whole(cls, rows: torch.Tensor) -> "PromptEmbeds":
        """A prompt that is nothing but embeddings."""
        return cls((EmbedSpan(0, rows),))

    @property
    def num_positions(self) -> int:
        return sum(s.rows.shape[0] for s in self.spans)

    def digest(self) -> bytes:
        """Identifies the embeddings and where they sit (the prefix cache's key beside the token ids)."""
        import torch

        h = hashlib.sha256()
        for span in self.spans:
            rows = span.rows.contiguous()
            h.update(f"{span.start}:{tuple(rows.shape)}:{rows.dtype};".encode())
            h.update(rows.view(torch.uint8).numpy().tobytes() if rows.numel() else b"")
        return h.digest()

    def rows_between(self, start: int, end: int) -> list[tuple[int, torch.Tensor]]:
        """(offset from ``start``, rows) for every embedded position in [start, end): a prefill chunk's share."""
        out = []
        for span in self.spans:
            lo, hi = max(start, span.start), min(end, span.end)
            if lo < hi:
                out.append((lo - start, span.rows[lo - span.start:hi - span.start]))
        return out


def check_embeds_tensor(tensor: object, hidden_size: int, dtype: torch.dtype, max_rows: int,
                        param: str = "prompt_embeds") -> torch.Tensor:
    """A caller's tensor as a span's rows: 2-D (a leading batch of 1 is dropped), ``hidden_size`` wide,
    floating point (cast to the model's dtype), dense, finite, at most ``max_rows`` long; raises
    ValueError saying what is wrong."""
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{param} must be a tensor, got {type(tensor).__name__}")
    if tensor.dim() == 3 and tensor.shape[0] == 1:
        tensor = tensor[0]
    if tensor.dim() != 2:
        raise ValueError(f"{param} must be a 2-D tensor of shape (num_tokens, hidden_size); "
                         f"got shape {tuple(tensor.shape)}")
    if tensor.shape[1] != hidden_size:
        raise ValueError(f"{param} has hidden size {tensor.shape[1]}; the model's is {hidden_size}")
    if tensor.shape[0] == 0:
        raise ValueError(f"{param} must have at least one row")
    if tensor.shape[0] > max_rows:
        raise ValueError(f"{param} has {tensor.shape[0]} rows; the model's context is {max_rows} tokens")
    if tensor.layout != torch.strided:   # checked after the shape, so a sparse tensor is small enough to densify
        tensor = tensor.to_dense()
    if not tensor.is_floating_point():
        raise ValueError(f"{param} must be floating point, got {tensor.dtype}")
    tensor = tensor.detach().to("cpu", dtype)
    if not bool(torch.isfinite(tensor).all()):
        raise ValueError(f"{param} contains NaN or infinite values")
    return tensor.contiguous()
