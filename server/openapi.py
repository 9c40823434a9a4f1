"""The server's OpenAPI document. Request bodies are read and validated by hand (so every failure is
an OpenAI error, not FastAPI's 422), which hides them from FastAPI's generator; this puts them
back, with every error status each route can answer, so clients and fuzzers see the real contract."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
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


_BAD = {400: "Invalid request (the message names the parameter)"}
_AUTH = {401: "Missing or wrong API key"}
_MODEL = {404: "Unknown model"}
_LARGE = {413: "Request body too large"}
_BUSY = {503: "Not ready or shutting down"}
_GENERATION_ERRORS = {**_BAD, **_AUTH, **_MODEL, **_LARGE, 429: "Waiting queue full (Retry-After)", **_BUSY,
                      504: "Request timeout"}
_ROUTES: dict[tuple[str, str], dict[str, Any]] = {
    ("/v1/completions", "post"): {"body": CompletionRequest, "ok": CompletionResponse, "stream": True,
                                  "errors": _GENERATION_ERRORS},
    ("/v1/chat/completions", "post"): {"body": ChatCompletionRequest, "ok": CompletionResponse, "stream": True,
                                       "errors": _GENERATION_ERRORS},
    ("/v1/models", "get"): {"ok": ModelList, "errors": {**_AUTH, **_BUSY}},
    ("/v1/models/{model_id}", "get"): {"ok": ModelCard, "errors": {**_AUTH, **_MODEL, **_BUSY}},
    ("/tokenize", "post"): {"body": TokenizeRequest, "ok": TokenizeResponse,
                            "errors": {**_BAD, **_AUTH, **_MODEL, **_LARGE, **_BUSY}},
    ("/tokenizer_info", "get"): {"ok": TokenizerInfo, "errors": {**_AUTH, 404: "The model has no tokenizer", **_BUSY}},
    ("/detokenize", "post"): {"body": DetokenizeRequest, "ok": DetokenizeResponse,
                              "errors": {**_BAD, **_AUTH, **_MODEL, **_LARGE, **_BUSY}},
    ("/health", "get"): {"errors": {503: "Engine dead, stalled, or the model failed to load"}},
    ("/ready", "get"): {"errors": {503: "Loading or shutting down"}},
}


def _schema(model: type[BaseModel], components: dict[str, Any]) -> dict[str, Any]:
    schema = model.model_json_schema(ref_template=_REF)
    components.update(schema.pop("$defs", {}))
    components[model.__name__] = schema
    return {"$ref": _REF.format(model=model.__name__)}


@dataclass(frozen=True)
class Limits:
    """What this server accepts that depends on its model and settings: the document states it once
    the model is loaded, so a client (or a fuzzer) sees the bounds the server enforces."""

    model: str
    max_model_len: int
    max_n: int
    max_logprobs: int
    vocab_size: int
    profiles: tuple[str, ...] = ()
    mask_id: Optional[int] = None  # a prompt may not hold it (400 mask_token_in_prompt)


_GENERATION = ("CompletionRequest", "ChatCompletionRequest")
_NAMED_MODEL = (*_GENERATION, "TokenizeCompletionRequest", "TokenizeChatRequest", "DetokenizeRequest")


def _bound_integers(schema: dict[str, Any], **bounds: int) -> None:
    """Add bounds to the integer form of a property (itself, or its integer branch)."""
    for branch in schema.get("anyOf", [schema]):
        if branch.get("type") == "integer":
            branch.update(bounds)


def _bound_prompt_id(schema: dict[str, Any], largest_id: int, mask_id: Optional[int]) -> None:
    """A prompt's token id: in the vocabulary, and never the mask token."""
    schema["maximum"] = largest_id
    if mask_id is not None:
        schema["not"] = {"const": mask_id}


def _apply_limits(doc: dict[str, Any], limits: Limits) -> None:
    components = doc["components"]["schemas"]
    largest_id = limits.vocab_size - 1
    for parameter in doc["paths"]["/v1/models/{model_id}"]["get"]["parameters"]:
        if parameter["name"] == "model_id":
            parameter["schema"] = {"type": "string", "enum": [limits.model], "title": "Model Id"}
    for name in _NAMED_MODEL:
        components[name]["properties"]["model"] = {"anyOf": [{"type": "string", "enum": [limits.model]},
                                                             {"type": "null"}], "title": "Model"}
    for name in _GENERATION:
        props = components[name]["properties"]
        for field in ("max_tokens", "max_completion_tokens"):
            if field in props:  # a canvas leaves at least one position for the prompt
                _bound_integers(props[field], maximum=limits.max_model_len - 1)
        _bound_integers(props["n"], maximum=limits.max_n)
        for field in ("logprobs", "top_logprobs"):
            if field in props:
                _bound_integers(props[field], maximum=limits.max_logprobs)
        for branch in props["decoding"].get("anyOf", []):
            if branch.get("type") == "object" and limits.profiles:
                branch["properties"]["profile"]["enum"] = list(limits.profiles)
    for branch in components["CompletionRequest"]["properties"]["prompt"]["anyOf"]:
        if branch.get("type") != "array":
            continue
        items = branch["items"]
        if items.get("type") == "integer":
            _bound_prompt_id(items, largest_id, limits.mask_id)
        else:  # several prompts: each is a completion
            branch["maxItems"] = limits.max_n
            if items.get("type") == "array":
                _bound_prompt_id(items["items"], largest_id, limits.mask_id)
    components["DetokenizeRequest"]["properties"]["tokens"]["items"]["maximum"] = largest_id


def build_openapi(app: FastAPI, limits: Optional[Limits] = None) -> dict[str, Any]:
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
    if limits is not None:
        _apply_limits(doc, limits)
    return doc


def install(app: FastAPI, limits: Callable[[], Optional[Limits]]) -> None:
    """Serve the document; it is kept once `limits()` (known when the model has loaded) is there."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        known = limits()
        doc = build_openapi(app, known)
        if known is not None:
            app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]
