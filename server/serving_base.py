"""What the generating endpoints share: from an OpenAI request to engine submissions, and the one loop
from engine events to the text a client may be sent.

Each prompt's request is resolved once (server/request_knobs.py: its knobs, then `Engine.resolve`),
priced (`--max-decode-steps`) and submitted as it is. `max_tokens` is a ceiling: the output path
cuts the response there. One loop (`_run`) serves streamed and whole responses alike through each
choice's `ChoiceOutput` (server/output.py).
`serving_completions.py` and `serving_chat.py` say what differs: the prompt, the logprobs field,
the response and chunk objects.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any, Optional

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from engine.decoding import DecodeParams
from engine.loading.tokenizer import encode_text
from engine.request import Resolved
from server import sse
from server.engine_loop import EngineLoop, QueueFull, Submission
from server.errors import APIError, ClientDisconnected, engine_error
from server.metrics import Metrics
from server.output import ChoiceOutput
from server.protocol import (
    DecodingSummary,
    PromptTokensDetails,
    Usage,
    new_id,
    now,
)
from server.request_cost import DECODE_STEPS_EXCEEDED, check_decode_steps
from server.request_knobs import (
    CONTEXT_LENGTH_EXCEEDED,
    INVALID_DECODING,
    UNKNOWN_PROFILE,
    GenerateRequest,
    RequestKnobs,
)
from server.settings import ServerSettings

log = logging.getLogger("uvicorn.error")
# The error codes of the rules a schema cannot state (docs/server.md): a schema-valid request is
# answered, or refused with one of these (tests/operations/test_fuzz.py checks exactly that).
TOO_MANY_CHOICES = "too_many_choices"  # n x prompts above --max-n
LOGPROBS_REQUIRED = "logprobs_required"  # top_logprobs without logprobs: true
CHAT_TEMPLATE_ERROR = "chat_template_error"  # the checkpoint's template refuses these messages
EMPTY_PROMPT = "empty_prompt"  # a text that encodes to no token
SCORING_TOO_LARGE = "scoring_too_large"  # echo + logprobs above --max-score-tokens
INVALID_UNICODE = "invalid_unicode"  # a lone surrogate escape in a string (valid JSON, not text)
MASK_TOKEN_IN_PROMPT = "mask_token_in_prompt"  # token-id prompt holding the mask id (engine.check_prompt)
CROSS_FIELD_CODES = (CONTEXT_LENGTH_EXCEEDED, INVALID_DECODING, TOO_MANY_CHOICES, LOGPROBS_REQUIRED,
                     CHAT_TEMPLATE_ERROR, EMPTY_PROMPT, SCORING_TOO_LARGE, INVALID_UNICODE, UNKNOWN_PROFILE,
                     DECODE_STEPS_EXCEEDED, MASK_TOKEN_IN_PROMPT)
# How often a request waiting on the engine checks whether its client is still there.
DISCONNECT_POLL_SECONDS = 0.25


def check_model(model: Optional[str], served: str) -> None:
    if model is not None and model != served:
        raise APIError(404, f"The model '{model}' does not exist; this server serves '{served}'", param="model",
                       code="model_not_found")


class DisconnectWatch:
    """Asks the ASGI server whether the client is still there, at most once per poll interval."""

    def __init__(self, request: Request, clock: Callable[[], float] = time.monotonic) -> None:
        self._request, self._clock = request, clock
        self._next_look = clock() + DISCONNECT_POLL_SECONDS

    async def gone(self) -> bool:
        now = self._clock()
        if now < self._next_look:
            return False
        self._next_look = now + DISCONNECT_POLL_SECONDS
        return await self._request.is_disconnected()


class ServingBase(RequestKnobs):
    """The request -> engine -> response path of a generating endpoint; subclasses give its shape."""

    id_prefix = "cmpl"
    chunk_type: Any = None  # the streamed chunk's class

    def __init__(self, loop: EngineLoop, settings: ServerSettings, metrics: Metrics) -> None:
        self.loop = loop
        self.settings = settings
        self.metrics = metrics
        self.max_model_len = loop.max_model_len
        self.load_knobs(settings)

    # ------------------------------------------------------------------ what an endpoint says

    def prompts(self, body: GenerateRequest) -> list[list[int]]:
        """The token ids of each prompt of the request."""
        raise NotImplementedError

    async def prepare(self, body: GenerateRequest, prompts: list[list[int]], params: DecodeParams,
                      choices: list[ChoiceOutput]) -> None:
        """Work before the choices are submitted (completions: the echoed prompts)."""

    def response(self, response_id: str, choices: list[ChoiceOutput], usage: Usage) -> Any:
        """The whole (non-streamed) response object."""
        raise NotImplementedError

    def opening_chunks(self, response_id: str, created: int, choices: list[ChoiceOutput]) -> list[Any]:
        """Chunks sent before any token (chat: each choice's role)."""
        return []

    def chunk(self, response_id: str, created: int, choice: ChoiceOutput, text: Optional[str], last: bool,
              usage: Optional[Usage]) -> Any:
        """The chunk object carrying `text` of `choice` (with its finish reason when `last`)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ requests -> engine

    async def create(self, body: GenerateRequest, request: Request) -> Any:
        check_model(body.model, self.settings.model_name)
        prompts = self.prompts(body)
        if len(prompts) * body.n > self.settings.max_n:
            raise APIError(400, f"n x prompts = {len(prompts) * body.n} exceeds this server's limit of "
                           f"{self.settings.max_n} completions per request", param="n", code=TOO_MANY_CHOICES)
        max_tokens = getattr(body, "max_completion_tokens", None)
        max_tokens = body.max_tokens if max_tokens is None else max_tokens
        resolved = self.resolve(body, prompts, max_tokens)  # once: priced here, submitted as it is
        for one in resolved:
            check_decode_steps(one.params, body, max_tokens, self.settings.max_decode_steps)
        queue: asyncio.Queue = asyncio.Queue()
        choices, submissions = self._choices(body, resolved, max_tokens, queue)
        await self.prepare(body, prompts, resolved[0].params, choices)
        self._submit(body, max_tokens, choices, submissions)
        return await self.serve(body, request, choices, queue)

    def _choices(self, body: GenerateRequest, resolved: list[Resolved], max_tokens: Optional[int],
                 queue: asyncio.Queue) -> tuple[list[ChoiceOutput], list[Submission]]:
        n = body.n
        loop = asyncio.get_running_loop()
        choices, submissions = [], []
        for p_index, one in enumerate(resolved):
            params = one.params
            end_ids = frozenset() if params.ignore_eos else self.loop.end_ids
            for j in range(n):
                request = one
                if params.temperature > 0 and params.seed is not None and j:  # n samples, not n copies
                    request = replace(one, params=params.with_overrides(seed=params.seed + j))
                request_id = new_id("req")
                submissions.append(Submission(request_id, request, p_index * n + j, queue, loop, stream=body.stream))
                choices.append(ChoiceOutput(p_index * n + j, request_id, list(one.prompt_ids), self.loop.tokenizer,
                                            end_ids, body.stop_strings, max_tokens,
                                            logprobs=params.logprobs is not None, first_of_prompt=j == 0))
        return choices, submissions

    def _submit(self, body: GenerateRequest, max_tokens: Optional[int], choices: list[ChoiceOutput],
                submissions: list[Submission]) -> None:
        """Queue every choice in the engine, or none; with max_tokens 0 each ends at once."""
        if max_tokens == 0:
            for choice in choices:
                choice.finish_unstarted()
            return
        try:
            self.loop.submit(submissions)
        except QueueFull as err:
            raise engine_error(err, retry_after=self.loop.retry_after()) from None

    # ------------------------------------------------------------------ engine -> response

    def _record(self, choice: ChoiceOutput) -> None:
        m = self.metrics
        if choice.first_of_prompt:  # a prompt counts once, as in usage
            m.labels(m.prompt_tokens).inc(len(choice.prompt_ids))
        choice.completion_count = choice.completion_tokens(self._count_tokens)  # counted once, at the finish
        m.labels(m.generation_tokens).inc(choice.completion_count)
        m.labels(m.request_success, finished_reason=choice.finish_reason).inc()

    def _count_tokens(self, text: str) -> int:
        return len(encode_text(self.loop.tokenizer, text)) if self.loop.tokenizer is not None else 0

    @staticmethod
    def usage(choices: list[ChoiceOutput], so_far: bool = False) -> Usage:
        """Tokens of the finished choices, or (`so_far`) those generated until now; each prompt counts
        once, however many choices it has (`n`), as vLLM and OpenAI count it, with the tokens of it
        restored from the prefix cache (OpenAI's `prompt_tokens_details.cached_tokens`)."""
        prompt = sum(len(c.prompt_ids) for c in choices if c.first_of_prompt)
        cached = sum(c.cached_tokens for c in choices if c.first_of_prompt)
        completion = sum(c.generated_count if so_far else c.completion_count for c in choices)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))

    @staticmethod
    def summary(choice: ChoiceOutput) -> Optional[DecodingSummary]:
        """What the decoder did for the choice: its whole decode, or, when the output path ended it
        first (a stop string or max_tokens in a stream), the steps it took until then; None when
        nothing was decoded (max_tokens 0)."""
        if choice.result is None:
            return choice.summary_at_stop
        return DecodingSummary.of(choice.result.stats, choice.joules)

    async def _next_event(self, queue: asyncio.Queue, deadline: float, watch: DisconnectWatch) -> Any:
        """The next engine event for this request; None if the client has gone; 504 past the deadline.
        The client is looked at every poll interval even while events keep coming: a request whose
        rows yield a delta every step would otherwise hold its rows until it finishes."""
        while True:
            if await watch.gone():
                return None
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise APIError(504, f"request timed out after {self.settings.request_timeout:g} s", code="timeout")
            try:
                return await asyncio.wait_for(queue.get(), timeout=min(DISCONNECT_POLL_SECONDS, remaining))
            except asyncio.TimeoutError:
                continue

    async def _run(self, choices: list[ChoiceOutput], queue: asyncio.Queue,
                   request: Request) -> AsyncIterator[tuple[ChoiceOutput, str]]:
        """The one output loop: yields (choice, text that may be sent now) as deltas arrive; a choice's
        last piece comes with `choice.finished` set. Aborts what is left on any exit."""
        deadline = time.monotonic() + self.settings.request_timeout
        watch = DisconnectWatch(request)
        by_index = {c.index: c for c in choices}
        pending = {c.index for c in choices if not c.finished}
        for choice in choices:
            if choice.finished:  # ended before any decoding (max_tokens 0)
                self._record(choice)
                yield choice, choice.take()
        try:
            while pending:
                event = await self._next_event(queue, deadline, watch)
                if event is None:
                    return  # the client went away
                choice = by_index[event.choice]
                if choice.finished:
                    continue
                choice.cached_tokens = max(choice.cached_tokens, event.cached_tokens)
                if event.kind == "error":  # the engine failed (our bug: 500), or the server is stopping (503)
                    raise APIError(event.status, event.message, code=event.code or "internal_error")
                choice.add(event.ids, event.logprobs)
                if event.kind == "done":
                    choice.finish(event.result, event.joules)
                elif choice.stopped_early:  # the rest cannot change the answer: free the row now
                    self.loop.abort(choice.request_id)
                    choice.finish(None)
                    choice.summary_at_stop = event.summary  # the steps it took until here
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

    async def serve(self, body: GenerateRequest, request: Request, choices: list[ChoiceOutput],
                    queue: asyncio.Queue) -> Any:
        """The response to submitted choices: a stream of chunks, or the whole response."""
        response_id = new_id(self.id_prefix)
        if body.stream:
            options = body.stream_options
            include_usage = bool(options and options.include_usage)
            continuous = bool(include_usage and options and options.continuous_usage_stats)
            return StreamingResponse(self._stream(choices, queue, request, response_id, include_usage, continuous),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        async for _ in self._run(choices, queue, request):
            pass
        if any(not c.finished for c in choices):
            raise ClientDisconnected  # nobody to answer; the rows were freed by _run
        body = self.response(response_id, choices, self.usage(choices))
        return Response(content=body.model_dump_json(), media_type="application/json")

    def _client_gone(self) -> None:
        self.metrics.labels(self.metrics.client_disconnects).inc()
        log.info("client disconnected: its request was aborted and its rows freed")

    async def _stream(self, choices: list[ChoiceOutput], queue: asyncio.Queue, request: Request, response_id: str,
                      include_usage: bool, continuous_usage: bool) -> AsyncIterator[bytes]:
        created = now()

        def chunk(choice: ChoiceOutput, text: Optional[str], last: bool = False) -> bytes:
            usage = self.usage(choices, so_far=True) if continuous_usage else None  # vLLM's continuous_usage_stats
            return sse.event(self.chunk(response_id, created, choice, text, last, usage))

        try:
            for opening in self.opening_chunks(response_id, created, choices):
                yield sse.event(opening)
            async for choice, piece in self._run(choices, queue, request):
                if piece:
                    yield chunk(choice, piece)
                if choice.finished:  # the finish reason and the summary come in a chunk of their own
                    yield chunk(choice, None, last=True)
            if any(not c.finished for c in choices):
                self._client_gone()
                return
            if include_usage:
                yield sse.event(self.chunk_type(id=response_id, created=created, model=self.settings.model_name,
                                                choices=[], usage=self.usage(choices)))
            yield sse.DONE
        except APIError as err:
            self.metrics.labels(self.metrics.request_errors, status=str(err.status)).inc()
            yield sse.event(err.body())
            yield sse.DONE
        except (asyncio.CancelledError, GeneratorExit):  # the server stopped the stream: its client left
            if any(not c.finished for c in choices):
                self._client_gone()
            raise
