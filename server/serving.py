"""From an OpenAI request to engine submissions, and from engine events to JSON or SSE chunks.

- decoding knobs: model defaults <- `--default-decoding` <- the request's `decoding` object <- its
  OpenAI fields (`temperature`, `seed`, `top_p`, `max_tokens`);
- `max_tokens` is the generation canvas, rounded up to whole blocks (block_length, 32 by default;
  Dream's own policies decode one block of exactly max_tokens);
- stop strings are applied to the decoded text; streams hold back any tail that could start one;
- `finish_reason` comes from `finish_reason_of`, the one place engine outcomes map to OpenAI's.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Optional, Union

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine.decoding import DecodeParamError, DecodeParams, GenerationRequest, GenerationResult
from engine.decoding.params import resolve_defaults
from engine.engine import Engine
from engine.tokenizer import encode_text
from server.errors import APIError, error_body
from server.metrics import Metrics
from server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DecodingSummary,
    Usage,
    new_id,
    now,
)
from server.scheduler import EngineLoop, Event, QueueFull, Submission, summary_of
from server.settings import ServerSettings

DEFAULT_BLOCK = 32
RETRY_AFTER_SECONDS = 1


def finish_reason_of(engine_reason: str, stopped_by_string: bool) -> str:
    """The one mapping from engine outcomes to OpenAI's finish_reason."""
    if stopped_by_string or engine_reason == "stop":
        return "stop"
    if engine_reason == "length":
        return "length"
    return "abort"


