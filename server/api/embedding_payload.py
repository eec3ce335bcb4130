"""vLLM's wire form of prompt embeddings: base64 of ``torch.save`` of a [num_tokens, hidden_size] tensor
(completions' ``prompt_embeds``, chat's ``{"type": "prompt_embeds", "data": ...}`` content parts).

The bytes are the caller's, so they are unpickled with ``weights_only`` (tensors and plain containers,
nothing that runs code), sparse tensors have their indices checked on load, and every failure is the
caller's 400 with torch's reason, cut short.
"""
from __future__ import annotations

import base64
import binascii
import io
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

MAX_REASON_CHARS = 200


class EmbeddingPayloadError(ValueError):
    """The payload is not a tensor (the API answers 400 naming ``param``)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def decode_embeddings(data: object, param: str = "prompt_embeds") -> torch.Tensor:
    """The tensor in a base64 ``torch.save`` payload; its shape and dtype are checked by the engine's
    input processor (prompt_embeds.check_embeds_tensor)."""
    if not isinstance(data, (str, bytes)) or not data:
        raise EmbeddingPayloadError(f"{param} must be a non-empty base64 string", param)
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise EmbeddingPayloadError(f"{param} is not valid base64", param) from None
    import torch   # here, not at import: the API's modules load without torch

    try:
        with torch.sparse.check_sparse_tensor_invariants():
            tensor = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
    except MemoryError:
        raise
    except Exception as exc:   # torch raises many types for bytes that are not a tensor file
        reason = (str(exc).strip() or type(exc).__name__)
        if len(reason) > MAX_REASON_CHARS:
            reason = reason[:MAX_REASON_CHARS] + f"... ({len(reason) - MAX_REASON_CHARS} more characters)"
        raise EmbeddingPayloadError(f"{param} could not be loaded as a torch tensor: {reason}", param) from None
    if not isinstance(tensor, torch.Tensor):
        raise EmbeddingPayloadError(f"{param} must hold one tensor, got {type(tensor).__name__}", param)
    return tensor
