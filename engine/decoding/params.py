"""Per-request decoding parameters: one frozen dataclass whose fields are the knobs, each declared
once (`knob`: type, default, check, the policies that read it, the modes that have it; see
`engine/decoding/knobs.py` for what is generated from the declarations).

Field names are the paper's and the API's (`decoding` object, `cai-dllm generate` flags). `None`
means "the model's default", filled by `with_model_defaults` from the model's family
(`engine/models/registry.py`): the block, the cache, CAI's gating. The policy names and what a
policy implies for the defaults (Dream's own policies decode the canvas as one block, as
`diffusion_generate` does) are the policy registry's (`engine/decoding/registry.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any, Optional

from engine.decoding import knobs as K
from engine.decoding.knobs import ANY_POLICY, Bool, DecodeParamError, Float, Int, Words, knob

CACHE_MODES = ("none", "prefix", "dual", "exact")  # "exact": a block-diffusion model's exact block cache
# block-diffusion attention: the block-causal mask, or LLaDA2.1's official additive 0/1 mask (no cache)
BLOCK_ATTENTION_MODES = ("block_causal", "additive_01")
BLOCK_SCHEDULE_MODES = ("clamp", "stretch")
ETA_DENOMINATORS = ("generation", "block")
GRINDING_EXITS = ("continue", "fill")
# The block of a request that names none and whose model states none: LLaDA's and Fast-dLLM's (a
# canvas shorter than it is one block; one-block policies take the whole canvas)
DEFAULT_BLOCK_LENGTH = 32
DEFAULT_POLICY = "cai"  # a request's policy where neither it nor its model's family names one
_UNIT = Float(0.0, 1.0)
_CAI = ("cai",)
_MASKED, _BLOCK, _UNIFORM = ("masked",), ("block",), ("uniform",)
# the uniform-noise policies (DiffusionGemma): the official entropy-bound rule and the convergence-aware one
_DG = ("dg-official", "dg-converge")


def _policy_names() -> tuple[str, ...]:
    return _registry().POLICY_NAMES


def _registry() -> Any:
    """The policy registry, imported on first use: it holds the policies' tensor code, and this
    module is read without torch (`cai-dllm --help`)."""
    from engine.decoding import registry

    return registry


@dataclass(frozen=True)
class DecodeParams:
    # None: the model's family's default (CAI; DiffusionGemma's official rule: engine/models/registry.py)
    policy: Optional[str] = knob(None, Words(_policy_names), reads=ANY_POLICY)
    gen_length: int = knob(128, Int(low=1), reads=_CAI)  # CAI: Box 7's L (eta_denominator "generation")
    # None: the model's block (the family table), else DEFAULT_BLOCK_LENGTH, or the canvas for one-block policies
    block_length: Optional[int] = knob(None, Int(low=1))
    steps: Optional[int] = knob(None, Int(low=1))  # total denoising steps over the canvas; None: one per position
    temperature: float = knob(0.0, Float(low=0.0), reads=_DG)  # DiffusionGemma: a scale on its schedule
    seed: Optional[int] = knob(None, Int(low=0))
    top_p: Optional[float] = knob(None, Float(0.0, 1.0, low_open=True), reads=ANY_POLICY, none=1.0)
    top_k: Optional[int] = knob(None, Int(low=-1), reads=ANY_POLICY, none=0)  # -1 and 0 mean "off", as in vLLM
    # drop tokens below min_p x the best token's probability (vLLM)
    min_p: Optional[float] = knob(None, _UNIT, reads=ANY_POLICY, none=0.0)
    # decode the whole canvas (no early exit) and keep what follows an end token (vLLM's ignore_eos)
    ignore_eos: bool = knob(False, Bool())
    # report each generated token's log-probability and this many top alternatives (None: off)
    logprobs: Optional[int] = knob(None, Int(low=0))
    # samples per split of the Monte-Carlo likelihood estimate when a prompt is scored (engine.scoring)
    score_samples: int = knob(16, Int(low=1))
    cfg_scale: float = knob(0.0, Float(low=0.0), modes=_MASKED)
    early_exit: bool = knob(True, Bool())
    # KV cache (runner axis); None: the model's default ("none", or "exact" for block-diffusion models)
    cache: Optional[str] = knob(None, Words(CACHE_MODES))
    refresh_interval: int = knob(0, Int(low=0), modes=_MASKED)  # full recompute every f steps inside a block
    # block-diffusion models: a finished block's keys/values are written by one extra forward of the
    # clean block (SDAR's official decoders, counted in NFE); off, they ride along with the next
    # block's first forward (the same logits, one forward fewer per block)
    store_pass: bool = knob(False, Bool(), modes=_BLOCK)
    # block-diffusion models: the attention mask of the denoising forward ("additive_01" needs cache "none")
    block_attention: str = knob("block_causal", Words(BLOCK_ATTENTION_MODES), modes=_BLOCK)
    # block-diffusion models: the official decoders' eos_early_stop (LLaDA2.0: a step that commits an
    # end token with no mask before it ends the row inside its block; block-edit: docs/decoding.md)
    eos_early_stop: bool = knob(False, Bool(), modes=_BLOCK)
    # block-edit (LLaDA2.1): an unmasked generated token of the block is replaced by the prediction when
    # it differs and its confidence is above editing_threshold; after the block's last mask is filled,
    # at most max_post_steps forwards more; each step commits all masks above `threshold`, or the
    # num_to_transfer best; a block takes at most max_steps_per_block forwards (the last fills it)
    editing_threshold: float = knob(0.9, _UNIT, reads=("block-edit",))
    max_post_steps: int = knob(16, Int(low=0))
    num_to_transfer: int = knob(1, Int(low=1))
    max_steps_per_block: int = knob(1000, Int(low=1), reads=("block-edit",))
    # threshold policy (Fast-dLLM), block-dynamic (SDAR, LLaDA2.0) and block-edit's commits
    threshold: float = knob(0.9, _UNIT, reads=("threshold", "block-dynamic", "block-edit"))
    eps: float = knob(1e-3, Float(0.0, 1.0, low_open=True))  # dream-* policies' schedule
    # Fast-dLLM's Dream block decoder: a block's first forward commits exactly its first token
    commit_first_at_block_start: bool = knob(False, Bool(), modes=_MASKED)
    # CAI (paper Boxes 3-6); see docs/cai.md for every decision where the paper is silent
    theta_s: float = knob(0.90, _UNIT, reads=_CAI)
    theta_e: float = knob(0.70, _UNIT, reads=_CAI)
    warmup: float = knob(0.15, Float(0.0, 1.0, high_open=True), reads=_CAI)
    block_schedule: bool = knob(True, Bool(), reads=_CAI)
    block_decay: float = knob(0.10, _UNIT, reads=_CAI)
    block_schedule_mode: str = knob("clamp", Words(BLOCK_SCHEDULE_MODES), reads=_CAI)
    position_factors: bool = knob(True, Bool(), reads=_CAI)
    budgets: bool = knob(True, Bool(), reads=_CAI)
    gating: Optional[bool] = knob(None, Bool(), reads=_CAI)  # None: the model's default (on for LLaDA, off for Dream)
    grinding: bool = knob(True, Bool(), reads=_CAI)
    eta: float = knob(0.015, _UNIT, reads=("cai", "dg-converge"))
    eta_denominator: str = knob("generation", Words(ETA_DENOMINATORS), reads=_CAI)
    patience: int = knob(4, Int(low=1), reads=("cai", "dg-converge"))
    theta_fb: float = knob(0.40, _UNIT, reads=_CAI)
    grinding_exit: str = knob("continue", Words(GRINDING_EXITS), reads=_CAI)
    min_commit: int = knob(1, Int(0, 1), reads=_CAI)
    # Uniform-noise diffusion (DiffusionGemma, engine/uniform_mode.py): None takes the checkpoint's
    # generation_config.json, else the official library defaults (engine.decoding.uniform.OFFICIAL).
    # A canvas takes at most max_denoising_steps steps at temperature t_max -> t_min; each step keeps the
    # lowest-entropy samples whose smaller entropies sum to at most entropy_bound; with adaptive_stop a
    # canvas ends once its argmax has been stable for stability_threshold steps and its mean entropy is
    # below confidence_threshold.
    max_denoising_steps: Optional[int] = knob(None, Int(low=1), reads=_DG, modes=_UNIFORM, none=0)
    entropy_bound: Optional[float] = knob(None, Float(low=0.0, low_open=True), reads=_DG, modes=_UNIFORM,
                                          none=0.0)
    t_min: Optional[float] = knob(None, Float(low=0.0, low_open=True), reads=_DG, modes=_UNIFORM, none=0.0)
    t_max: Optional[float] = knob(None, Float(low=0.0, low_open=True), reads=_DG, modes=_UNIFORM, none=0.0)
    stability_threshold: Optional[int] = knob(None, Int(low=0), reads=_DG, modes=_UNIFORM, none=0)
    confidence_threshold: Optional[float] = knob(None, Float(low=0.0, low_open=True), reads=_DG, modes=_UNIFORM,
                                                 none=0.0)
    adaptive_stop: bool = knob(True, Bool(), reads=_DG, modes=_UNIFORM)  # off: every canvas takes every step
    # dg-converge: a position whose sample has not changed for settle_steps steps is kept (0: off); the
    # confidence threshold relaxes by canvas_relax per canvas, over the paper's 4 block tiers (Box 4);
    # the canvas ends when its accepted set has not grown by eta x canvas for `patience` steps (Box 7)
    settle_steps: int = knob(3, Int(low=0), reads=("dg-converge",), modes=_UNIFORM)
    canvas_relax: float = knob(0.5, Float(low=0.0), reads=("dg-converge",), modes=_UNIFORM)

    def __post_init__(self) -> None:
        K.check_fields(self)
        if self.steps is not None:
            # a step commits at least one token: more steps than canvas positions would never run
            if self.steps > self.num_blocks * self.effective_block_length:
                raise DecodeParamError("steps", f"must be <= {self.num_blocks * self.effective_block_length} (one "
                                       f"per canvas position), got {self.steps}")
            if self.steps % self.num_blocks:
                raise DecodeParamError("steps", f"must be a multiple of the number of blocks "
                                       f"({self.num_blocks}), got {self.steps}")
        if self.cfg_scale > 0 and self.cache not in (None, "none"):
            raise DecodeParamError("cfg_scale", "classifier-free guidance needs cache='none'")
        if self.block_attention == "additive_01" and self.cache not in (None, "none"):
            raise DecodeParamError("block_attention", "the additive 0/1 mask lets finished blocks attend to the "
                                   "current block, so they cannot be cached: it needs cache='none', "
                                   f"got {self.cache!r}")
        if self.eos_early_stop and not self.stops_at_end:
            raise DecodeParamError("eos_early_stop", "stops at an end token: it needs early_exit=true and "
                                   "ignore_eos=false")

    @property
    def effective_block_length(self) -> int:
        if self.block_length is not None:
            return self.block_length
        return self.gen_length if _one_block(self.policy) else min(DEFAULT_BLOCK_LENGTH, self.gen_length)

    @property
    def num_blocks(self) -> int:
        """Blocks of the canvas (a block-diffusion model may decode one more: its blocks count from
        the prompt's first token, engine/block_mode.py)."""
        return -(-self.gen_length // self.effective_block_length)

    @property
    def total_steps(self) -> int:
        return self.steps if self.steps is not None else self.num_blocks * self.effective_block_length

    @property
    def max_steps(self) -> int:
        """The most denoising steps a row can take, as its policy's `step_bound` states it (the
        registry); `steps` when no policy is set yet."""
        if self.policy is None:
            return self.total_steps
        return int(_registry().POLICIES[self.policy].step_bound.max_steps(self))

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

    def with_overrides(self, **overrides: Any) -> DecodeParams:
        return replace(self, **overrides)

    def with_model_defaults(self, block_length: Optional[int], cache: str, gating: bool,
                            policy: str = DEFAULT_POLICY) -> DecodeParams:
        """The fields left to the model filled with its defaults (its family's: engine/models/registry.py):
        its policy, its block (None: the canvas decides), its cache (a cache needs the block-causal mask
        and no guidance: otherwise "none"), CAI's gating; then the steps (one per canvas position)."""
        if self.policy is None:
            return replace(self, policy=policy).with_model_defaults(block_length, cache, gating, policy)
        updates: dict[str, Any] = {}
        block = self.block_length or block_length or self.effective_block_length
        if self.block_length is None:
            updates["block_length"] = block
        if self.steps is None:
            updates["steps"] = -(-self.gen_length // block) * block
        if self.cache is None:  # (guidance cannot be cached: left to the model's mode to accept or refuse)
            cached = self.block_attention == "block_causal" and self.cfg_scale == 0
            updates["cache"] = cache if cached else "none"
        if self.gating is None:
            updates["gating"] = gating
        return replace(self, **updates) if updates else self

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> DecodeParams:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise DecodeParamError(unknown[0], "unknown decoding parameter")
        return cls(**values)


def check_knob(name: str, value: Any) -> None:
    """DecodeParamError unless `value` is a valid value of knob `name` on its own (its type and range;
    the rules between knobs are DecodeParams' own checks)."""
    known = {f.name: f for f in fields(DecodeParams)}
    if name not in known:
        raise DecodeParamError(name, "unknown decoding parameter")
    if value is not None:
        known[name].metadata["check"](name, value)


def field_types() -> dict[str, tuple[type, bool]]:
    """name -> (scalar type, may be None) for every decode parameter, for CLIs and schemas."""
    return K.field_types(DecodeParams)


def json_schema(leave_out: tuple[str, ...] = ()) -> dict[str, Any]:
    """A JSON schema of the `decoding` object: every knob but `leave_out` with its type (and its
    words, where it takes words). Ranges and the rules between knobs are DecodeParams' checks
    (docs/decoding.md)."""
    names = {int: "integer", float: "number", str: "string", bool: "boolean"}
    words = K.field_words(DecodeParams)
    properties: dict[str, Any] = {}
    for name, (kind, optional) in field_types().items():
        if name in leave_out:
            continue
        schema: dict[str, Any] = {"type": names[kind]}
        if name in words:
            schema["enum"] = list(words[name])
        properties[name] = {"anyOf": [schema, {"type": "null"}]} if optional else schema
    return {"type": "object", "properties": properties, "additionalProperties": False,
            "description": "Per-request decoding knobs (DecodeParams; docs/decoding.md)."}


def _one_block(policy: Any) -> bool:
    """Whether the policy's default block is the whole canvas (Dream's own)."""
    entry = _registry().POLICIES.get(policy) if isinstance(policy, str) else None
    return entry is not None and entry.one_block


def _block_of(knobs: dict[str, Any]) -> Optional[int]:
    """The block length knobs (a request's `decoding` object, not yet validated) decode with; None for a
    single block of the whole canvas (Dream's own policies) or a block_length that is not a length."""
    block = knobs.get("block_length")
    if block is None:
        return None if _one_block(knobs.get("policy", DecodeParams.policy)) else DEFAULT_BLOCK_LENGTH
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
