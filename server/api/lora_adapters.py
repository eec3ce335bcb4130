"""LoRA adapters over HTTP, as vLLM serves them: a request names its adapter in ``model``;
``/v1/models`` lists each adapter with ``parent`` = the base model; ``POST /v1/load_lora_adapter``
and ``/v1/unload_lora_adapter`` add and remove adapters while the server runs.

Loading reads files, so it runs in a worker thread; the engine only sees a registered adapter when
a request names it. An unloaded adapter stays in use by requests that already hold it.
"""
from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from .errors import APIError
from .protocol import ModelCard

if TYPE_CHECKING:
    from .serving import OpenAIServing


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


def registry(serving: OpenAIServing) -> Any:
    return serving.engine.lora_registry


def resolve_model(serving: OpenAIServing, model: str | None) -> Any:
    """The adapter a request's ``model`` names; None for the base model; 404 for anything else."""
    if model is None or model == serving.model_name:
        return None
    reg = registry(serving)
    adapter = reg.get(model) if reg is not None else None
    if adapter is None:
        served = ", ".join(f"`{n}`" for n in served_names(serving))
        raise APIError(404, f"The model `{model}` does not exist. This server serves {served}.",
                       param="model", code="model_not_found")
    return adapter


def served_names(serving: OpenAIServing) -> list[str]:
    reg = registry(serving)
    return [serving.model_name] + ([a.name for a in reg.adapters()] if reg is not None else [])


def adapter_cards(serving: OpenAIServing) -> list[ModelCard]:
    reg = registry(serving)
    return [ModelCard(id=a.name, root=a.path, parent=serving.model_name, max_model_len=serving.max_model_len)
            for a in (reg.adapters() if reg is not None else [])]


def _enabled_registry(serving: OpenAIServing) -> Any:
    reg = registry(serving)
    if reg is None:
        raise APIError(400, "LoRA is not enabled on this server; start it with --enable-lora", code="lora_disabled")
    return reg


async def load_lora_adapter(serving: OpenAIServing, request: Request) -> Response:
    from pagedmodel.server.engine.lora.adapter import LoRAError

    req = await serving.parse_body(request, LoadLoRAAdapterRequest)
    reg = _enabled_registry(serving)
    if req.lora_name == serving.model_name:
        raise APIError(400, f"`{req.lora_name}` is the base model's name", param="lora_name")
    if not await asyncio.to_thread(os.path.exists, req.lora_path):
        # vLLM answers a path with nothing there 404 (not found), unlike an adapter it cannot use (400)
        raise APIError(404, f"LoRA adapter path `{req.lora_path}` does not exist", param="lora_path", code="not_found")
    try:
        await asyncio.to_thread(reg.load, req.lora_name, req.lora_path)
    except LoRAError as exc:
        raise APIError(400, str(exc), param="lora_path" if "already" not in str(exc) else "lora_name") from None
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


async def unload_lora_adapter(serving: OpenAIServing, request: Request) -> Response:
    req = await serving.parse_body(request, UnloadLoRAAdapterRequest)
    reg = _enabled_registry(serving)
    try:
        reg.unload(req.lora_name)
    except KeyError:
        raise APIError(404, f"The LoRA adapter `{req.lora_name}` cannot be found.", param="lora_name",
                       code="model_not_found") from None
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
