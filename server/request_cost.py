"""The optional server cap on what one request may cost in decode steps (`--max-decode-steps`).

A choice holds its row for at most `DecodeParams.max_steps` steps (`decoding.steps`, by default one
per canvas token; `threshold` one per canvas token whatever `steps` says; DiffusionGemma
`max_denoising_steps` a canvas, by default its checkpoint's). The cap reads the request as the
engine resolved it (`Engine.resolve`), the same object it then runs: a model's own defaults count,
not the library's. A request with
`policy: fixed`, a long `max_tokens` and `n: 16` holds 16 rows for that many steps, cut otherwise
only by `--request-timeout`. With the cap, a choice that may take more steps is refused before any
work, with a 400 naming the field that sets its step count.
"""

from __future__ import annotations

from typing import Optional, Union

from engine.decoding import DecodeParams
from engine.decoding.registry import POLICIES
from server.errors import APIError
from server.protocol import ChatCompletionRequest, CompletionRequest

DECODE_STEPS_EXCEEDED = "decode_steps_exceeded"


def check_decode_steps(params: DecodeParams, body: Union[CompletionRequest, ChatCompletionRequest],
                       max_tokens: Optional[int], cap: Optional[int]) -> None:
    """APIError 400 when a choice of this request may take more than `cap` decode steps (None: no cap;
    `max_tokens: 0` decodes nothing)."""
    if cap is None or max_tokens == 0 or params.max_steps <= cap:
        return
    bound = POLICIES[params.policy].step_bound  # what bounds the policy's steps (DecodeParams.max_steps)
    if bound.knob is not None and (bound.always or bound.knob in (body.decoding or {})):
        param = f"decoding.{bound.knob}"
    elif getattr(body, "max_completion_tokens", None) is not None:
        param = "max_completion_tokens"
    else:
        param = "max_tokens"
    raise APIError(400, f"{param}: a choice of this request may take {params.max_steps} decode steps, above this "
                   f"server's limit of {cap} (--max-decode-steps); ask for fewer tokens or steps",
                   param=param, code=DECODE_STEPS_EXCEEDED)
