"""From an OpenAI request to engine submissions, and from engine events to JSON or SSE chunks.

- decoding knobs: model defaults <- `--default-decoding` <- the request's `decoding` object <- its
  OpenAI and vLLM fields (`temperature`, `seed`, `top_p`, `top_k`, `min_p`, `ignore_eos`, logprobs,
  `max_tokens`); the engine validates the request and fills the model's defaults once, when it is
  submitted;
- `max_tokens` sets the generation canvas, rounded up to whole blocks (block_length, 32 by default;
  Dream's own policies decode one block of exactly max_tokens), and is a ceiling: the output path
  cuts the response at max_tokens tokens (finish_reason "length") and frees the row;
- one loop (`_run`) serves streamed and whole responses alike: it feeds each choice's token deltas
  to its `ChoiceOutput` (server/output.py: incremental detokenization, end tokens, stop strings,
  finish reasons) and yields what may be sent; a whole response is the same pieces joined.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Mapping
from functools import partial
from typing import Any, Optional, Union

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from engine import Engine, RequestError
from engine.decoding import DecodeParamError, DecodeParams, GenerationRequest
from engine.decoding.params import field_types
from engine.decoding.profiles import DecodingProfile, load_profile, profile_table
from engine.decoding.types import TokenLogprob
from engine.loading.tokenizer import encode_text
from server.errors import APIError, ClientDisconnected, error_body
from server.metrics import Metrics
from server.output import ChoiceOutput, Echo, LoggedToken, logged_tokens
from server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DecodingSummary,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    TokenizerInfo,
    TokenLogprobEntry,
    TopLogprob,
    Usage,
    new_id,
    now,
)
from server.scheduler import EngineLoop, QueueFull, ShuttingDown, Submission
from server.settings import ServerSettings

log = logging.getLogger("uvicorn.error")
DEFAULT_BLOCK = 32
# The error codes of the rules a schema cannot state (docs/server.md): a schema-valid request is
# answered, or refused with one of these (tests/test_fuzz.py checks exactly that).
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
INVALID_DECODING = "invalid_decoding"  # a knob's range, or a rule between knobs (DecodeParams)
TOO_MANY_CHOICES = "too_many_choices"  # n x prompts above --max-n
# Knobs an OpenAI/vLLM request field sets, over the decoding object's value
_OPENAI_KNOBS = ("temperature", "seed", "top_p", "top_k", "min_p", "ignore_eos", "logprobs")
LOGPROBS_REQUIRED = "logprobs_required"  # top_logprobs without logprobs: true
CHAT_TEMPLATE_ERROR = "chat_template_error"  # the checkpoint's template refuses these messages
EMPTY_PROMPT = "empty_prompt"  # a text that encodes to no token
SCORING_TOO_LARGE = "scoring_too_large"  # echo + logprobs above --max-score-tokens
INVALID_UNICODE = "invalid_unicode"  # a lone surrogate escape in a string (valid JSON, not text)
UNKNOWN_PROFILE = "unknown_profile"  # decoding.profile names no profile this server loaded
CROSS_FIELD_CODES = (CONTEXT_LENGTH_EXCEEDED, INVALID_DECODING, TOO_MANY_CHOICES, LOGPROBS_REQUIRED,
                     CHAT_TEMPLATE_ERROR, EMPTY_PROMPT, SCORING_TOO_LARGE, INVALID_UNICODE, UNKNOWN_PROFILE)
# How often a request waiting on the engine checks whether its client is still there.
_DISCONNECT_POLL_SECONDS = 0.25


def completion_logprobs(choice: ChoiceOutput, logged: list[LoggedToken], echoed: Optional[list[LoggedToken]] = None,
                        shift: int = 0) -> Optional[CompletionLogprobs]:
    """The legacy completions `logprobs` object of these tokens, after the echoed prompt's when given,
    the generated tokens' offsets moved past the prompt text by `shift` (None when not asked for)."""
    if choice.logged is None:
        return None
    entries = [*(echoed or []), *(LoggedToken(e.text, e.offset + shift, e.logprob) for e in logged)]
    tops: list[Optional[dict[str, float]]] = []
    for entry in entries:
        if entry.logprob is None:
            tops.append(None)
            continue
        top = {choice.token_text(token): value for token, value in entry.logprob.top}
        top.setdefault(entry.text, entry.logprob.logprob)
        tops.append(top)
    return CompletionLogprobs(tokens=[e.text for e in entries],
                              token_logprobs=[None if e.logprob is None else e.logprob.logprob for e in entries],
                              top_logprobs=tops, text_offset=[e.offset for e in entries])


