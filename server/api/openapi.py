"""The OpenAPI document (GET /openapi.json) with the real request schemas.

The POST handlers read their bodies by hand (serving.parse_body: precise 400/413/415s instead of
FastAPI's 422), so FastAPI alone would describe them as taking no body. Each route instead names its
pydantic model here; the document then carries the schema clients, and the fuzzer
(tests/api/test_fuzz_openapi.py), build requests from. Behaviour is unchanged: nothing validates
against the document.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

_REF = "#/components/schemas/{model}"


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` for a route whose JSON body is `model`."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": _REF.format(model=model.__name__)}}}}}


def install_openapi(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Serve the document with `models` (and the models they nest) under components.schemas."""
    def build() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                schema = model.model_json_schema(ref_template=_REF)
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = build  # type: ignore[method-assign]
