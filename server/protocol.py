"""OpenAI request and response bodies (pydantic).

Every field a request may carry is declared, so the JSON schema (`/openapi.json`) is exactly what the
server accepts: unknown fields are refused (`additionalProperties: false`), and the OpenAI and vLLM
fields this server does not implement are declared with the only values that ask for nothing we do
not do (`echo: false`, `presence_penalty: 0`, `tools: []`...): any other value is a 400 that names the
field and says why (`neutral`).
"""

from __future__ import annotations

import os
import random
import time
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, RootModel, WithJsonSchema, model_serializer
from pydantic_core import PydanticCustomError

from engine.decoding.params import json_schema as decoding_schema
from engine.decoding.types import RequestStats

_NO_PENALTIES = ("a diffusion decoder commits tokens in parallel and out of order, so there is no running "
                 "history of generated tokens for a penalty to count")
_NO_TOOLS = "tool and function calling are not implemented"
_ONLY_TEXT = 'structured output is not implemented; only {"type": "text"}'


def _integral(value: Any) -> Any:
    """JSON Schema counts 7.0 as an integer, and so do we (clients that write every number as a float)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def integer(**constraints: Any) -> Any:
    """An integer field that also takes integral floats; the schema stays `type: integer` with its
    bounds (the constraints must come before the validator for pydantic to write them)."""
    return Annotated[int, Field(**constraints), BeforeValidator(_integral)]


def neutral(allowed: list[Any], why: str) -> Any:
    """A type accepting only the values in `allowed` (compared as JSON compares them), documented as
    an enum; anything else is refused, saying `why`."""

    def check(value: Any) -> Any:
        if any(value == a and isinstance(value, bool) == isinstance(a, bool) for a in allowed):
            return value
        raise PydanticCustomError("unsupported_value", "{why}", {"why": why})

    return Annotated[Any, BeforeValidator(check), WithJsonSchema({"enum": allowed})]


# strict: a JSON value of the wrong type is refused, never coerced ("1" is not 1, 0.0 is not false)
class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def decoding_object_schema() -> dict[str, Any]:
    """The request's `decoding` object: every knob but the canvas (max_tokens sets it), and the name
    of a decoding profile the server loaded (the document lists them once the model is up)."""
    schema = decoding_schema(leave_out=("gen_length",))
    schema["properties"]["profile"] = {"type": "string", "description": "a decoding profile (GET /v1/models)"}
    return schema


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk


class _Sampling(_Body):
    model: Optional[str] = None
    max_tokens: Optional[integer(ge=0)] = None  # 0: nothing generated (with echo: only score the prompt)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[integer(ge=-1)] = None
    min_p: Optional[float] = Field(None, ge=0, le=1)
    ignore_eos: bool = False
    seed: Optional[integer(ge=0, le=2**63 - 1)] = None
    stop: Optional[Union[str, list[str]]] = None
    n: integer(ge=1) = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    decoding: Annotated[Optional[dict[str, Any]],
                        WithJsonSchema({"anyOf": [decoding_object_schema(), {"type": "null"}]})] = None
    presence_penalty: neutral([0, None], _NO_PENALTIES) = None  # type: ignore[valid-type]
    frequency_penalty: neutral([0, None], _NO_PENALTIES) = None  # type: ignore[valid-type]
    repetition_penalty: neutral([1, None], _NO_PENALTIES) = None  # type: ignore[valid-type]
    logit_bias: neutral([None, {}], "logit_bias is not implemented") = None  # type: ignore[valid-type]

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or ())


# What the schema can say about a prompt; the vocabulary bound and the context length are checked at
# run time (400, `context_length_exceeded` for the latter), as OpenAI does.
_Text = Annotated[str, Field(min_length=1)]
_Ids = Annotated[list[integer(ge=0)], Field(min_length=1)]


class CompletionRequest(_Sampling):
    prompt: Union[_Text, Annotated[list[_Text], Field(min_length=1)], _Ids, Annotated[list[_Ids], Field(min_length=1)]]
    logprobs: Optional[integer(ge=0)] = None  # top alternatives per token (OpenAI: up to 5; here --max-logprobs)
    echo: Optional[bool] = None  # the prompt comes back before the completion; with logprobs, scored
    best_of: neutral([1, None], "best_of is not implemented; use n") = None  # type: ignore[valid-type]
    suffix: neutral([None, ""], "insertion (suffix) is not implemented") = None  # type: ignore[valid-type]


class ContentPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "developer"]
    content: Union[str, list[ContentPart], None]  # None: an empty message (OpenAI allows it for assistants)
    name: Optional[str] = None

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content or ())


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[integer(ge=1)] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[integer(ge=0)] = None
    tools: neutral([None, []], _NO_TOOLS) = None  # type: ignore[valid-type]
    tool_choice: neutral([None, "none"], _NO_TOOLS) = None  # type: ignore[valid-type]
    functions: neutral([None, []], _NO_TOOLS) = None  # type: ignore[valid-type]
    function_call: neutral([None, "none"], _NO_TOOLS) = None  # type: ignore[valid-type]
    parallel_tool_calls: neutral([None, False, True], _NO_TOOLS) = None  # type: ignore[valid-type]
    response_format: neutral([None, {"type": "text"}], _ONLY_TEXT) = None  # type: ignore[valid-type]
    audio: neutral([None], "audio output is not implemented") = None  # type: ignore[valid-type]
    modalities: neutral([None, ["text"]], "only text output") = None  # type: ignore[valid-type]
    prediction: neutral([None], "predicted outputs are not implemented") = None  # type: ignore[valid-type]
    reasoning_effort: neutral([None], "this model has no reasoning effort setting") = None  # type: ignore[valid-type]
    web_search_options: neutral([None], "web search is not implemented") = None  # type: ignore[valid-type]
    # accepted and unused: they ask for nothing that changes the answer
    service_tier: Optional[str] = None
    store: Optional[bool] = None
    metadata: Optional[dict[str, str]] = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (docs/server.md)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()


class DecodingSummary(BaseModel):
    """Per choice: what the diffusion decoder did."""

    nfe: int
    steps: int
    blocks: int  # blocks decoded (a uniform-noise model: canvases); steps / blocks = steps per block
    steps_saved: int
    fixed_step_budget: int
    forced_commits: int
    grinding_exits: int
    token_edits: int = 0  # block-edit (LLaDA2.1's decoder): tokens replaced after they were committed
    energy_joules: Optional[float] = None  # only where an energy meter is read

    @model_serializer(mode="wrap")
    def _drop_unmeasured(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        if self.energy_joules is None:  # no meter: no value, rather than an invented 0
            data.pop("energy_joules", None)
        return data

    @classmethod
    def of(cls, stats: RequestStats, joules: Optional[float]) -> DecodingSummary:
        measured = {name: getattr(stats, name) for name in cls.model_fields if name != "energy_joules"}
        return cls(**measured, energy_joules=joules)


# ------------------------------------------------------------------------------ response bodies


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completions logprobs: per token its text, log p, the top alternatives (the
    chosen token included, as vLLM does) and where its text starts in the response."""

    tokens: list[str]
    token_logprobs: list[Optional[float]]  # None for an echoed prompt's first token, as in OpenAI
    top_logprobs: list[Optional[dict[str, float]]]
    text_offset: list[int]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobEntry]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: Optional[str]
    logprobs: Optional[CompletionLogprobs] = None
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
    logprobs: Optional[ChatLogprobs] = None
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
    logprobs: Optional[ChatLogprobs] = None
    decoding: Optional[DecodingSummary] = None