def apply_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    cut = min((i for i in (text.find(s) for s in stops if s) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def safe_stream_length(text: str, stops: list[str]) -> int:
    """How much of `text` can be sent now: everything except a tail that could begin a stop string
    (and a trailing replacement character from a split multi-byte sequence)."""
    limit = len(text.rstrip("\ufffd"))
    for stop in stops:
        for k in range(min(len(stop) - 1, limit), 0, -1):
            if text[:limit].endswith(stop[:k]):
                limit = min(limit, len(text[:limit]) - k)
                break
    return limit


@dataclass
class Choice:
    index: int
    prompt_ids: list[int]
    submission: Submission
    text: str = ""
    sent: int = 0
    finished: bool = False
    finish_reason: Optional[str] = None
    result: Optional[GenerationResult] = None
    completion_tokens: int = 0
    joules: Optional[float] = None


class Serving:
    def __init__(self, engine: Engine, loop: EngineLoop, settings: ServerSettings, metrics: Metrics) -> None:
        self.engine = engine
        self.loop = loop
        self.settings = settings
        self.metrics = metrics
        self.max_model_len = settings.max_model_len or engine.model.config.max_position_embeddings
        self._defaults = dict(settings.default_decoding)
        DecodeParams.from_dict(self._defaults)  # fail at start-up, not per request

    # ------------------------------------------------------------------ requests -> engine

    def _params(self, body: Union[CompletionRequest, ChatCompletionRequest], max_tokens: Optional[int]) -> DecodeParams:
        knobs: dict[str, Any] = {**self._defaults, **(body.decoding or {})}
        for name in ("temperature", "seed", "top_p"):
            if getattr(body, name) is not None:
                knobs[name] = getattr(body, name)
        if max_tokens is not None:
            knobs["gen_length"] = self._canvas(max_tokens, knobs)
        try:
            params = DecodeParams.from_dict(knobs)
        except DecodeParamError as err:
            from_body = err.param in (body.decoding or {}) or err.param == "gen_length"
            param = "max_tokens" if err.param == "gen_length" else (f"decoding.{err.param}" if from_body else err.param)
            raise APIError(400, str(err), param=param) from None
        except TypeError as err:
            raise APIError(400, f"invalid decoding object: {err}", param="decoding") from None
        return resolve_defaults(params, self.engine.architecture)

    @staticmethod
    def _canvas(max_tokens: int, knobs: dict[str, Any]) -> int:
        """max_tokens rounded up to whole blocks."""
        block = knobs.get("block_length")
        if isinstance(block, int) and not isinstance(block, bool) and block > 0:
            return math.ceil(max_tokens / block) * block
        if str(knobs.get("policy", "")).startswith("dream-") or max_tokens <= DEFAULT_BLOCK:
            return max_tokens
        return math.ceil(max_tokens / DEFAULT_BLOCK) * DEFAULT_BLOCK

    def _check_model(self, model: Optional[str]) -> None:
        if model is not None and model != self.settings.model_name:
            raise APIError(404, f"The model '{model}' does not exist; this server serves "
                           f"'{self.settings.model_name}'", param="model", code="model_not_found")

    def _completion_prompts(self, body: CompletionRequest) -> list[list[int]]:
        prompt = body.prompt
        if isinstance(prompt, str):
            texts: list[Any] = [prompt]
        elif prompt and all(isinstance(p, int) for p in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        else:
            texts = list(prompt)
        if not texts:
            raise APIError(400, "prompt must not be empty", param="prompt")
        prompts = []
        for item in texts:
            if isinstance(item, str):
                if self.engine.tokenizer is None:
                    raise APIError(400, "this model has no tokenizer: send prompts as token ids", param="prompt")
                prompts.append(encode_text(self.engine.tokenizer, item))
            else:
                prompts.append(list(item))
        return prompts

    def _chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        from engine.chat import chat_prompt_ids

        if self.engine.tokenizer is None or not getattr(self.engine.tokenizer, "chat_template", None):
            raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text} for m in body.messages]
        try:
            return chat_prompt_ids(self.engine.tokenizer, messages)
        except Exception as err:  # the checkpoint's template refused these messages
            raise APIError(400, f"the chat template cannot render these messages: {err}", param="messages") from None

    def _check_prompt(self, ids: list[int], params: DecodeParams) -> None:
        vocab = self.engine.model.config.vocab_size
        if not ids:
            raise APIError(400, "prompt must not be empty", param="prompt")
        if any(not 0 <= t < vocab for t in ids):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        if len(ids) + params.gen_length > self.max_model_len:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens; the prompt "
                           f"has {len(ids)} and the generation canvas {params.gen_length}", param="max_tokens",
                           code="context_length_exceeded")

    def _submit_all(self, prompts: list[list[int]], params: DecodeParams, n: int,
                    queue: asyncio.Queue) -> list[Choice]:
        if len(prompts) * n > self.settings.max_n:
            raise APIError(400, f"n x prompts = {len(prompts) * n} exceeds this server's limit of "
                           f"{self.settings.max_n} completions per request", param="n")
        for ids in prompts:
            self._check_prompt(ids, params)
        loop = asyncio.get_running_loop()
        choices: list[Choice] = []
        for p_index, ids in enumerate(prompts):
            for j in range(n):
                index = p_index * n + j
                p = params
                if params.temperature > 0 and params.seed is not None and j:
                    p = params.with_overrides(seed=params.seed + j)  # n samples, not n copies
                request = GenerationRequest(tuple(ids), p, new_id("req"))
                choices.append(Choice(index, ids, Submission(request, index, queue, loop, stream=False)))
        for choice in choices:
            try:
                self.loop.submit(choice.submission)
            except QueueFull:
                for submitted in choices:
                    self.loop.abort(submitted.submission.request.request_id)
                raise APIError(429, "The server is at capacity: the waiting queue is full; retry later",
                               code="queue_full", headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
        return choices

    # ------------------------------------------------------------------ engine -> text

    def _text(self, ids: list[int]) -> str:
        end_ids = set(self.engine.model.special.end_ids)
        cut = next((i for i, t in enumerate(ids) if t in end_ids), len(ids))
        if self.engine.tokenizer is None:
            return " ".join(map(str, ids[:cut]))
        return self.engine.tokenizer.decode(ids[:cut], skip_special_tokens=True)

    def _complete(self, choice: Choice, result: GenerationResult, stops: list[str], joules: Optional[float]) -> None:
        text, stopped = apply_stop(self._text(result.generated_ids), stops)
        choice.text = text
        choice.result = result
        choice.finished = True
        choice.joules = joules
        choice.finish_reason = finish_reason_of(result.finish_reason, stopped)
        if stopped and self.engine.tokenizer is not None:
            choice.completion_tokens = len(encode_text(self.engine.tokenizer, text))
        else:
            choice.completion_tokens = len(result.response_ids)
        m = self.metrics
        m.labels(m.prompt_tokens).inc(len(choice.prompt_ids))
        m.labels(m.generation_tokens).inc(choice.completion_tokens)
        m.labels(m.request_success, finished_reason=choice.finish_reason).inc()

    @staticmethod
    def _summary(choice: Choice) -> Optional[DecodingSummary]:
        if choice.result is None:
            return None
        return DecodingSummary(**summary_of(choice.result))

    def _usage(self, choices: list[Choice]) -> Usage:
        prompt = sum(len(c.prompt_ids) for c in choices)
        completion = sum(c.completion_tokens for c in choices)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    async def _next_event(self, queue: asyncio.Queue, deadline: float, request: Request) -> Optional[Event]:
        """The next engine event for this request; None if the client has gone; 504 past the deadline."""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise APIError(504, f"request timed out after {self.settings.request_timeout:g} s", code="timeout")
            try:
                return await asyncio.wait_for(queue.get(), timeout=min(0.25, remaining))
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return None

    async def _wait(self, choices: list[Choice], queue: asyncio.Queue, request: Request,
                    stops: list[str]) -> None:
        """Collect every choice's result; abort all on disconnect or timeout."""
        deadline = time.monotonic() + self.settings.request_timeout
        pending = {c.index for c in choices}
        by_index = {c.index: c for c in choices}
        try:
            while pending:
                event = await self._next_event(queue, deadline, request)
                if event is None:
                    raise asyncio.CancelledError
                choice = by_index[event.choice]
                if event.kind == "error":
                    raise APIError(400, event.message)
                if event.kind == "done":
                    assert event.result is not None
                    self._complete(choice, event.result, stops, event.joules)
                    pending.discard(event.choice)
        except BaseException:
            for c in choices:
                if not c.finished:
                    self.loop.abort(c.submission.request.request_id)
            raise

    # ------------------------------------------------------------------ endpoints

    async def completions(self, body: CompletionRequest, request: Request) -> Any:
        self._check_model(body.model)
        params = self._params(body, body.max_tokens)
        prompts = self._completion_prompts(body)
        return await self._serve(body, request, prompts, params, chat=False)

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Any:
        self._check_model(body.model)
        params = self._params(body, body.max_completion_tokens or body.max_tokens)
        return await self._serve(body, request, [self._chat_prompt(body)], params, chat=True)

    async def _serve(self, body: Union[CompletionRequest, ChatCompletionRequest], request: Request,
                     prompts: list[list[int]], params: DecodeParams, chat: bool) -> Any:
        queue: asyncio.Queue = asyncio.Queue()
        choices = self._submit_all(prompts, params, body.n, queue)
        for c in choices:
            c.submission.stream = body.stream
        request_id = new_id("chatcmpl" if chat else "cmpl")
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(self._stream(choices, queue, request, body.stop_strings, chat, request_id,
                                                  include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        await self._wait(choices, queue, request, body.stop_strings)
        created, model = now(), self.settings.model_name
        usage = self._usage(choices).model_dump()
        if chat:
            data = {"id": request_id, "object": "chat.completion", "created": created, "model": model,
                    "choices": [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                                 "finish_reason": c.finish_reason, "logprobs": None,
                                 "decoding": self._summary_dict(c)} for c in choices], "usage": usage}
        else:
            data = {"id": request_id, "object": "text_completion", "created": created, "model": model,
                    "choices": [{"index": c.index, "text": c.text, "finish_reason": c.finish_reason,
                                 "logprobs": None, "decoding": self._summary_dict(c)} for c in choices],
                    "usage": usage}
        return JSONResponse(data)

    def _summary_dict(self, choice: Choice) -> Optional[dict[str, Any]]:
        summary = self._summary(choice)
        if summary is None:
            return None
        data = summary.model_dump()
        if choice.joules is not None:
            data["energy_joules"] = choice.joules
        return data

    async def _stream(self, choices: list[Choice], queue: asyncio.Queue, request: Request, stops: list[str],
                      chat: bool, request_id: str, include_usage: bool) -> AsyncIterator[bytes]:
        created, model = now(), self.settings.model_name
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(index: int, text: Optional[str], finish: Optional[str], first: bool = False,
                  extra: Optional[dict[str, Any]] = None) -> bytes:
            if chat:
                delta: dict[str, Any] = {}
                if first:
                    delta["role"] = "assistant"
                if text is not None:
                    delta["content"] = text
                body_choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": finish,
                                               "logprobs": None}
            else:
                body_choice = {"index": index, "text": text or "", "finish_reason": finish, "logprobs": None}
            if extra:
                body_choice.update(extra)
            payload = {"id": request_id, "object": kind, "created": created, "model": model,
                       "choices": [body_choice]}
            return f"data: {json.dumps(payload)}\n\n".encode()

        by_index = {c.index: c for c in choices}
        deadline = time.monotonic() + self.settings.request_timeout
        try:
            if chat:
                for c in choices:
                    yield chunk(c.index, "", None, first=True)
            pending = set(by_index)
            while pending:
                event = await self._next_event(queue, deadline, request)
                if event is None:
                    return
                c = by_index[event.choice]
                if c.finished:
                    continue
                if event.kind == "error":
                    raise APIError(400, event.message)
                if event.kind == "progress":
                    assert event.ids is not None
                    text, stopped = apply_stop(self._text(event.ids), stops)
                    end_seen = any(t in self.engine.model.special.end_ids for t in event.ids)
                    limit = len(text) if stopped or end_seen else safe_stream_length(text, stops)
                    if limit > c.sent:
                        yield chunk(c.index, text[c.sent:limit], None)
                        c.sent = limit
                    if stopped:  # the rest cannot change the answer: free the row now
                        self.loop.abort(c.submission.request.request_id)
                        c.text, c.finished, c.finish_reason = text, True, "stop"
                        c.completion_tokens = len(encode_text(self.engine.tokenizer, text)) \
                            if self.engine.tokenizer is not None else 0
                        m = self.metrics
                        m.labels(m.prompt_tokens).inc(len(c.prompt_ids))
                        m.labels(m.generation_tokens).inc(c.completion_tokens)
                        m.labels(m.request_success, finished_reason="stop").inc()
                        yield chunk(c.index, None if chat else "", "stop")
                        pending.discard(c.index)
                    continue
                assert event.result is not None
                self._complete(c, event.result, stops, event.joules)
                if len(c.text) > c.sent:
                    yield chunk(c.index, c.text[c.sent:], None)
                    c.sent = len(c.text)
                yield chunk(c.index, None if chat else "", c.finish_reason,
                            extra={"decoding": self._summary_dict(c)})
                pending.discard(c.index)
            if include_usage:
                payload = {"id": request_id, "object": kind, "created": created, "model": model, "choices": [],
                           "usage": self._usage(choices).model_dump()}
                yield f"data: {json.dumps(payload)}\n\n".encode()
            yield b"data: [DONE]\n\n"
        except APIError as err:
            self.metrics.labels(self.metrics.request_errors, status=str(err.status)).inc()
            yield f"data: {json.dumps(error_body(err.status, err.message, err.param, err.code))}\n\n".encode()
            yield b"data: [DONE]\n\n"
        finally:
            for c in choices:
                if not c.finished:
                    self.loop.abort(c.submission.request.request_id)