_INT_KNOBS = frozenset(name for name, (kind, _) in field_types().items() if kind is int)


def _integral_knobs(decoding: dict[str, Any]) -> dict[str, Any]:
    """Integer knobs written as integral floats (7.0) become integers, as JSON Schema counts them."""
    return {name: int(value) if name in _INT_KNOBS and isinstance(value, float) and value.is_integer() else value
            for name, value in decoding.items()}


def _echoed(choice: ChoiceOutput) -> tuple[Optional[list[LoggedToken]], int]:
    """The echoed prompt's logged tokens and the length of its text (what generated offsets move by)."""
    if choice.echo is None:
        return None, 0
    return choice.echo.logged, len(choice.echo.text)


def chat_logprobs(choice: ChoiceOutput, logged: list[LoggedToken]) -> Optional[ChatLogprobs]:
    """The chat `logprobs` object of these tokens (None when not asked for)."""
    if choice.logged is None:
        return None

    def top(text: str, value: float) -> dict[str, Any]:
        return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}

    return ChatLogprobs(content=[TokenLogprobEntry(
        **top(e.text, e.logprob.logprob),
        top_logprobs=[TopLogprob(**top(choice.token_text(t), v)) for t, v in e.logprob.top])
        for e in logged if e.logprob is not None])


def _json(body: Any) -> Response:
    """A response body serialized by pydantic's own encoder (no dict and json.dumps in between)."""
    return Response(content=body.model_dump_json(), media_type="application/json")


