"""Per-request decoding parameters: one frozen dataclass, validated on construction.

Field names are the paper's and the API's (`decoding` object, `cai-dllm generate` flags). `None`
means "the model's default" and is filled by `with_model_defaults` from the model's family
(engine/models/registry.py: gating on for LLaDA, off for Dream; Dream's own policies decode the
canvas as one block, as `diffusion_generate` does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any, Optional

POLICIES = ("fixed", "threshold", "cai", "dream-maskgit_plus", "dream-entropy", "dream-topk_margin", "block-static",
            "block-dynamic", "block-sequential", "block-edit")
# The block-diffusion decoders (SDAR's low_confidence_static / low_confidence_dynamic / sequential,
# LLaDA2.0's threshold decoder = block-dynamic): their per-step quota comes from the block length.
BLOCK_SCHEDULE_POLICIES = ("block-static", "block-dynamic", "block-sequential")
# LLaDA2.1's decoder: threshold commits (M2T) and token edits (T2T), block-diffusion models only
EDIT_POLICIES = ("block-edit",)
# "exact": a block-diffusion model's exact block cache (its default); "none" re-runs the whole window
CACHE_MODES = ("none", "prefix", "dual", "exact")
# block-diffusion attention: the block-causal mask, or LLaDA2.1's official additive 0/1 mask (no cache)
BLOCK_ATTENTION_MODES = ("block_causal", "additive_01")
BLOCK_SCHEDULE_MODES = ("clamp", "stretch")
ETA_DENOMINATORS = ("generation", "block")
GRINDING_EXITS = ("continue", "fill")
DEFAULT_BLOCK_LENGTH = 32  # LLaDA's and Fast-dLLM's block; Dream's own policies take the canvas as one block


class DecodeParamError(ValueError):
    """A decode parameter has a bad value; `param` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True)