class ChatCompletionChunk(_ResponseHead):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatStreamChoice]
    usage: Optional[Usage] = None


# Ids come from a generator of our own, not uuid4, whose os.urandom releases the GIL to the busy engine
# thread; reseeded in a forked child, so two processes never hand out the same ids.
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
    decoding_profiles: list[str] = []  # names a request can give as decoding.profile
    default_decoding_profile: Optional[str] = None  # applied when a request names none
    dtype: str  # of activations, embeddings, norms and (unless quantized_head) the head
    quantization: str  # of the transformer layers' linear weights: none, int8, int4 or fp8
    quantized_head: bool = False


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ------------------------------------------------------------------------------ /tokenize, /detokenize (vLLM's)


class TokenizeCompletionRequest(_Body):
    model: Optional[str] = None
    prompt: str
    add_special_tokens: bool = True  # accepted for vLLM's sake: these checkpoints add none to plain text
    return_token_strs: bool = False


class TokenizeChatRequest(_Body):
    model: Optional[str] = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool = False


class TokenizeRequest(RootModel[Union[TokenizeCompletionRequest, TokenizeChatRequest]]):
    """A prompt (as /v1/completions takes it) or chat messages (rendered with the chat template)."""


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class TokenizerInfo(BaseModel):
    tokenizer_class: str
    eos_token: Optional[str] = None
    bos_token: Optional[str] = None
    pad_token: Optional[str] = None
    chat_template: Optional[str] = None
    model_max_length: int


class DetokenizeRequest(_Body):
    model: Optional[str] = None
    tokens: list[integer(ge=0)]  # type: ignore[valid-type]


class DetokenizeResponse(BaseModel):
    prompt: str
