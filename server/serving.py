"""From an OpenAI request to engine submissions, and from engine events to JSON or SSE chunks.

- decoding knobs: model defaults <- `--default-decoding` <- the request's `decoding` object <- its
  OpenAI fields (`temperature`, `seed`, `top_p`, `max_tokens`); the engine validates the request and
  fills the model's defaults once, when it is submitted;
- `max_tokens` is the generation canvas, rounded up to whole blocks (block_length, 32 by default;
  Dream's own policies decode one block of exactly max_tokens);
- one loop (`_run`) serves streamed and whole responses alike: it feeds each choice's token deltas
  to its `ChoiceOutput` (server/output.py: incremental detokenization, end tokens, stop strings,
  finish reasons) and yields what may be sent; a whole response is the same pieces joined.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator
from typing import Any, Optional, Union

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from engine import Engine, RequestError
from engine.decoding import DecodeParamError, DecodeParams, GenerationRequest
from engine.loading.tokenizer import encode_text
from server.errors import APIError, error_body
from server.metrics import Metrics
from server.output import ChoiceOutput
from server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatStreamChoice,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DecodingSummary,
    Usage,
    new_id,
    now,
)
from server.scheduler import EngineLoop, QueueFull, Submission
from server.settings import ServerSettings

DEFAULT_BLOCK = 32
RETRY_AFTER_SECONDS = 1
# How often a request waiting on the engine checks whether its client is still there.
_DISCONNECT_POLL_SECONDS = 0.25


def _json(body: Any) -> Response:
    """A response body serialized by pydantic's own encoder (no dict and json.dumps in between)."""
    return Response(content=body.model_dump_json(), media_type="application/json")


