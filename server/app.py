"""The FastAPI app: thin routes over the endpoints' serving objects, plus auth, limits, health and metrics.

The model loads in a background thread at start-up, so `/health` and `/ready` answer at once
(`/ready` says 503 until the model is loaded and warmed up). Bodies are read and parsed here (server/request_body.py),
not by FastAPI, so every malformed body (too large, not UTF-8, not JSON, nested too deep, wrong
types) becomes a clear OpenAI-style 4xx.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from fastapi_offline import FastAPIOffline
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine import Engine, start_engine
from engine.errors import SettingError
from server import openapi
from server.energy import EnergyMeter, open_meter
from server.engine_loop import EngineLoop
from server.errors import CLIENT_CLOSED_REQUEST, APIError, ClientDisconnected, error_response
from server.metrics import Metrics
from server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeRequest,
)
from server.request_body import read_json
from server.serving_base import check_model
from server.serving_chat import ChatServing
from server.serving_completions import CompletionServing
from server.serving_tokenization import TokenizationServing
from server.settings import ServerSettings
from server.version import package_version

EngineFactory = Callable[[ServerSettings], Engine]
log = logging.getLogger("uvicorn.error")  # uvicorn's own log: its format, its --log-level
# vLLM's tokenizer routes live outside /v1 but use the model: the API key guards them too
_GUARDED_OUTSIDE_V1 = frozenset({"/tokenize", "/detokenize", "/tokenizer_info"})
DOCS_ASSETS = "/docs-assets"  # the interactive API pages' scripts and styles


def _load_engine(settings: ServerSettings) -> Engine:
    return start_engine(settings.engine)


@dataclass(frozen=True)
class Servings:
    """One serving object per endpoint family, over the one engine loop."""

    completions: CompletionServing
    chat: ChatServing
    tokenization: TokenizationServing


class AppState:
    """Everything the routes need, filled in once the model is loaded."""

    def __init__(self, settings: ServerSettings, meter: Optional[EnergyMeter]) -> None:
        self.settings = settings
        engine = settings.engine
        self.meter = meter or open_meter(engine.device)  # before the metrics: energy series only with a meter
        engine_info = {"device": engine.device, "dtype": engine.dtype, "quantization": engine.quantization,
                       "quantize_head": str(engine.quantize_head).lower()}
        self.metrics = Metrics(settings.model_name, energy=self.meter.name != "none", engine_info=engine_info)
        self.loop: Optional[EngineLoop] = None
        self.serving: Optional[Servings] = None
        self.load_error: Optional[str] = None
        self.ready = threading.Event()
        self.draining = False
        self.in_flight = 0
        self.started = time.time()

    def start(self, factory: EngineFactory, on_failure: Optional[Callable[[str], None]] = None,
              on_fault: Optional[Callable[[str], None]] = None) -> None:
        began = time.monotonic()
        settings, engine = self.settings, self.settings.engine
        log.info("loading %s on %s (%s), quantization %s%s", engine.model, engine.device, engine.dtype,
                 engine.quantization, " (head too)" if engine.quantize_head else "")
        try:
            loop = EngineLoop(factory(self.settings), self.settings.max_queue, self.metrics, self.meter)
            loop.on_fault = on_fault
            template = self.settings.chat_template_text()
            if template is not None:
                loop.set_chat_template(template)
            loop.warm_up()
            self.serving = Servings(CompletionServing(loop, self.settings, self.metrics),
                                    ChatServing(loop, self.settings, self.metrics),
                                    TokenizationServing(loop, self.settings.model_name))
            # started before it is published: a health check in between would find a loop whose
            # thread is not running yet and report it dead (Ray Serve checks a replica right after its
            # constructor, while this thread may still be here)
            loop.start()
            self.loop = loop
            self.ready.set()
            log.info("ready in %.1f s: serving %s (%s, %s attention, quantization %s) on http://%s:%d",
                     time.monotonic() - began, settings.model_name, loop.architecture, loop.attention_backend,
                     loop.quantization, settings.host, settings.port)
        except Exception as err:  # reported by /ready and /health; `serve` also ends the process
            # a setting the model refuses names the flag; anything else is the load's own failure
            self.load_error = (f"the setting {err}" if isinstance(err, SettingError)
                               else f"the model failed to load: {type(err).__name__}: {err}")
            log.error("%s", self.load_error)
            if on_failure is not None:
                on_failure(self.load_error)

    def limits(self) -> Optional[openapi.Limits]:
        """The bounds the OpenAPI document states, once the model is loaded."""
        loop = self.loop
        if loop is None:
            return None
        return openapi.Limits(model=self.settings.model_name, max_model_len=loop.max_model_len,
                              max_n=self.settings.max_n, max_logprobs=loop.max_logprobs,
                              vocab_size=loop.vocab_size, mask_id=loop.mask_id,
                              profiles=tuple(self.serving.completions.profiles) if self.serving else ())

    def failure(self) -> Optional[tuple[str, str]]:
        """(code, message) of a failure this server will not recover from by itself: the model did
        not load, the engine thread died, or it made no progress for --stall-timeout with work
        pending. /health and Ray Serve's replica health check report it."""
        if self.load_error:
            return "load_failed", self.load_error
        loop = self.loop
        if loop is None:
            return None
        if not loop.alive:
            return "engine_dead", "the engine loop has stopped" + (f": {loop.fault}" if loop.fault else "")
        stalled = time.monotonic() - loop.last_progress
        if loop.num_pending and stalled > self.settings.stall_timeout:
            return "engine_stalled", f"the engine has made no progress for {stalled:.0f} s with work pending"
        return None

    def require_serving(self) -> Servings:
        if self.draining:
            raise APIError(503, "The server is shutting down", code="shutting_down")
        if self.serving is None:
            raise APIError(503, self.load_error or "The model is still loading", code="not_ready")
        return self.serving


