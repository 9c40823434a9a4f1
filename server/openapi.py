"""The server's OpenAPI document. Request bodies are read and validated by hand (so every failure is
an OpenAI error, not FastAPI's 422), which hides them from FastAPI's generator; this puts them
back, with every error status each route can answer, so clients and fuzzers see the real contract."""

from __future__ import annotations

from typing import Any, Optional

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DecodingSummary,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfo,
    Usage,
)

_REF = "#/components/schemas/{model}"


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class CompletionResponse(BaseModel):
    """A non-streamed completion (text or chat); streamed ones are server-sent events."""

    id: str
    object: str
    created: int
    model: str
    choices: list[dict[str, Any]]
    usage: Usage


_GENERATION_ERRORS = {400: "Invalid request (the message names the parameter)", 401: "Missing or wrong API key",
                      404: "Unknown model", 413: "Request body too large", 429: "Waiting queue full (Retry-After)",
                      503: "Not ready or shutting down", 504: "Request timeout"}
_ROUTES: dict[tuple[str, str], dict[str, Any]] = {
    ("/v1/completions", "post"): {"body": CompletionRequest, "ok": CompletionResponse, "stream": True,
                                  "errors": _GENERATION_ERRORS},
    ("/v1/chat/completions", "post"): {"body": ChatCompletionRequest, "ok": CompletionResponse, "stream": True,
                                       "errors": _GENERATION_ERRORS},
    ("/v1/models", "get"): {"ok": ModelList, "errors": {401: "Missing or wrong API key",
                                                        503: "Not ready or shutting down"}},
    ("/v1/models/{model_id}", "get"): {"ok": ModelCard, "errors": {401: "Missing or wrong API key",
                                                                   404: "Unknown model",
                                                                   503: "Not ready or shutting down"}},
    ("/tokenize", "post"): {"body": TokenizeRequest, "ok": TokenizeResponse, "errors": {
        400: "Invalid request (the message names the parameter)", 401: "Missing or wrong API key",
        404: "Unknown model", 413: "Request body too large", 503: "Not ready or shutting down"}},
    ("/tokenizer_info", "get"): {"ok": TokenizerInfo, "errors": {401: "Missing or wrong API key",
                                                                 404: "The model has no tokenizer",
                                                                 503: "Not ready or shutting down"}},
    ("/detokenize", "post"): {"body": DetokenizeRequest, "ok": DetokenizeResponse, "errors": {
        400: "Invalid request (the message names the parameter)", 401: "Missing or wrong API key",
        404: "Unknown model", 413: "Request body too large", 503: "Not ready or shutting down"}},
    ("/health", "get"): {"errors": {503: "Engine dead, stalled, or the model failed to load"}},
    ("/ready", "get"): {"errors": {503: "Loading or shutting down"}},
}


def _schema(model: type[BaseModel], components: dict[str, Any]) -> dict[str, Any]:
    schema = model.model_json_schema(ref_template=_REF)
    components.update(schema.pop("$defs", {}))
    components[model.__name__] = schema
    return {"$ref": _REF.format(model=model.__name__)}


def build_openapi(app: FastAPI) -> dict[str, Any]:
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                      description="OpenAI-compatible API of cai-dllm; the `decoding` object carries the "
                                  "per-request diffusion decoding knobs.")
    components: dict[str, Any] = doc.setdefault("components", {}).setdefault("schemas", {})
    error_ref = _schema(ErrorResponse, components)
    _schema(DecodingSummary, components)
    for (path, method), spec in _ROUTES.items():
        operation = doc["paths"][path][method]
        responses: dict[str, Any] = {}
        ok_content: dict[str, Any] = {"application/json": {"schema": _schema(spec["ok"], components)
                                                           if "ok" in spec else {"type": "object"}}}
        if spec.get("stream"):
            # each server-sent event: a `data:` line holding one JSON chunk (or "[DONE]", or an error object)
            ok_content["text/event-stream"] = {"schema": {"type": "object", "required": ["data"], "properties": {
                "data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"}}}}
        responses["200"] = {"description": "Success", "content": ok_content}
        for status, why in spec["errors"].items():
            responses[str(status)] = {"description": why, "content": {"application/json": {"schema": error_ref}}}
        operation["responses"] = responses
        if "body" in spec:
            operation["requestBody"] = {"required": True, "content": {
                "application/json": {"schema": _schema(spec["body"], components)}}}
    doc["paths"]["/metrics"]["get"]["responses"] = {
        "200": {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}}
    return doc


def install(app: FastAPI) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
