"""Server-sent events framing, in one place: each event is `data: <json>` and a blank line; a stream
ends with `data: [DONE]`, as OpenAI's streams do."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

DONE = b"data: [DONE]\n\n"


def event(body: Any) -> bytes:
    """One event carrying a pydantic model (serialized by its own encoder) or a JSON-able value."""
    data = body.model_dump_json() if isinstance(body, BaseModel) else json.dumps(body)
    return b"data: " + data.encode() + b"\n\n"
