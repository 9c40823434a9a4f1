"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` for every failure."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

from fastapi.responses import JSONResponse

from engine.errors import RequestError

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          408: "timeout_error", 413: "invalid_request_error", 429: "rate_limit_error",
          500: "server_error", 503: "service_unavailable", 504: "timeout_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[dict[str, str]] = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_response(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                   headers: Optional[dict[str, str]] = None) -> JSONResponse:
    return APIError(status, message, param, code, headers).response()


class ClientDisconnected(Exception):
    """The client went away before its answer; its rows are already aborted. Answered with 499
    (nginx's "client closed request", which nobody receives) and counted as a disconnect, not an error."""


CLIENT_CLOSED_REQUEST = 499


class QueueFull(Exception):
    """The engine's waiting queue is at --max-queue."""


class ShuttingDown(Exception):
    """Work that was still waiting when the server stopped serving."""


def engine_error(err: Exception, param: Optional[str] = None, params: Optional[Mapping[str, str]] = None,
                 retry_after: int = 1) -> APIError:
    """The one mapping from the engine's refusals to OpenAI errors: a full queue is a 429 with
    Retry-After, a stopping server a 503, a request the engine cannot take a 400 whose `param` is the
    request field the engine's parameter came from (`params`: engine name -> field; else `param`)."""
    if isinstance(err, QueueFull):
        return APIError(429, "The server is at capacity: the waiting queue is full; retry later",
                        code="queue_full", headers={"Retry-After": str(retry_after)})
    if isinstance(err, ShuttingDown):
        return APIError(503, str(err) or "the server is shutting down", code="shutting_down")
    if isinstance(err, RequestError):
        field = (params or {}).get(err.param or "", param)
        return APIError(400, str(err), param=field, code=err.code)
    raise TypeError(f"not an engine refusal: {err!r}")
