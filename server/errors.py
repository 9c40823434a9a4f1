"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` for every failure."""

from __future__ import annotations

from typing import Optional

from fastapi.responses import JSONResponse

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
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": code}}


def error_response(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                   headers: Optional[dict[str, str]] = None) -> JSONResponse:
    return APIError(status, message, param, code, headers).response()


class ClientDisconnected(Exception):
    """The client went away before its answer; its rows are already aborted. Answered with 499
    (nginx's "client closed request", which nobody receives) and counted as a disconnect, not an error."""


CLIENT_CLOSED_REQUEST = 499