class DecodeParams:
    policy: str = "cai"
    gen_length: int = 128
    block_length: Optional[int] = None  # None: DEFAULT_BLOCK_LENGTH, or gen_length for dream-* policies
    steps: Optional[int] = None  # total denoising steps over the canvas; None: gen_length
    temperature: float = 0.0
    seed: Optional[int] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None  # -1 and 0 mean "off", as in vLLM
    min_p: Optional[float] = None  # drop tokens below min_p x the best token's probability (vLLM)
    # decode the whole canvas (no early exit) and keep what follows an end token (vLLM's ignore_eos)
    ignore_eos: bool = False
    # report each generated token's log-probability and this many top alternatives (None: off)
    logprobs: Optional[int] = None
    # samples per split of the Monte-Carlo likelihood estimate when a prompt is scored (engine.scoring)
    score_samples: int = 16
    cfg_scale: float = 0.0
    early_exit: bool = True
    # KV cache (runner axis); None: the model's default ("none", or "exact" for block-diffusion models)
    cache: Optional[str] = None
    refresh_interval: int = 0  # full recompute every f steps inside a block; 0 = block starts only
    # block-diffusion models: a finished block's keys/values are written by one extra forward of the
    # clean block (SDAR's official decoders, counted in NFE); off, they ride along with the next
    # block's first forward (the same logits, one forward fewer per block)
    store_pass: bool = False
    # block-diffusion models: the attention mask of the denoising forward ("additive_01" needs cache "none")
    block_attention: str = "block_causal"
    # block-diffusion models: the official decoders' eos_early_stop (LLaDA2.0: a step that commits an
    # end token with no mask before it ends the row inside its block; block-edit: docs/decoding.md)
    eos_early_stop: bool = False
    # block-edit (LLaDA2.1): an unmasked generated token of the block is replaced by the prediction when
    # it differs and its confidence is above editing_threshold; after the block's last mask is filled,
    # at most max_post_steps forwards more; each step commits all masks above `threshold`, or the
    # num_to_transfer best; a block takes at most max_steps_per_block forwards (the last fills it)
    editing_threshold: float = 0.9
    max_post_steps: int = 16
    num_to_transfer: int = 1
    max_steps_per_block: int = 1000
    # threshold policy (Fast-dLLM) and block-dynamic (SDAR, LLaDA2.0)
    threshold: float = 0.9
    # dream-* policies
    eps: float = 1e-3
    # Fast-dLLM's Dream block decoder: a block's first forward commits exactly its first token
    commit_first_at_block_start: bool = False
    # CAI (paper Boxes 3-6); see docs/cai.md for every decision where the paper is silent
    theta_s: float = 0.90
    theta_e: float = 0.70
    warmup: float = 0.15
    block_schedule: bool = True
    block_decay: float = 0.10
    block_schedule_mode: str = "clamp"
    position_factors: bool = True
    budgets: bool = True
    gating: Optional[bool] = None  # None: the model's default (on for LLaDA, off for Dream)
    grinding: bool = True
    eta: float = 0.015
    eta_denominator: str = "generation"
    patience: int = 4
    theta_fb: float = 0.40
    grinding_exit: str = "continue"
    min_commit: int = 1

    def __post_init__(self) -> None:
        for name, choices in FIELD_CHOICES.items():
            if not (name == "cache" and self.cache is None):
                _check_choice(name, getattr(self, name), choices)
        for name in ("early_exit", "ignore_eos", "block_schedule", "position_factors", "budgets", "grinding",
                     "commit_first_at_block_start", "store_pass", "eos_early_stop"):
            _check_bool(name, getattr(self, name))
        if self.gating is not None:
            _check_bool("gating", self.gating)
        _check_int("gen_length", self.gen_length, low=1)
        if self.block_length is not None:
            _check_int("block_length", self.block_length, low=1)
            if self.gen_length % self.block_length:
                raise DecodeParamError("block_length", f"must divide gen_length ({self.gen_length}), "
                                       f"got {self.block_length}")
        if self.steps is not None:
            # a step commits at least one token: more steps than tokens would never run
            _check_int("steps", self.steps, low=1, high=self.gen_length)
            if self.steps % self.num_blocks:
                raise DecodeParamError("steps", f"must be a multiple of the number of blocks "
                                       f"({self.num_blocks}), got {self.steps}")
        _check_float("temperature", self.temperature, low=0.0)
        if self.seed is not None:
            _check_int("seed", self.seed, low=0)
        if self.top_p is not None:
            _check_float("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        if self.top_k is not None:
            _check_int("top_k", self.top_k, low=-1)
        if self.min_p is not None:
            _check_float("min_p", self.min_p, low=0.0, high=1.0)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0)
        _check_int("score_samples", self.score_samples, low=1)
        _check_float("cfg_scale", self.cfg_scale, low=0.0)
        if self.cfg_scale > 0 and self.cache not in (None, "none"):
            raise DecodeParamError("cfg_scale", "classifier-free guidance needs cache='none'")
        if self.block_attention == "additive_01" and self.cache not in (None, "none"):
            raise DecodeParamError("block_attention", "the additive 0/1 mask lets finished blocks attend to the "
                                   "current block, so they cannot be cached: it needs cache='none', "
                                   f"got {self.cache!r}")
        if self.eos_early_stop and not self.stops_at_end:
            raise DecodeParamError("eos_early_stop", "stops at an end token: it needs early_exit=true and "
                                   "ignore_eos=false")
        _check_float("editing_threshold", self.editing_threshold, low=0.0, high=1.0)
        _check_int("max_post_steps", self.max_post_steps, low=0)
        _check_int("num_to_transfer", self.num_to_transfer, low=1)
        _check_int("max_steps_per_block", self.max_steps_per_block, low=1)
        _check_int("refresh_interval", self.refresh_interval, low=0)
        _check_float("threshold", self.threshold, low=0.0, high=1.0)
        _check_float("eps", self.eps, low=0.0, high=1.0, low_open=True)
        for name in ("theta_s", "theta_e", "theta_fb", "eta", "block_decay"):
            _check_float(name, getattr(self, name), low=0.0, high=1.0)
        _check_float("warmup", self.warmup, low=0.0, high=1.0, high_open=True)
        _check_int("patience", self.patience, low=1)
        _check_int("min_commit", self.min_commit, low=0, high=1)

    @property
    def effective_block_length(self) -> int:
        if self.block_length is not None:
            return self.block_length
        return self.gen_length if self.policy.startswith("dream-") else min(DEFAULT_BLOCK_LENGTH, self.gen_length)

    @property
    def num_blocks(self) -> int:
        return self.gen_length // self.effective_block_length

    @property
    def total_steps(self) -> int:
        return self.steps if self.steps is not None else self.gen_length

    @property
    def max_steps(self) -> int:
        """The most denoising steps a row can take: `steps`, since every policy but `threshold` commits
        what is left at a block's last step; `threshold` commits at least one token a step, so one
        step per canvas token; `block-edit` (whose edits may mask tokens again) `max_steps_per_block`
        a block (a prompt ending inside a block adds one block)."""
        if self.policy in EDIT_POLICIES:
            return (self.num_blocks + 1) * self.max_steps_per_block
        return self.gen_length if self.policy == "threshold" else self.total_steps

    @property
    def steps_per_block(self) -> int:
        return self.total_steps // self.num_blocks

    @property
    def top_k_on(self) -> int:
        """top_k as a filter width; 0 when off (None, 0 or -1)."""
        return self.top_k if self.top_k is not None and self.top_k > 0 else 0

    @property
    def stops_at_end(self) -> bool:
        """Whether a row stops at its first end token (early exit on, ignore_eos off)."""
        return self.early_exit and not self.ignore_eos

    @property
    def gating_on(self) -> bool:
        return bool(self.gating)

    def with_overrides(self, **overrides: Any) -> DecodeParams:
        return replace(self, **overrides)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> DecodeParams:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise DecodeParamError(unknown[0], "unknown decoding parameter")
        return cls(**values)


def field_types() -> dict[str, tuple[type, bool]]:
    """name -> (scalar type, may be None) for every decode parameter, for CLIs and schemas."""
    scalar = {"int": int, "float": float, "str": str, "bool": bool}
    out: dict[str, tuple[type, bool]] = {}
    for f in fields(DecodeParams):
        text = str(f.type)
        optional = text.startswith("Optional[")
        out[f.name] = (scalar[text.removeprefix("Optional[").removesuffix("]")], optional)
    return out