class Serving:
    def __init__(self, engine: Engine, loop: EngineLoop, settings: ServerSettings, metrics: Metrics) -> None:
        self.engine = engine
        self.loop = loop
        self.settings = settings
        self.metrics = metrics
        self.max_model_len = engine.max_model_len
        self.end_ids = frozenset(engine.model.special.end_ids)
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
        return params

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

    def _submit_all(self, prompts: list[list[int]], params: DecodeParams, n: int, stream: bool,
                    stops: list[str]) -> tuple[list[ChoiceOutput], asyncio.Queue]:
        if len(prompts) * n > self.settings.max_n:
            raise APIError(400, f"n x prompts = {len(prompts) * n} exceeds this server's limit of "
                           f"{self.settings.max_n} completions per request", param="n")
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        choices: list[ChoiceOutput] = []
        submitted: list[str] = []
        try:
            for p_index, ids in enumerate(prompts):
                for j in range(n):
                    index = p_index * n + j
                    p = params
                    if params.temperature > 0 and params.seed is not None and j:
                        p = params.with_overrides(seed=params.seed + j)  # n samples, not n copies
                    request = GenerationRequest(tuple(ids), p, new_id("req"))
                    self.loop.submit(Submission(request, index, queue, loop, stream=stream))
                    submitted.append(request.request_id)
                    choices.append(ChoiceOutput(index, request.request_id, ids, self.engine.tokenizer,
                                                self.end_ids, stops))
        except (QueueFull, RequestError) as err:
            for request_id in submitted:
                self.loop.abort(request_id)
            if isinstance(err, QueueFull):
                raise APIError(429, "The server is at capacity: the waiting queue is full; retry later",
                               code="queue_full", headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
            param = "max_tokens" if err.param == "gen_length" else "prompt"
            raise APIError(400, str(err), param=param, code=err.code) from None
        return choices, queue

    def _count_tokens(self, text: str) -> int:
        return len(encode_text(self.engine.tokenizer, text)) if self.engine.tokenizer is not None else 0

    def _record(self, choice: ChoiceOutput) -> None:
        m = self.metrics
        m.labels(m.prompt_tokens).inc(len(choice.prompt_ids))
        choice.completion_count = choice.completion_tokens(self._count_tokens)  # counted once, at the finish
        m.labels(m.generation_tokens).inc(choice.completion_count)
        m.labels(m.request_success, finished_reason=choice.finish_reason).inc()

    def _usage(self, choices: list[ChoiceOutput]) -> Usage:
        prompt = sum(len(c.prompt_ids) for c in choices)
        completion = sum(c.completion_count for c in choices)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    @staticmethod
    def _summary(choice: ChoiceOutput) -> Optional[DecodingSummary]:
        return None if choice.result is None else DecodingSummary.of(choice.result.stats, choice.joules)

    async def _next_event(self, queue: asyncio.Queue, deadline: float, request: Request) -> Any:
        """The next engine event for this request; None if the client has gone; 504 past the deadline."""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise APIError(504, f"request timed out after {self.settings.request_timeout:g} s", code="timeout")
            try:
                return await asyncio.wait_for(queue.get(), timeout=min(_DISCONNECT_POLL_SECONDS, remaining))
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return None

    async def _run(self, choices: list[ChoiceOutput], queue: asyncio.Queue,
                   request: Request) -> AsyncIterator[tuple[ChoiceOutput, str]]:
        """The one output loop: yields (choice, text that may be sent now) as deltas arrive; a choice's
        last piece comes with `choice.finished` set. Aborts what is left on any exit."""
        deadline = time.monotonic() + self.settings.request_timeout
        by_index = {c.index: c for c in choices}
        pending = set(by_index)
        try:
            while pending:
                event = await self._next_event(queue, deadline, request)
                if event is None:
                    return  # the client went away
                choice = by_index[event.choice]
                if choice.finished:
                    continue
                if event.kind == "error":
                    raise APIError(400, event.message)
                choice.add(event.ids)
                if event.kind == "done":
                    choice.finish(event.result, event.joules)
                elif choice.stopped_by_string:  # the rest cannot change the answer: free the row now
                    self.loop.abort(choice.request_id)
                    choice.finish(None)
                else:
                    piece = choice.take()
                    if piece:
                        yield choice, piece
                    continue
                self._record(choice)
                pending.discard(choice.index)
                yield choice, choice.take()
        finally:
            for choice in choices:
                if not choice.finished:
                    self.loop.abort(choice.request_id)

    # ------------------------------------------------------------------ endpoints

    async def completions(self, body: CompletionRequest, request: Request) -> Any:
        self._check_model(body.model)
        params = self._params(body, body.max_tokens)
        return await self._serve(body, request, self._completion_prompts(body), params, chat=False)

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Any:
        self._check_model(body.model)
        params = self._params(body, body.max_completion_tokens or body.max_tokens)
        return await self._serve(body, request, [self._chat_prompt(body)], params, chat=True)

    async def _serve(self, body: Union[CompletionRequest, ChatCompletionRequest], request: Request,
                     prompts: list[list[int]], params: DecodeParams, chat: bool) -> Any:
        choices, queue = self._submit_all(prompts, params, body.n, body.stream, body.stop_strings)
        response_id = new_id("chatcmpl" if chat else "cmpl")
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(self._stream(choices, queue, request, chat, response_id, include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        async for _ in self._run(choices, queue, request):
            pass
        if any(not c.finished for c in choices):
            raise asyncio.CancelledError  # the client went away: nobody to answer
        created, model, usage = now(), self.settings.model_name, self._usage(choices)
        if chat:
            return _json(ChatCompletionResponse(
                id=response_id, created=created, model=model, usage=usage,
                choices=[ChatChoice(index=c.index, message=AssistantMessage(content=c.text),
                                    finish_reason=c.finish_reason, decoding=self._summary(c)) for c in choices],
            ))
        return _json(CompletionResponse(
            id=response_id, created=created, model=model, usage=usage,
            choices=[CompletionChoice(index=c.index, text=c.text, finish_reason=c.finish_reason,
                                      decoding=self._summary(c)) for c in choices],
        ))

    async def _stream(self, choices: list[ChoiceOutput], queue: asyncio.Queue, request: Request, chat: bool,
                      response_id: str, include_usage: bool) -> AsyncIterator[bytes]:
        created, model = now(), self.settings.model_name

        def chunk(choice: ChoiceOutput, text: Optional[str], first: bool = False, last: bool = False) -> bytes:
            finish = choice.finish_reason if last else None
            summary = self._summary(choice) if last else None
            if chat:
                delta = ChatDelta(role="assistant" if first else None, content=text)
                body: Any = ChatCompletionChunk(id=response_id, created=created, model=model, choices=[
                    ChatStreamChoice(index=choice.index, delta=delta, finish_reason=finish, decoding=summary)])
            else:
                body = CompletionResponse(id=response_id, created=created, model=model, choices=[
                    CompletionChoice(index=choice.index, text=text or "", finish_reason=finish, decoding=summary)])
            return b"data: " + body.model_dump_json().encode() + b"\n\n"

        try:
            if chat:
                for c in choices:
                    yield chunk(c, "", first=True)
            async for choice, piece in self._run(choices, queue, request):
                if piece:
                    yield chunk(choice, piece)
                if choice.finished:  # the finish reason and the summary come in a chunk of their own
                    yield chunk(choice, None if chat else "", last=True)
            if any(not c.finished for c in choices):
                return  # the client went away
            if include_usage:
                usage = self._usage(choices)
                kind: Any = ChatCompletionChunk if chat else CompletionResponse
                body = kind(id=response_id, created=created, model=model, choices=[], usage=usage)
                yield b"data: " + body.model_dump_json().encode() + b"\n\n"
            yield b"data: [DONE]\n\n"
        except APIError as err:
            self.metrics.labels(self.metrics.request_errors, status=str(err.status)).inc()
            yield f"data: {json.dumps(error_body(err.status, err.message, err.param, err.code))}\n\n".encode()
            yield b"data: [DONE]\n\n"
