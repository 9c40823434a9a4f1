"""Reading a request's JSON body, so that every malformed body becomes a clear 4xx, never a 500.

Too large: 413. Not UTF-8, not JSON, NaN or Infinity, an integer of more digits than Python
converts, nested too deeply, not an object, a lone surrogate escape: 400 `invalid_json` (or
`invalid_unicode`). A client that goes away before sending its whole body is a disconnect
(`ClientDisconnected`: counted as one, not as an error).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from fastapi import Request
from starlette.requests import ClientDisconnect

from server.errors import APIError, ClientDisconnected
from server.serving_base import INVALID_UNICODE


class NotAJsonNumber(ValueError):
    pass


def _not_a_json_number(constant: str) -> Any:
    """Python's json reads NaN and Infinity; JSON has no such numbers (and `temperature: NaN` would
    otherwise be refused as "should be <= 2")."""
    raise NotAJsonNumber(constant)


async def read_json(request: Request, max_bytes: int) -> dict:
    """The body as a JSON object, at most `max_bytes` long."""
    raw = bytearray()
    try:
        async for piece in request.stream():
            raw.extend(piece)
            if len(raw) > max_bytes:
                raise APIError(413, f"Request body exceeds {max_bytes} bytes", code="request_too_large")
    except ClientDisconnect:  # the client went away before sending all of its body
        raise ClientDisconnected from None
    try:
        data = json.loads(bytes(raw).decode("utf-8"), parse_constant=_not_a_json_number)
    except UnicodeDecodeError:
        raise APIError(400, "Request body is not valid UTF-8", code="invalid_json") from None
    except (json.JSONDecodeError, RecursionError):
        raise APIError(400, "Request body is not valid JSON (or is nested too deeply)", code="invalid_json") from None
    except NotAJsonNumber as err:
        raise APIError(400, f"Request body is not valid JSON: {err} is not a number in JSON",
                       code="invalid_json") from None
    except ValueError:  # json's int() past Python's int-string limit (CVE-2020-10735)
        raise APIError(400, f"Request body holds an integer of more than {sys.get_int_max_str_digits()} digits",
                       code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "Request body must be a JSON object", code="invalid_json")
    try:  # a \ud800-style escape with no pair decodes to a lone surrogate: no text, no token
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, "Request body holds a string with a lone surrogate escape (\\ud800-\\udfff "
                       "without its pair): not valid Unicode text", code=INVALID_UNICODE) from None
    return data