# The knobs that take one of a few words, and those words (the schema's enums).
FIELD_CHOICES: dict[str, tuple[str, ...]] = {"policy": POLICIES, "cache": CACHE_MODES,
                                             "block_attention": BLOCK_ATTENTION_MODES,
                                             "block_schedule_mode": BLOCK_SCHEDULE_MODES,
                                             "eta_denominator": ETA_DENOMINATORS, "grinding_exit": GRINDING_EXITS}


def json_schema(leave_out: tuple[str, ...] = ()) -> dict[str, Any]:
    """A JSON schema of the `decoding` object: every knob but `leave_out` with its type (and its
    words, where it takes words). Ranges and the rules between knobs are DecodeParams' checks
    (docs/decoding.md)."""
    names = {int: "integer", float: "number", str: "string", bool: "boolean"}
    properties: dict[str, Any] = {}
    for name, (kind, optional) in field_types().items():
        if name in leave_out:
            continue
        schema: dict[str, Any] = {"type": names[kind]}
        if name in FIELD_CHOICES:
            schema["enum"] = list(FIELD_CHOICES[name])
        properties[name] = {"anyOf": [schema, {"type": "null"}]} if optional else schema
    return {"type": "object", "properties": properties, "additionalProperties": False,
            "description": "Per-request decoding knobs (DecodeParams; docs/decoding.md)."}


def with_model_defaults(params: DecodeParams, cache: str, gating: bool) -> DecodeParams:
    """The fields left to the model filled with its family's defaults (engine/models/registry.py): its
    cache (a cache needs the block-causal mask and no guidance: otherwise "none"), CAI's gating."""
    updates: dict[str, Any] = {}
    if params.cache is None:  # (guidance cannot be cached: left to the model's mode to accept or refuse)
        cached = params.block_attention == "block_causal" and params.cfg_scale == 0
        updates["cache"] = cache if cached else "none"
    if params.gating is None:
        updates["gating"] = gating
    if params.block_length is None:
        updates["block_length"] = params.effective_block_length
    if params.steps is None:
        updates["steps"] = params.total_steps
    return replace(params, **updates) if updates else params


def _block_of(knobs: dict[str, Any]) -> Optional[int]:
    """The block length knobs (a request's `decoding` object, not yet validated) decode with; None for a
    single block of the whole canvas (Dream's own policies) or a block_length that is not a length."""
    block = knobs.get("block_length")
    if block is None:
        return None if str(knobs.get("policy", "")).startswith("dream-") else DEFAULT_BLOCK_LENGTH
    return block if isinstance(block, int) and not isinstance(block, bool) and block > 0 else None


def canvas_for_max_tokens(max_tokens: int, knobs: dict[str, Any]) -> int:
    """The generation canvas for `max_tokens`: rounded up to whole blocks (a canvas shorter than one
    default block is one block of exactly max_tokens)."""
    block = _block_of(knobs)
    if block is None or (knobs.get("block_length") is None and max_tokens <= block):
        return max_tokens
    return math.ceil(max_tokens / block) * block


def canvas_within(knobs: dict[str, Any], room: int) -> Any:
    """The canvas when no max_tokens is given: the knobs' gen_length (or the default), shrunk to whole
    blocks that fit `room` (the context the prompt leaves), as vLLM's default max_tokens is what the
    context leaves. A canvas that cannot fit is returned as is, to be refused with the reason."""
    wanted = knobs.get("gen_length", DecodeParams.gen_length)
    if not isinstance(wanted, int) or isinstance(wanted, bool) or wanted <= room or room < 1:
        return wanted
    block = _block_of(knobs)
    chosen = knobs.get("block_length") is not None
    if chosen and (block is None or room < block):
        return wanted
    if block is None or (not chosen and room <= block):
        return room
    return room // block * block


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise DecodeParamError(name, f"must be one of {', '.join(choices)}; got {value!r}")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise DecodeParamError(name, f"must be true or false, got {value!r}")


def _check_int(name: str, value: Any, low: Optional[int] = None, high: Optional[int] = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise DecodeParamError(name, f"must be an integer, got {value!r}")
    if low is not None and value < low:
        raise DecodeParamError(name, f"must be >= {low}, got {value}")
    if high is not None and value > high:
        raise DecodeParamError(name, f"must be <= {high}, got {value}")


def _check_float(name: str, value: Any, low: Optional[float] = None, high: Optional[float] = None,
                 low_open: bool = False, high_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise DecodeParamError(name, f"must be a finite number, got {value!r}")
    if low is not None and (value < low or (low_open and value == low)):
        raise DecodeParamError(name, f"must be {'>' if low_open else '>='} {low}, got {value}")
    if high is not None and (value > high or (high_open and value == high)):
        raise DecodeParamError(name, f"must be {'<' if high_open else '<='} {high}, got {value}")