class _DisconnectWatch:
    """Asks the ASGI server whether the client is still there, at most once per poll interval."""

    def __init__(self, request: Request, clock: Callable[[], float] = time.monotonic) -> None:
        self._request, self._clock = request, clock
        self._next_look = clock() + _DISCONNECT_POLL_SECONDS

    async def gone(self) -> bool:
        now = self._clock()
        if now < self._next_look:
            return False
        self._next_look = now + _DISCONNECT_POLL_SECONDS
        return await self._request.is_disconnected()


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
        loaded = [load_profile(path) for path in settings.decoding_profiles]
        self.profiles = profile_table(loaded)
        self.default_profile: Optional[DecodingProfile] = loaded[0] if loaded else None

    def _profile_knobs(self, decoding: dict[str, Any]) -> Mapping[str, Any]:
        """The knobs of the profile the request names (`decoding.profile`, taken out of `decoding`),
        or of the server's default profile; read only (they are spread into the request's knobs)."""
        if "profile" not in decoding:
            return self.default_profile.decoding if self.default_profile else {}
        name = decoding.pop("profile")
        if not isinstance(name, str) or name not in self.profiles:
            raise APIError(400, f"decoding.profile: unknown profile {name!r}; this server has "
                           f"{', '.join(self.profiles)}", param="decoding.profile", code=UNKNOWN_PROFILE)
        return self.profiles[name].decoding

    # ------------------------------------------------------------------ requests -> engine

    @staticmethod
    def _logprobs_field(body: Union[CompletionRequest, ChatCompletionRequest]) -> str:
        return "top_logprobs" if isinstance(body, ChatCompletionRequest) else "logprobs"

    @staticmethod
    def _logprobs(body: Union[CompletionRequest, ChatCompletionRequest]) -> Optional[int]:
        """Top alternatives per token the request asks for (None: no logprobs)."""
        if isinstance(body, CompletionRequest):
            return body.logprobs
        if body.logprobs:
            return body.top_logprobs or 0
        if body.top_logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code=LOGPROBS_REQUIRED)
        return None

    def _params(self, body: Union[CompletionRequest, ChatCompletionRequest], max_tokens: Optional[int],
                longest_prompt: int) -> DecodeParams:
        if body.decoding and "gen_length" in body.decoding:  # one way to set the canvas, not two
            raise APIError(400, "decoding.gen_length: the generation canvas is set by max_tokens "
                           "(max_completion_tokens in chat)", param="decoding.gen_length", code=INVALID_DECODING)
        decoding = dict(body.decoding or {})
        profile = self._profile_knobs(decoding)
        # the server's defaults, then the profile, then the request's own knobs and OpenAI fields
        knobs: dict[str, Any] = {**self._defaults, **profile, **_integral_knobs(decoding)}
        for name in ("temperature", "seed", "top_p", "top_k", "min_p"):
            if getattr(body, name) is not None:
                knobs[name] = getattr(body, name)
        if body.ignore_eos:
            knobs["ignore_eos"] = True
        logprobs = self._logprobs(body)
        if logprobs is not None:
            knobs["logprobs"] = logprobs
        if max_tokens is not None:
            knobs["gen_length"] = self._canvas(max_tokens, knobs)
        else:
            knobs["gen_length"] = self._default_canvas(knobs, self.max_model_len - longest_prompt)
        try:
            if any(name in decoding for name in _OPENAI_KNOBS):
                # an OpenAI field set above wins over the decoding object's value, which must still be
                # valid in itself (a request the schema rejects is never served)
                DecodeParams.from_dict({**knobs, **_integral_knobs(decoding)})
            params = DecodeParams.from_dict(knobs)
        except DecodeParamError as err:
            from_body = err.param in (body.decoding or {}) or err.param == "gen_length"
            if err.param == "gen_length":
                param = "max_tokens"
            elif err.param == "logprobs" and "logprobs" not in (body.decoding or {}):
                param = self._logprobs_field(body)
            else:
                param = f"decoding.{err.param}" if from_body else err.param
            raise APIError(400, str(err), param=param, code=INVALID_DECODING) from None
        except TypeError as err:
            raise APIError(400, f"invalid decoding object: {err}", param="decoding", code=INVALID_DECODING) from None
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

    @staticmethod
    def _default_canvas(knobs: dict[str, Any], room: int) -> Any:
        """The canvas when max_tokens is not given: the default length, shrunk to whole blocks that fit
        the context left after the prompt (as vLLM's default max_tokens is what the context leaves).
        A canvas the request fixed itself (decoding.block_length that cannot fit) is left to be refused."""
        wanted = knobs.get("gen_length", DecodeParams.gen_length)
        if not isinstance(wanted, int) or isinstance(wanted, bool) or wanted <= room or room < 1:
            return wanted
        block = knobs.get("block_length")
        if block is not None:
            if not isinstance(block, int) or isinstance(block, bool) or block < 1 or room < block:
                return wanted
            return room // block * block
        if str(knobs.get("policy", "")).startswith("dream-") or room <= DEFAULT_BLOCK:
            return room
        return room // DEFAULT_BLOCK * DEFAULT_BLOCK

    def _queue_full(self) -> APIError:
        return APIError(429, "The server is at capacity: the waiting queue is full; retry later",
                        code="queue_full", headers={"Retry-After": str(self.loop.retry_after())})

    def _context_param(self, body: Union[CompletionRequest, ChatCompletionRequest], prompt_len: int,
                       max_tokens: Optional[int]) -> str:
        """The field a context overflow is about: the prompt when it fills the context alone, the
        block length when only rounding max_tokens up to whole blocks overflows, else max_tokens."""
        if prompt_len >= self.max_model_len:
            return "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
        if max_tokens is not None and prompt_len + max_tokens <= self.max_model_len \
                and "block_length" in (body.decoding or {}):
            return "decoding.block_length"
        return "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"

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
        return self._chat_ids(body.messages, add_generation_prompt=True)

    def _chat_ids(self, chat: list[ChatMessage], add_generation_prompt: bool) -> list[int]:
        from engine.chat import chat_prompt_ids

        if self.engine.tokenizer is None or not getattr(self.engine.tokenizer, "chat_template", None):
            raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text} for m in chat]
        try:
            return chat_prompt_ids(self.engine.tokenizer, messages, add_generation_prompt=add_generation_prompt)
        except Exception as err:  # the checkpoint's template refused these messages
            raise APIError(400, f"the chat template cannot render these messages: {err}", param="messages",
                           code=CHAT_TEMPLATE_ERROR) from None

    def _submit_all(self, body: Union[CompletionRequest, ChatCompletionRequest], prompts: list[list[int]],
                    params: DecodeParams, max_tokens: Optional[int]) -> tuple[list[ChoiceOutput], asyncio.Queue]:
        n, stream, stops = body.n, body.stream, body.stop_strings
        end_ids = frozenset() if params.ignore_eos else self.end_ids
        if len(prompts) * n > self.settings.max_n:
            raise APIError(400, f"n x prompts = {len(prompts) * n} exceeds this server's limit of "
                           f"{self.settings.max_n} completions per request", param="n", code=TOO_MANY_CHOICES)
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        choices: list[ChoiceOutput] = []
        submitted: list[str] = []
        if max_tokens == 0:  # nothing to decode: every choice ends at once
            for ids in prompts:
                try:
                    self.engine.check_prompt(ids)
                except RequestError as err:
                    raise APIError(400, str(err), param="prompt", code=err.code) from None
            choices = [ChoiceOutput(p_index * n + j, new_id("req"), ids, self.engine.tokenizer, end_ids, stops, 0,
                                    logprobs=params.logprobs is not None)
                       for p_index, ids in enumerate(prompts) for j in range(n)]
            for choice in choices:
                choice.finish_unstarted()
            return choices, queue
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
                                                end_ids, stops, max_tokens, logprobs=params.logprobs is not None))
        except (QueueFull, RequestError) as err:
            for request_id in submitted:
                self.loop.abort(request_id)
            if isinstance(err, QueueFull):
                raise self._queue_full() from None
            if err.code == CONTEXT_LENGTH_EXCEEDED:
                param = self._context_param(body, max(map(len, prompts)), max_tokens)
            else:
                param = {"gen_length": "max_tokens", "logprobs": self._logprobs_field(body)}.get(err.param, "prompt")
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

    async def _next_event(self, queue: asyncio.Queue, deadline: float, watch: _DisconnectWatch) -> Any:
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
                return await asyncio.wait_for(queue.get(), timeout=min(_DISCONNECT_POLL_SECONDS, remaining))
            except asyncio.TimeoutError:
                continue

    async def _run(self, choices: list[ChoiceOutput], queue: asyncio.Queue,
                   request: Request) -> AsyncIterator[tuple[ChoiceOutput, str]]:
        """The one output loop: yields (choice, text that may be sent now) as deltas arrive; a choice's
        last piece comes with `choice.finished` set. Aborts what is left on any exit."""
        deadline = time.monotonic() + self.settings.request_timeout
        watch = _DisconnectWatch(request)
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
                if event.kind == "error":  # the engine failed (our bug: 500), or the server is stopping (503)
                    raise APIError(event.status, event.message, code=event.code or "internal_error")
                choice.add(event.ids, event.logprobs)
                if event.kind == "done":
                    choice.finish(event.result, event.joules)
                elif choice.stopped_early:  # the rest cannot change the answer: free the row now
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

    def tokenize(self, body: Union[TokenizeCompletionRequest, TokenizeChatRequest]) -> TokenizeResponse:
        """vLLM's /tokenize: the ids /v1/completions (prompt) or /v1/chat/completions (messages)
        would decode from."""
        self._check_model(body.model)
        if isinstance(body, TokenizeChatRequest):
            ids = self._chat_ids(body.messages, body.add_generation_prompt)
        else:
            if self.engine.tokenizer is None:
                raise APIError(400, "this model has no tokenizer", param="prompt")
            ids = encode_text(self.engine.tokenizer, body.prompt)
        strs = None
        if body.return_token_strs and self.engine.tokenizer is not None:
            strs = self.engine.tokenizer.convert_ids_to_tokens(ids)
        return TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids, token_strs=strs)

    def tokenizer_info(self) -> TokenizerInfo:
        """vLLM's /tokenizer_info: what a client needs to tokenize as the server does (lm-eval's
        remote tokenizer reads it)."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise APIError(404, "this model has no tokenizer", code="not_found")
        return TokenizerInfo(tokenizer_class=type(tokenizer).__name__, eos_token=tokenizer.eos_token,
                             bos_token=tokenizer.bos_token, pad_token=tokenizer.pad_token,
                             chat_template=getattr(tokenizer, "chat_template", None),
                             model_max_length=self.max_model_len)

    def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        self._check_model(body.model)
        if self.engine.tokenizer is None:
            raise APIError(400, "this model has no tokenizer", param="tokens")
        vocab = self.engine.model.config.vocab_size
        bad = next((t for t in body.tokens if t >= vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
        return DetokenizeResponse(prompt=self.engine.tokenizer.decode(body.tokens))

    async def completions(self, body: CompletionRequest, request: Request) -> Any:
        self._check_model(body.model)
        prompts = self._completion_prompts(body)
        params = self._params(body, body.max_tokens or None, max(map(len, prompts)))  # 0: nothing to decode
        echoes = await self._echoes(prompts, params, body) if body.echo else None
        return await self._serve(body, request, prompts, params, body.max_tokens, chat=False, echoes=echoes)

    async def _echoes(self, prompts: list[list[int]], params: DecodeParams, body: CompletionRequest) -> list[Echo]:
        """Each prompt's text and, with logprobs, its per-token likelihood estimates (engine.scoring,
        run on the engine thread between steps)."""
        tokenizer = self.engine.tokenizer
        echoes = []
        for ids in prompts:
            text = tokenizer.decode(ids) if tokenizer is not None else " ".join(map(str, ids))
            if params.logprobs is None:
                echoes.append(Echo(text, None))
                continue
            try:
                self.engine.check_score(ids, params.score_samples)
                scores = await self.loop.run_job(partial(self.engine.score, ids, params.score_samples, body.seed or 0))
            except RequestError as err:
                param = {"score_samples": "decoding.score_samples", "echo": "echo"}.get(err.param, "prompt")
                raise APIError(400, str(err), param=param, code=err.code) from None
            except ShuttingDown as err:
                raise APIError(503, str(err), code="shutting_down") from None
            except QueueFull:
                raise self._queue_full() from None
            values = [None if v is None else TokenLogprob(t, v) for t, v in zip(ids, scores, strict=True)]
            echoes.append(Echo(text, logged_tokens(tokenizer, ids, values)))
        return echoes

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Any:
        self._check_model(body.model)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        prompt = self._chat_prompt(body)
        params = self._params(body, max_tokens or None, len(prompt))  # 0: nothing to decode
        return await self._serve(body, request, [prompt], params, max_tokens, chat=True)

    async def _serve(self, body: Union[CompletionRequest, ChatCompletionRequest], request: Request,
                     prompts: list[list[int]], params: DecodeParams, max_tokens: Optional[int], chat: bool,
                     echoes: Optional[list[Echo]] = None) -> Any:
        choices, queue = self._submit_all(body, prompts, params, max_tokens)
        if echoes is not None:
            for choice in choices:
                choice.echo = echoes[choice.index // body.n]
        response_id = new_id("chatcmpl" if chat else "cmpl")
        if body.stream:
            options = body.stream_options
            include_usage = bool(options and options.include_usage)
            continuous = bool(include_usage and options and options.continuous_usage_stats)
            return StreamingResponse(self._stream(choices, queue, request, chat, response_id, include_usage,
                                                  continuous),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        async for _ in self._run(choices, queue, request):
            pass
        if any(not c.finished for c in choices):
            raise ClientDisconnected  # nobody to answer; the rows were freed by _run
        created, model, usage = now(), self.settings.model_name, self._usage(choices)
        if chat:
            return _json(ChatCompletionResponse(
                id=response_id, created=created, model=model, usage=usage,
                choices=[ChatChoice(index=c.index, message=AssistantMessage(content=c.text),
                                    finish_reason=c.finish_reason, logprobs=chat_logprobs(c, c.take_logprobs()),
                                    decoding=self._summary(c)) for c in choices],
            ))
        return _json(CompletionResponse(
            id=response_id, created=created, model=model, usage=usage,
            choices=[CompletionChoice(index=c.index, text=(c.echo.text if c.echo else "") + c.text,
                                      finish_reason=c.finish_reason,
                                      logprobs=completion_logprobs(c, c.take_logprobs(), *_echoed(c)),
                                      decoding=self._summary(c)) for c in choices],
        ))

    def _client_gone(self) -> None:
        self.metrics.labels(self.metrics.client_disconnects).inc()
        log.info("client disconnected: its request was aborted and its rows freed")

    async def _stream(self, choices: list[ChoiceOutput], queue: asyncio.Queue, request: Request, chat: bool,
                      response_id: str, include_usage: bool, continuous_usage: bool) -> AsyncIterator[bytes]:
        created, model = now(), self.settings.model_name
        prompt_tokens = sum(len(c.prompt_ids) for c in choices)

        def chunk(choice: ChoiceOutput, text: Optional[str], first: bool = False, last: bool = False,
                  echo: Optional[Echo] = None) -> bytes:
            finish = choice.finish_reason if last else None
            summary = self._summary(choice) if last else None
            usage = None
            if continuous_usage:  # vLLM's continuous_usage_stats: the tokens so far, in every chunk
                completion = sum(len(c.token_ids) for c in choices)
                usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=completion,
                              total_tokens=prompt_tokens + completion)
            if echo is not None:  # the echoed prompt, in a chunk before the completion's
                logprobs = completion_logprobs(choice, [], echo.logged or [])
                body: Any = CompletionResponse(id=response_id, created=created, model=model, usage=usage, choices=[
                    CompletionChoice(index=choice.index, text=echo.text, finish_reason=None, logprobs=logprobs)])
                return b"data: " + body.model_dump_json().encode() + b"\n\n"
            logged = choice.take_logprobs()
            if chat:
                delta = ChatDelta(role="assistant" if first else None, content=text)
                body: Any = ChatCompletionChunk(id=response_id, created=created, model=model, usage=usage, choices=[
                    ChatStreamChoice(index=choice.index, delta=delta, finish_reason=finish, decoding=summary,
                                     logprobs=chat_logprobs(choice, logged) if logged else None)])
            else:
                shift = len(choice.echo.text) if choice.echo else 0
                body = CompletionResponse(id=response_id, created=created, model=model, usage=usage, choices=[
                    CompletionChoice(index=choice.index, text=text or "", finish_reason=finish, decoding=summary,
                                     logprobs=completion_logprobs(choice, logged, shift=shift) if logged else None)])
            return b"data: " + body.model_dump_json().encode() + b"\n\n"

        try:
            for c in choices:
                if chat:
                    yield chunk(c, "", first=True)
                elif c.echo is not None:
                    yield chunk(c, None, echo=c.echo)
            async for choice, piece in self._run(choices, queue, request):
                if piece:
                    yield chunk(choice, piece)
                if choice.finished:  # the finish reason and the summary come in a chunk of their own
                    yield chunk(choice, None if chat else "", last=True)
            if any(not c.finished for c in choices):
                self._client_gone()
                return
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
        except (asyncio.CancelledError, GeneratorExit):  # the server stopped the stream: its client left
            if any(not c.finished for c in choices):
                self._client_gone()
            raise
