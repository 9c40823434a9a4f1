"""A decoding mode: one object per decoding paradigm, chosen once from the model's family
(`engine/models/registry.py`, `Family.mode`; the table `MODES` in `engine/model_runner.py`).

A mode owns what differs between paradigms, so that nothing else branches on them:
- the canvas a request's `max_tokens` asks for (`canvas`) and where a row's canvas and blocks lie
  (`geometry`);
- what a request may ask of it (`check`: the knobs, caches and policies it has, its own rules);
- each row's plan for the step (`plan`: which forward, how many tokens fed, which rows share a
  forward, whether its decision is committed), made once a step and stored on the `Batch`;
- its forwards (`forwards`: the runner's one table, by plan kind) and its cache-advance rule
  (`cached_after`); its slot state's owner (`slots_class`);
- its whole decide step (`decide`): the mask-token one (`engine.decide`) unless it overrides it
  (uniform noise);
- when an end token inside a block ends a row (`ends_inside_block`);
- the progress measure: which positions are still undecided (`undecided`) and what a canvas starts
  as (`blank`). Masked and block diffusion both measure masks left; a mode without a mask token (one
  that re-samples every position until its canvas is stable) overrides these.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import fields
from typing import Any, ClassVar, Optional

import torch

from engine.batch import Batch, ForwardOutput, RowPlan, StepDecision
from engine.decide import decide_masks
from engine.decoding.knobs import mode_knobs
from engine.decoding.params import DecodeParams, canvas_for_max_tokens, canvas_within
from engine.decoding.registry import POLICIES, policy_state
from engine.decoding.row_state import RowState
from engine.errors import RequestError
from engine.models.protocol import DiffusionModel
from engine.request import Geometry, Request
from engine.slots import RowTables, Slots
from engine.static_forward import StaticForwards, static_experts

ForwardFn = Callable[[Batch, int], torch.Tensor]  # (the rows of one forward, the step's width) -> logits
_DEFAULTS = {f.name: f.default for f in fields(DecodeParams)}


class DecodingMode:
    name: ClassVar[str]  # the family table's `mode`
    caches: ClassVar[tuple[str, ...]]  # the `cache` knob's values it serves
    scores_likelihood: ClassVar[bool] = False  # engine.scoring's estimator applies
    # a prompt's whole blocks have keys/values that nothing after them changes (engine.prefix_cache)
    prefix_caching: ClassVar[bool] = False
    slots_class: ClassVar[type[Slots]] = Slots  # the owner of its slot state
    confidence_bands: ClassVar[bool] = True  # a block's first-step confidence bands mean something
    # every request draws random numbers, greedy ones too (uniform noise: its canvases start random),
    # so a tensor-parallel group gives an unseeded one a seed (engine.executor.tensor_parallel)
    draws_when_greedy: ClassVar[bool] = False

    def __init__(self, model: DiffusionModel, slots: Slots, static: Optional[str] = None) -> None:
        """`static`: how the mode's cached forwards run on static buffers, one of
        `engine.static_forward.HOW` ("graph": CUDA graphs; "compile": torch.compile); None: they do not."""
        self.model = model
        self.slots = slots
        static = static_experts(model, static)
        self.static_forwards: Optional[StaticForwards] = None if static is None else StaticForwards(
            self._static_run, static, slots.canvas.shape[0], model.device)
        self.mask_id = model.special.mask_id
        self.blank = self.mask_id  # what a canvas's generation positions start as

    @property
    def forwards(self) -> dict[str, ForwardFn]:
        raise NotImplementedError

    def _static_run(self, inputs: Mapping[str, torch.Tensor], key: Any) -> torch.Tensor:
        """The mode's cached forward on static buffers (engine.static_forward), for the shape `key`."""
        raise NotImplementedError

    def canvas(self, knobs: dict[str, Any], max_tokens: Optional[int], room: int) -> Any:
        """The canvas (`gen_length`) of a request given as knobs: `max_tokens` rounded up to whole
        blocks (the official decoders round the canvas so), or with none (or 0) the whole blocks the
        context leaves `room` for, as vLLM's default max_tokens is what the context leaves; a canvas
        that cannot fit is returned as asked, to be refused."""
        return canvas_for_max_tokens(max_tokens, knobs) if max_tokens else canvas_within(knobs, room)

    def geometry(self, prompt_len: int, params: DecodeParams) -> Geometry:
        raise NotImplementedError

    def plan(self, request: Request) -> RowPlan:
        raise NotImplementedError

    @classmethod
    def row_state(cls, model: DiffusionModel) -> dict[str, RowState]:
        """What the slots keep for each row between steps: its policies' declared state (and, in a
        mode that overrides this, the mode's own)."""
        return policy_state(cls.name)

    def with_defaults(self, params: DecodeParams) -> DecodeParams:
        """The mode's own knobs left unset, filled from the model (none by default)."""
        return params

    def decide(self, batch: Batch, rows: RowTables, out: ForwardOutput, end_ids: torch.Tensor) -> StepDecision:
        """The step's decisions for every row and its summary: the mask-token decide step (the policy
        registry's `decide` over the masks left) unless the mode overrides it."""
        return decide_masks(batch, rows, out, end_ids, self.mask_id, self.undecided)

    def cached_after(self, request: Request, plan: RowPlan) -> int:
        """The cache-advance rule: the positions [0, n) the row's cache holds after its forward (by
        default what it held: a mode without an exact cache holds none)."""
        return request.cached

    def ends_inside_block(self, request: Request, end_committed: int) -> bool:
        """Whether an end token with nothing undecided before it ends the row inside its block
        (`end_committed`: end tokens among the step's commits)."""
        raise NotImplementedError

    def undecided(self, tokens: torch.Tensor) -> torch.Tensor:
        """[B, W] bool: the positions still to decide (the progress measure: masks)."""
        return tokens == self.mask_id

    def check(self, params: DecodeParams) -> None:
        """RequestError for what this mode does not have: a knob set away from its default, a cache,
        a policy; then the mode's own rules (`check_rules`)."""
        for f in mode_knobs(DecodeParams):
            value = getattr(params, f.name)
            if self.name not in f.metadata["modes"] and value != _DEFAULTS[f.name]:
                self.refuse(f.name, f"{f.name}={value!r} applies to {' and '.join(f.metadata['modes'])} diffusion "
                                    f"models only")
        if params.cache not in self.caches:
            self.refuse("cache", f"cache={params.cache!r} is not one of this mode's caches "
                                 f"({', '.join(map(repr, self.caches))})")
        if self.name not in POLICIES[params.policy].modes:
            self.refuse("policy", f"policy={params.policy!r} is not available in {self.name} diffusion")
        self.check_rules(params)

    def check_rules(self, params: DecodeParams) -> None:
        """The mode's rules between knobs."""

    def refuse(self, param: str, reason: str) -> None:
        raise RequestError(f"{reason}; {self.model.display_name} decodes by {self.name} diffusion "
                           f"(docs/decoding.md)", param=param, code="invalid_decoding")