def create_app(settings: ServerSettings, engine_factory: EngineFactory = _load_engine,
               meter: Optional[EnergyMeter] = None,
               on_load_failure: Optional[Callable[[str], None]] = None,
               on_engine_fault: Optional[Callable[[str], None]] = None) -> FastAPI:
    """The app; the model loads in a thread when it starts. `on_load_failure(reason)` is called if
    the model fails to load, `on_engine_fault(reason)` if the engine faults once serving (a
    tensor-parallel worker died or hung): `cai-dllm serve` ends the process; without them the app
    keeps answering, with /health (and /ready) at 503 saying why."""
    state = AppState(settings, meter)

    @asynccontextmanager
    async def lifespan(app: FastAPI):  # type: ignore[no-untyped-def]
        loader = threading.Thread(target=state.start, args=(engine_factory, on_load_failure, on_engine_fault),
                                  name="cai-dllm-load", daemon=True)
        loader.start()
        yield
        if state.loop is not None:
            state.loop.stop()

    # /docs and /redoc with their scripts served from the installed fastapi-offline package, not a
    # CDN: the pages work on a machine without internet access (FastAPI's own load from jsDelivr)
    app = FastAPIOffline(title="cai-dllm", version=package_version(), lifespan=lifespan,
                         static_url=DOCS_ASSETS)
    app.state.cai = state
    openapi.install(app, state.limits)

    app.add_middleware(GuardMiddleware, state=state)
    if settings.allowed_origins:  # outside the guard, so a browser's preflight needs no API key
        app.add_middleware(CORSMiddleware, allow_origins=settings.allowed_origins, allow_methods=["*"],
                           allow_headers=["*"])

    @app.exception_handler(APIError)
    async def api_error(_: Request, err: APIError) -> JSONResponse:
        return err.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
        message = "Not found" if err.status_code == 404 else str(err.detail)
        # keeps Starlette's headers, e.g. the `Allow` list a 405 must carry
        return error_response(err.status_code, message, code="not_found" if err.status_code == 404 else None,
                              headers=dict(err.headers or {}))

    @app.exception_handler(ClientDisconnected)
    async def client_gone(_: Request, __: ClientDisconnected) -> Response:
        state.metrics.labels(state.metrics.client_disconnects).inc()
        log.info("client disconnected before its answer: the request was aborted and its rows freed")
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, err: Exception) -> JSONResponse:
        return error_response(500, f"Internal server error: {type(err).__name__}", code="internal_error")

    async def read_body(request: Request, model: type) -> Any:
        data = await read_json(request, settings.max_body_bytes)
        if model is TokenizeRequest:  # the two shapes are told apart by their fields, never guessed
            if ("prompt" in data) == ("messages" in data):
                raise APIError(400, "send exactly one of 'prompt' or 'messages'", param="prompt")
            model = TokenizeCompletionRequest if "prompt" in data else TokenizeChatRequest
        try:
            body = model.model_validate(data)
        except ValidationError as err:
            first = err.errors()[0]
            # union members appear in the location as tags ("constrained-str", "list[int]"): not field names
            param = ".".join(str(p) for p in first["loc"]
                             if isinstance(p, int) or (str(p).isidentifier() and not str(p)[0].isupper())) or None
            message = first["msg"]
            if first["type"] == "extra_forbidden":
                raise APIError(400, f"unknown parameter '{param}'", param=param, code="unknown_parameter") from None
            if first["type"] == "unsupported_value":
                raise APIError(400, f"{param}: this value is not supported: {message}", param=param,
                               code="unsupported_parameter") from None
            if param == "prompt" and len(err.errors()) > 1:
                message = ("must be a non-empty string, a non-empty list of strings, a non-empty list of token ids "
                           "(>= 0), or a non-empty list of such lists")
            raise APIError(400, f"{param}: {message}" if param else message, param=param) from None
        except RecursionError:
            raise APIError(400, "Request body is nested too deeply", code="invalid_json") from None
        return body

    # each route asks for its serving object before it reads the body: a server not ready answers 503 first
    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await state.require_serving().completions.create(await read_body(request, CompletionRequest), request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await state.require_serving().chat.create(await read_body(request, ChatCompletionRequest), request)

    def model_card() -> ModelCard:
        serving = state.require_serving().completions
        assert state.loop is not None and state.meter is not None
        return ModelCard(id=settings.model_name, created=int(state.started), root=settings.engine.model,
                         max_model_len=serving.max_model_len, architecture=state.loop.architecture,
                         energy_meter=state.meter.name, decoding_profiles=list(serving.profiles),
                         default_decoding_profile=serving.default_profile.name if serving.default_profile else None,
                         dtype=settings.engine.dtype, quantization=state.loop.quantization,
                         quantized_head=state.loop.quantized_head)

    @app.get("/v1/models")
    async def models() -> Any:
        return ModelList(data=[model_card()]).model_dump()

    @app.get("/v1/models/{model_id:path}")
    async def model_info(model_id: str) -> Any:
        card = model_card()
        check_model(model_id, card.id)
        return card.model_dump()

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Any:
        return state.require_serving().tokenization.tokenize(await read_body(request, TokenizeRequest))

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> Any:
        return state.require_serving().tokenization.tokenizer_info().model_dump()

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Any:
        return state.require_serving().tokenization.detokenize(await read_body(request, DetokenizeRequest))

    @app.get("/health")
    async def health() -> Response:
        failure = state.failure()
        if failure is not None:
            return error_response(503, failure[1], code=failure[0])
        if not state.ready.is_set():  # healthy means serving: a loading server is not yet
            return error_response(503, "loading the model", code="not_ready")
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        if state.draining:
            return error_response(503, "shutting down", code="shutting_down")
        if not state.ready.is_set():
            return error_response(503, state.load_error or "loading", code="not_ready")
        return JSONResponse({"status": "ready", "model": settings.model_name})

    @app.get("/version")
    async def version_info() -> Any:
        loop = state.loop
        return {"version": package_version(), "model": settings.model_name,
                "architecture": loop.architecture if loop else None,
                "device": settings.engine.device, "dtype": settings.engine.dtype,
                "quantization": settings.engine.quantization,
                "attention_backend": loop.attention_backend if loop else None,
                "energy_meter": state.meter.name if state.meter else None}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


class GuardMiddleware:
    """Auth, draining and the body-size limit for /v1 routes; counts requests in flight until their
    last byte is sent (streams included) and errors by status. Plain ASGI, so streaming and
    disconnect detection pass through untouched."""

    def __init__(self, app: Any, state: AppState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state, settings = self.state, self.state.settings
        guarded = scope["path"].startswith("/v1") or scope["path"] in _GUARDED_OUTSIDE_V1
        if guarded:
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
            refusal = None
            if settings.api_key is not None and not _authorized(headers.get("authorization", ""), settings.api_key):
                refusal = error_response(401, "Invalid or missing API key (send Authorization: Bearer <key>)",
                                         code="invalid_api_key")
            elif state.draining:
                refusal = error_response(503, "The server is shutting down", code="shutting_down")
            else:
                length = headers.get("content-length", "")
                if length.isdigit() and int(length) > settings.max_body_bytes:
                    refusal = error_response(413, f"Request body exceeds {settings.max_body_bytes} bytes",
                                             code="request_too_large")
            if refusal is not None:
                state.metrics.labels(state.metrics.request_errors, status=str(refusal.status_code)).inc()
                await refusal(scope, receive, send)
                return
        status: dict[str, int] = {}

        async def tracked_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        state.in_flight += 1
        try:
            await self.app(scope, receive, tracked_send)
        finally:
            state.in_flight -= 1
            if guarded and status.get("code", 500) >= 400 and status.get("code") != CLIENT_CLOSED_REQUEST:
                state.metrics.labels(state.metrics.request_errors, status=str(status.get("code", 500))).inc()


def _authorized(header: str, key: str) -> bool:
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


# After the shutdown timeout, how long the answers of the requests cut off may take to be written.
_FLUSH_SECONDS = 5.0


async def drain(app: FastAPI, timeout: float) -> None:
    """Stop accepting work (503) and wait for the requests in flight, at most `timeout` seconds;
    then end what is left with a 503 (whole responses) or an error event and [DONE] (streams), and
    wait, briefly, for those answers to be sent."""
    state: AppState = app.state.cai
    state.draining = True
    log.info("shutting down: finishing %d request(s) in flight, at most %g s",
             state.loop.num_pending if state.loop is not None else 0, timeout)
    if await _settled(state, time.monotonic() + timeout):
        return
    if state.loop is not None:
        log.warning("shutdown timeout: ending %d request(s) still in flight with 503", state.loop.num_pending)
        state.loop.shut_out(f"The server is shutting down: the request did not finish within the shutdown "
                            f"timeout ({timeout:g} s)")
    await _settled(state, time.monotonic() + _FLUSH_SECONDS)


async def _settled(state: AppState, deadline: float) -> bool:
    """Wait until no request is in flight or the deadline passes; whether none is."""
    while time.monotonic() < deadline:
        pending = state.loop.num_pending if state.loop is not None else 0
        if pending == 0 and state.in_flight == 0:
            return True
        await asyncio.sleep(0.05)
    return False
