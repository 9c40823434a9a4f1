"""From an OpenAI request to what the engine runs: the request's decoding knobs (model defaults <-
`--default-decoding` <- a decoding profile <- the request's `decoding` object <- its OpenAI and vLLM
fields), each prompt's request resolved once by the engine (`Engine.resolve`: the model's defaults,
the canvas its mode makes of `max_tokens`, the context), and an engine refusal named by the request
field it is about."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional, Union

from engine import RequestError
from engine.decoding import DecodeParamError, DecodeParams
from engine.decoding.params import check_knob, field_types
from engine.decoding.profiles import DecodingProfile, load_profile, profile_table
from engine.request import Resolved
from server.engine_loop import EngineLoop
from server.errors import APIError
from server.protocol import ChatCompletionRequest, CompletionRequest
from server.settings import ServerSettings

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
INVALID_DECODING = "invalid_decoding"  # a knob's range, or a rule between knobs (DecodeParams)
UNKNOWN_PROFILE = "unknown_profile"  # decoding.profile names no profile this server loaded
# Knobs an OpenAI/vLLM request field sets, over the decoding object's value
_OPENAI_KNOBS = ("temperature", "seed", "top_p", "top_k", "min_p", "ignore_eos", "logprobs")
_INT_KNOBS = frozenset(name for name, (kind, _) in field_types().items() if kind is int)
GenerateRequest = Union[CompletionRequest, ChatCompletionRequest]


def _integral_knobs(decoding: dict[str, Any]) -> dict[str, Any]:
    """Integer knobs written as integral floats (7.0) become integers, as JSON Schema counts them."""
    return {name: int(value) if name in _INT_KNOBS and isinstance(value, float) and value.is_integer() else value
            for name, value in decoding.items()}


def _max_tokens_field(body: GenerateRequest) -> str:
    return "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"


class RequestKnobs:
    """The knob and resolution half of a generating endpoint (`ServingBase`)."""

    prompt_field = "prompt"  # the request field that holds the prompt
    logprobs_field = "logprobs"  # the request field that asks for top logprobs
    loop: EngineLoop
    max_model_len: int

    def load_knobs(self, settings: ServerSettings) -> None:
        """The server's default knobs and decoding profiles, checked at start-up, not per request."""
        self._defaults = dict(settings.default_decoding)
        DecodeParams.from_dict(self._defaults)
        loaded = [load_profile(path) for path in settings.decoding_profiles]
        self.profiles = profile_table(loaded)
        self.default_profile: Optional[DecodingProfile] = loaded[0] if loaded else None

    def logprobs_asked(self, body: GenerateRequest) -> Optional[int]:
        """Top alternatives per token the request asks for (None: no logprobs)."""
        raise NotImplementedError

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

    def knobs(self, body: GenerateRequest) -> tuple[dict[str, Any], dict[str, Any]]:
        """The request's decoding knobs (the server's defaults, then the profile, then its `decoding`
        object and OpenAI fields), and its `decoding` object as given (the profile name taken out)."""
        if body.decoding and "gen_length" in body.decoding:  # one way to set the canvas, not two
            raise APIError(400, "decoding.gen_length: the generation canvas is set by max_tokens "
                           "(max_completion_tokens in chat)", param="decoding.gen_length", code=INVALID_DECODING)
        decoding = _integral_knobs(dict(body.decoding or {}))
        profile = self._profile_knobs(decoding)
        knobs: dict[str, Any] = {**self._defaults, **profile, **decoding}
        fields = {name: getattr(body, name) for name in ("temperature", "seed", "top_p", "top_k", "min_p")}
        fields.update(ignore_eos=body.ignore_eos or None, logprobs=self.logprobs_asked(body))
        for name, value in fields.items():
            if value is None:
                continue
            if name in decoding:  # the OpenAI field wins; the decoding object's value must still be valid
                try:
                    check_knob(name, decoding[name])
                except DecodeParamError as err:
                    raise APIError(400, str(err), param=f"decoding.{name}", code=INVALID_DECODING) from None
            knobs[name] = value
        return knobs, decoding

    def resolve(self, body: GenerateRequest, prompts: list[list[int]], max_tokens: Optional[int]) -> list[Resolved]:
        """Each prompt's request as the engine will run it (`Engine.resolve`: the model's defaults,
        the canvas its mode makes of max_tokens, the context), or a 400 naming the request field."""
        knobs, decoding = self.knobs(body)
        resolved = []
        for ids in prompts:
            try:
                resolved.append(self.loop.resolve(ids, knobs, max_tokens))
            except RequestError as err:
                raise APIError(400, str(err), param=self._field(err, body, decoding, len(ids), max_tokens),
                               code=err.code) from None
        return resolved

    def _field(self, err: RequestError, body: GenerateRequest, decoding: dict[str, Any], prompt_len: int,
               max_tokens: Optional[int]) -> str:
        """The request field an engine refusal is about: the prompt's (no knob named), the OpenAI field
        that set the knob, else the decoding object's; a context overflow's as `_context_param` says."""
        if err.code == CONTEXT_LENGTH_EXCEEDED:
            return self._context_param(body, prompt_len, max_tokens)
        param = err.param
        if param in (None, "prompt_ids"):
            return self.prompt_field
        if param == "gen_length":
            return _max_tokens_field(body)
        if param == "logprobs":
            return self.logprobs_field
        if param in _OPENAI_KNOBS and (param not in decoding or getattr(body, param, None) is not None):
            return param
        return param if param == "decoding" else f"decoding.{param}"

    def _context_param(self, body: GenerateRequest, prompt_len: int, max_tokens: Optional[int]) -> str:
        """The field a context overflow is about: the prompt when it fills the context alone, the
        block length when only rounding max_tokens up to whole blocks overflows, else max_tokens."""
        if prompt_len >= self.max_model_len:
            return self.prompt_field
        if max_tokens is not None and prompt_len + max_tokens <= self.max_model_len \
                and "block_length" in (body.decoding or {}):
            return "decoding.block_length"
        return _max_tokens_field(body)
