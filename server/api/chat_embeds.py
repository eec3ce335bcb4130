"""Chat messages with ``prompt_embeds`` content parts (vLLM's, with --enable-prompt-embeds): the chat
template renders a unique marker in each part's place, the rendered prompt is split at the markers, the
text between them is tokenized, and each marker becomes its embedding rows (placeholder ids in the
sequence, the rows in a PromptEmbeds the engine feeds to the model)."""
from __future__ import annotations

import re
import secrets
from typing import TYPE_CHECKING

from pagedmodel.server.engine.prompt_embeds import PLACEHOLDER_TOKEN_ID, EmbedSpan, PromptEmbeds
from .errors import APIError
from .protocol import ChatMessage, PromptEmbedsContentPart

if TYPE_CHECKING:
    import torch

    from .serving import OpenAIServing


def embeds_parts(messages: list[ChatMessage]) -> list[PromptEmbedsContentPart]:
    """Every prompt_embeds part, in message and part order."""
    return [part for m in messages if isinstance(m.content, list)
            for part in m.content if isinstance(part, PromptEmbedsContentPart)]


def mark(parts: list[PromptEmbedsContentPart]) -> list[str]:
    """Gives each part a marker no message can contain (a fresh nonce per request); returns them in order."""
    nonce = secrets.token_hex(8)
    for k, part in enumerate(parts):
        part._marker = f"<|prompt-embeds-{nonce}-{k}|>"
    return [part.text for part in parts]


async def load_parts(serving: OpenAIServing, messages: list[ChatMessage]
                     ) -> tuple[list[str], list[torch.Tensor]]:
    """The markers and embedding rows of the messages' prompt_embeds parts (none: two empty lists)."""
    parts = embeds_parts(messages)
    rows = [await serving.load_prompt_embeds(p.data, param="messages") for p in parts]
    return mark(parts), rows


async def splice(serving: OpenAIServing, rendered: str, markers: list[str], rows: list[torch.Tensor]
                 ) -> tuple[list[int], PromptEmbeds]:
    """The rendered prompt's ids with each marker replaced by its rows' placeholders, and where they are."""
    pieces = re.split("(" + "|".join(map(re.escape, markers)) + ")", rendered)
    found = [p for p in pieces[1::2]]
    if found != markers:   # a template that drops or repeats a message's content
        raise APIError(400, f"the chat template rendered {len(found)} prompt_embeds part(s) of {len(markers)}; "
                            "every part must appear once", param="messages")
    ids: list[int] = []
    spans: list[EmbedSpan] = []
    for k, piece in enumerate(pieces):
        if k % 2:
            part_rows = rows[k // 2]
            spans.append(EmbedSpan(len(ids), part_rows))
            ids.extend([PLACEHOLDER_TOKEN_ID] * part_rows.shape[0])
        elif piece:
            ids.extend((await serving.tokenize_prompt(piece, add_special_tokens=False))[0])
    return ids, PromptEmbeds(tuple(spans))
