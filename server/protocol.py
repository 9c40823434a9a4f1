"""OpenAI request and response bodies (pydantic), plus the fields we reject by name.

Unknown fields and OpenAI fields this server does not implement are rejected with a 400 naming the
field, never silently ignored; a field sent with its OpenAI default value (e.g. `echo: false`) is
accepted, since it asks for nothing we do not do.
"""

from __future__ import annotations

import os
import random
import time
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from engine.decoding.types import RequestStats

# OpenAI fields we do not implement, with the value that means "not used".
UNSUPPORTED_COMPLETION = {"logprobs": None, "echo": False, "best_of": 1, "logit_bias": None, "suffix": None,
                          "presence_penalty": 0, "frequency_penalty": 0}
UNSUPPORTED_CHAT = {"logprobs": False, "top_logprobs": None, "logit_bias": None, "presence_penalty": 0,
                    "frequency_penalty": 0, "tools": None, "tool_choice": None, "functions": None,
                    "function_call": None, "response_format": None, "parallel_tool_calls": None,
                    "audio": None, "modalities": None, "prediction": None, "reasoning_effort": None,
                    "service_tier": None, "store": None, "metadata": None, "web_search_options": None}


# strict: a JSON value of the wrong type is refused, never coerced ("1" is not 1, 0.0 is not false)
class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    def rejected_field(self, unsupported: dict[str, Any]) -> Optional[tuple[str, str]]:
        """(field, message) for the first field we must refuse, or None."""
        for name, value in (self.model_extra or {}).items():
            if name in unsupported:
                default = unsupported[name]
                if value is None or value == default or (default is None and value in ({}, [])):
                    continue
                return name, f"'{name}' is not supported by this server"
            return name, f"unknown parameter '{name}'"
        return None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class _Sampling(_Body):
    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    seed: Optional[int] = Field(None, ge=0, le=2**63 - 1)
    stop: Optional[Union[str, list[str]]] = None
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    decoding: Optional[dict[str, Any]] = None

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


# What the schema can say about a prompt; the vocabulary bound and the context length are checked at
# run time (400, `context_length_exceeded` for the latter), as OpenAI does.
_Text = Annotated[str, Field(min_length=1)]
_Ids = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(_Sampling):
    prompt: Union[_Text, Annotated[list[_Text], Field(min_length=1)], _Ids, Annotated[list[_Ids], Field(min_length=1)]]


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "user", "assistant", "developer"]
    content: Union[str, list[ContentPart]]
    name: Optional[str] = None

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class DecodingSummary(BaseModel):
    """Per choice: what the diffusion decoder did."""

    nfe: int
    steps: int
    steps_saved: int
    fixed_step_budget: int
    forced_commits: int
    grinding_exits: int
    energy_joules: Optional[float] = None  # only where an energy meter is read

    @model_serializer(mode="wrap")
    def _drop_unmeasured(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        if self.energy_joules is None:  # no meter: no value, rather than an invented 0
            data.pop("energy_joules", None)
        return data

    @classmethod
    def of(cls, stats: RequestStats, joules: Optional[float]) -> DecodingSummary:
        return cls(nfe=stats.nfe, steps=stats.steps, steps_saved=stats.steps_saved,
                   fixed_step_budget=stats.fixed_step_budget, forced_commits=stats.forced_commits,
                   grinding_exits=stats.grinding_exits, energy_joules=joules)


# ------------------------------------------------------------------------------ response bodies


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: Optional[str]
    logprobs: None = None
    decoding: Optional[DecodingSummary] = None


class _ResponseHead(BaseModel):
    id: str
    created: int
    model: str


class CompletionResponse(_ResponseHead):
    """A whole completion, and each chunk of a streamed one (OpenAI uses the same object for both)."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: Optional[str]
    logprobs: None = None
    decoding: Optional[DecodingSummary] = None


class ChatCompletionResponse(_ResponseHead):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None

    @model_serializer(mode="wrap")
    def _only_what_is_set(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(BaseModel):
    index: int
    delta: ChatDelta
    finish_reason: Optional[str] = None
    logprobs: None = None
    decoding: Optional[DecodingSummary] = None


class ChatCompletionChunk(_ResponseHead):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatStreamChoice]
    usage: Optional[Usage] = None


# Ids come from a generator of our own, not uuid4: os.urandom releases the GIL, and with the engine
# thread running a cProfile of the event loop showed each call taking ~0.9 ms to get it back (two
# calls a request). End to end the saving is inside this 2-core machine's noise (docs/server.md). Seeded
# from os.urandom once, and again in a forked child, so two processes never hand out the same ids.
_ID_SOURCE = random.Random()
os.register_at_fork(after_in_child=_ID_SOURCE.seed)


def new_id(prefix: str) -> str:
    return f"{prefix}-{_ID_SOURCE.getrandbits(128):032x}"


def now() -> int:
    return int(time.time())


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "cai-dllm"
    root: str
    max_model_len: int
    architecture: str
    energy_meter: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
