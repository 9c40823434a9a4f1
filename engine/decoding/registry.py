"""The policy registry: every decoding policy is one entry here, and nothing else in the engine or the
server tests a policy's name.

An entry says how the policy decides (a pure batched function over the step's rows: `PolicyInputs`
in, `Decision` out), which confidence it ranks by (Box 1's kinds, `sampling.py`), its host rules (the
tokens its rank rule commits this step, when its block ends), whether it edits committed tokens,
which decoding modes serve it, and its defaults. The knobs it reads are declared with `DecodeParams`'
fields (`params.py`, `reads=`), which put them in the slot tables; `PolicyInputs.knobs` holds them by
name. `decide` runs each policy present in a step once over the whole batch and keeps, per row, the
decision of the row's policy, so rows of different policies share a step.

A leaf module: it imports the pure policy functions and nothing of the engine's step.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Optional, Protocol

import torch

from engine.decoding import policies as P
from engine.decoding import uniform as U
from engine.decoding.row_state import BLOCK_WIDE, RowState, merged
from engine.decoding.sampling import CONF_MARGIN, CONF_NEG_ENTROPY, CONF_PROB

MASKED, BLOCK, UNIFORM = "masked", "block", "uniform"  # the decoding modes (engine/mode.py)
ALL_MODES = frozenset({MASKED, BLOCK, UNIFORM})
EVERY_MODE = frozenset({MASKED, BLOCK})  # the masked-token modes: a policy's default


class Row(Protocol):
    """What the host rules read and write of a row (`engine.request.Request`)."""

    params: Any  # its DecodeParams
    step: int
    block_length: int
    steps_per_block: int
    undecided: int  # positions of its block not decided yet (its mode's progress measure)
    undecided_at_block_start: int
    post_steps: int  # forwards of its block that ended with no mask left, this step's included
    schedule: Optional[list[float]]


class StepCounts(Protocol):
    """What a step did for a row (`engine.summary.RowSummary`)."""

    undecided: int
    edited: int


@dataclass(frozen=True)
class PolicyInputs:
    """Everything a decide function may read about the step's rows, as [B] / [B, W] tensors."""

    conf: torch.Tensor  # [B, W] Box 1 confidence (of the row's kind)
    candidates: torch.Tensor  # [B, W] undecided and inside the row's block
    x0: torch.Tensor  # [B, W] the predictions
    unmasked: torch.Tensor  # [B, W] the best greedy prediction other than the mask
    tokens: torch.Tensor  # [B, W] the block before the step
    editable: torch.Tensor  # [B, W] decided generated positions inside the row's block
    step: torch.Tensor
    block: torch.Tensor
    quota: torch.Tensor  # the host rule's count (Policy.quota)
    block_length: torch.Tensor
    steps_per_block: torch.Tensor
    num_blocks: torch.Tensor
    knobs: Mapping[str, torch.Tensor]  # [B] each declared device knob, by its DecodeParams name
    words: Mapping[str, tuple[str, ...]]  # a word knob's words: its column holds the word's index
    state: Mapping[str, torch.Tensor]  # each declared row state (Policy.state) as stored so far, by name
    first_only: Optional[torch.Tensor] = None  # [B] rows whose block's first forward commits its first token

    def word(self, knob: str, word: str) -> torch.Tensor:
        """[B] bool: the rows whose word knob `knob` is `word`."""
        return self.knobs[knob] == self.words[knob].index(word)


@dataclass
class Decision:
    commit: torch.Tensor  # [B, W]
    forced: Optional[torch.Tensor] = None  # [B, W] committed below their threshold
    state: Optional[dict[str, torch.Tensor]] = None  # the row state to store back, by name (Policy.state)
    grinding_exit: Optional[torch.Tensor] = None  # [B]
    edit: Optional[torch.Tensor] = None  # [B, W] decided positions that take the prediction
    tokens: Optional[torch.Tensor] = None  # [B, W] what committed and edited positions take (default: x0)


DecideFn = Callable[[PolicyInputs], Decision]
CanvasFn = Callable[[U.CanvasInputs], U.CanvasDecision]  # a uniform-noise policy (engine/decoding/uniform.py)

# -------------------------------------------------------------------------------- decide functions


def decide_rank(x: PolicyInputs) -> Decision:
    """`fixed` (LLaDA), `dream-*` and `block-static`: the quota best candidates."""
    return Decision(P.commit_best(x.conf, x.candidates, x.quota))


def decide_threshold(x: PolicyInputs) -> Decision:
    """Fast-dLLM: every candidate at or above the threshold, and always the best one."""
    return Decision(P.threshold_commit(x.conf, x.candidates, x.knobs["threshold"], torch.ones_like(x.step)))


def decide_block_dynamic(x: PolicyInputs) -> Decision:
    """SDAR's low_confidence_dynamic and LLaDA2.0's threshold decoder: every candidate strictly above
    the threshold when there are at least `quota` of them, else the quota best (guarded: only
    undecided positions are ever written, decoder B's behaviour; docs/decoding.md)."""
    high = x.candidates & (x.conf > x.knobs["threshold"][:, None])
    enough = high.sum(dim=1) >= x.quota
    return Decision(torch.where(enough[:, None], high, P.commit_best(x.conf, x.candidates, x.quota)))


def decide_block_edit(x: PolicyInputs) -> Decision:
    """LLaDA2.1's decoder: block-dynamic's commits with `num_to_transfer` as the quota (M2T), and token
    edits of the block's decided generated positions (T2T), from the same forward. At its block's last
    allowed forward (`max_steps_per_block`) the block is filled with the best tokens other than the
    mask (an edit back to what the fill wrote is none)."""
    knobs = x.knobs
    edit = P.token_edits(x.conf, x.x0, x.tokens, x.editable, knobs["editing_threshold"])
    fill = (x.step + 1 >= knobs["max_steps_per_block"])[:, None]
    tokens = torch.where(fill, x.unmasked, x.x0)
    commit = decide_block_dynamic(x).commit | (fill & x.candidates)
    return Decision(commit, edit=edit & (tokens != x.tokens), tokens=tokens)


def decide_sequential(x: PolicyInputs) -> Decision:
    """SDAR's sequential decoder: the `quota` candidates from the first one on, left to right."""
    position = torch.arange(x.conf.shape[1], device=x.conf.device, dtype=x.conf.dtype)
    return Decision(P.commit_best(-position.expand_as(x.conf), x.candidates, x.quota))


def cai_knobs(x: PolicyInputs) -> P.CaiKnobs:
    """CAI's knobs of the rows (gating switches the budgets and the grinding detector)."""
    k = x.knobs
    eta_denominator = torch.where(x.word("eta_denominator", "generation"), k["gen_length"], x.block_length)
    return P.CaiKnobs(theta_s=k["theta_s"], theta_e=k["theta_e"], warmup=k["warmup"],
                      block_schedule=k["block_schedule"], block_decay=k["block_decay"],
                      stretch=x.word("block_schedule_mode", "stretch"), position_factors=k["position_factors"],
                      budgets=k["budgets"] & k["gating"], grinding=k["grinding"] & k["gating"], eta=k["eta"],
                      eta_denominator=eta_denominator.float(), patience=k["patience"], theta_fb=k["theta_fb"],
                      grinding_fill=x.word("grinding_exit", "fill"), min_commit=k["min_commit"])


def decide_cai(x: PolicyInputs) -> Decision:
    """CAI, Algorithm 1 (policies.cai_step), with Box 2's s_i stored at a block's first step."""
    first_conf = P.box2_first_step_confidence(x.conf, x.state["first_conf"], x.step)
    out = P.cai_step(x.conf, x.candidates, x.step, x.steps_per_block, x.block, x.num_blocks, x.block_length,
                     P.CaiState(first_conf=first_conf, low_yield=x.state["low_yield"]), cai_knobs(x))
    return Decision(out.commit, out.forced, {"first_conf": first_conf, "low_yield": out.low_yield},
                    out.grinding_exit)

# ------------------------------------------------------------------------------------- host rules


def no_quota(row: Row) -> int:
    """The policy reads no quota."""
    return 0


def llada_quota(row: Row) -> int:
    """LLaDA's `get_num_transfer_tokens` over the masks the block started with."""
    return P.fixed_quota(row.undecided_at_block_start, row.steps_per_block, row.step)


def block_quota(row: Row) -> int:
    """The official block decoders' schedule: from the block length, even when the prompt's tail
    fills part of the block."""
    return P.fixed_quota(row.block_length, row.steps_per_block, row.step)


def dream_quota(row: Row) -> int:
    """Dream's `int(M * (1 - s/t))` of the masks left, every one at the block's last step."""
    last = row.steps_per_block - 1
    assert row.schedule is not None
    return P.dream_quota(row.undecided, row.schedule[min(row.step, last)], last_step=row.step >= last)


def dream_schedule(row: Row) -> list[float]:
    return P.dream_transfer_fractions(row.steps_per_block, row.params.eps)


def transfer_quota(row: Row) -> int:
    """LLaDA2.1's num_to_transfer: the fewest it commits while masks are left."""
    return row.params.num_to_transfer


def nothing_left(row: Row, counts: StepCounts, undecided_before: int) -> bool:
    """A block ends when no position of it is left undecided."""
    return counts.undecided == 0


def edit_block_ends(row: Row, counts: StepCounts, undecided_before: int) -> bool:
    """LLaDA2.1's `generate()` loop: a forward that started with no mask and edited nothing ends the
    block; once the last mask is filled each further forward is a post step, and the block ends before
    the forward that would be post step `max_post_steps + 1`; the block's last allowed forward
    (`max_steps_per_block`, which fills it) ends it. Edits may mask tokens again."""
    if undecided_before == 0 and counts.edited == 0:
        return True
    if row.step + 1 >= row.params.max_steps_per_block:
        return True
    if counts.undecided:
        return False
    return row.post_steps > row.params.max_post_steps  # this step's included (engine.advance counts them)

# --------------------------------------------------------------------------------- step bounds


@dataclass(frozen=True)
class StepBound:
    """What bounds a policy's forwards: the most steps a row of it takes (of its resolved
    `DecodeParams`), and the knob that sets that count (None: the canvas length, `max_tokens`), which
    a refusal names when the request set it (`always`: even when it did not)."""

    max_steps: Callable[[Any], int]
    knob: Optional[str] = None
    always: bool = False


# a block's last step commits what is left
BY_STEPS = StepBound(lambda p: p.total_steps, "steps")
# at least one token a step
BY_TOKENS = StepBound(lambda p: p.gen_length)
# `max_steps_per_block` a block, edits may mask tokens again (a prompt ending inside a block adds one)
BY_BLOCKS = StepBound(lambda p: (p.num_blocks + 1) * p.max_steps_per_block, "max_steps_per_block", always=True)
# `max_denoising_steps` a canvas (the official default where the request leaves it to the checkpoint)
BY_CANVASES = StepBound(lambda p: p.num_blocks * (p.max_denoising_steps or U.OFFICIAL["max_denoising_steps"]),
                        "max_denoising_steps")

# ----------------------------------------------------------------------------------- the registry


@dataclass(frozen=True)
class Policy:
    decide: Optional[DecideFn] = None  # a masked-token mode's decision (None: a uniform-noise policy)
    canvas: Optional[CanvasFn] = None  # a uniform-noise policy's decision (engine/uniform_mode.py)
    conf_kind: int = CONF_PROB
    quota: Callable[[Row], int] = no_quota  # host: the count the decide function reads this step
    block_ends: Callable[[Row, StepCounts, int], bool] = nothing_left
    schedule: Optional[Callable[[Row], list[float]]] = None  # per-request values its quota reads
    # it may change decided tokens of its block until the block ends: it reports finished blocks
    # only, and predicts over the whole vocabulary (the mask included)
    edits: bool = False
    modes: frozenset[str] = field(default=EVERY_MODE)
    one_block: bool = False  # default block: the whole canvas
    step_bound: StepBound = BY_STEPS  # what bounds its forwards (for --max-decode-steps)
    # what it keeps for each row between steps, by name (engine/decoding/row_state.py)
    state: Mapping[str, RowState] = field(default_factory=dict)


# Box 2's s_i per block position, Box 7's low-yield counter
CAI_STATE = {"first_conf": RowState((BLOCK_WIDE,), torch.float32), "low_yield": RowState()}
# each canvas position's settling count, Box 7's counter
CONVERGE_STATE = {"settled": RowState((BLOCK_WIDE,)), "low_yield": RowState()}
_DREAM = {"quota": dream_quota, "schedule": dream_schedule, "modes": frozenset({MASKED}), "one_block": True}

POLICIES: dict[str, Policy] = {
    "fixed": Policy(decide_rank, quota=llada_quota),
    "threshold": Policy(decide_threshold, step_bound=BY_TOKENS),
    "cai": Policy(decide_cai, state=CAI_STATE),
    "dream-maskgit_plus": Policy(decide_rank, **_DREAM),
    "dream-entropy": Policy(decide_rank, conf_kind=CONF_NEG_ENTROPY, **_DREAM),
    "dream-topk_margin": Policy(decide_rank, conf_kind=CONF_MARGIN, **_DREAM),
    # the block-diffusion decoders (SDAR's low_confidence_static / dynamic / sequential, LLaDA2.0's
    # threshold decoder = block-dynamic); LLaDA2.1's decoder (M2T commits and T2T edits) = block-edit
    "block-static": Policy(decide_rank, quota=block_quota),
    "block-dynamic": Policy(decide_block_dynamic, quota=block_quota),
    "block-sequential": Policy(decide_sequential, quota=block_quota),
    "block-edit": Policy(decide_block_edit, quota=transfer_quota, block_ends=edit_block_ends, edits=True,
                         modes=frozenset({BLOCK}), step_bound=BY_BLOCKS),
    # uniform-noise diffusion (DiffusionGemma): the official entropy-bound rule; the convergence-aware one
    "dg-official": Policy(canvas=U.decide_official, modes=frozenset({UNIFORM}), step_bound=BY_CANVASES),
    "dg-converge": Policy(canvas=U.decide_converge, modes=frozenset({UNIFORM}), step_bound=BY_CANVASES,
                          state=CONVERGE_STATE),
}
POLICY_NAMES = tuple(POLICIES)  # the `policy` knob's words: its slot-table column holds the index


def policy_state(mode: str) -> dict[str, RowState]:
    """The row state of every policy the decoding mode `mode` serves."""
    return merged(p.state for p in POLICIES.values() if mode in p.modes)


def policy_rows(policy: torch.Tensor, names: Collection[str]) -> torch.Tensor:
    """[B] bool: the rows (by their `policy` column) of any of these policies."""
    rows = torch.zeros_like(policy, dtype=torch.bool)
    for name in names:
        rows |= policy == POLICY_NAMES.index(name)
    return rows


def _merge_by_policy(inputs: Any, present: Collection[str], fn_of: Callable[[str], Optional[Callable[[Any], Any]]],
                     out: Any) -> set[str]:
    """The one dispatcher: each present policy's function once (policies sharing a function run it
    once), merged into `out` field by field: per row, the field of the row's policy's decision (a
    field a decision leaves None keeps `out`'s). Returns the fields some decision set."""
    by_fn: dict[Callable[[Any], Any], list[str]] = {}
    for name in sorted(present):
        fn = fn_of(name)
        assert fn is not None, f"{name} does not decide in this mode"
        by_fn.setdefault(fn, []).append(name)
    written: set[str] = set()
    for fn, names in by_fn.items():
        decision = fn(inputs)
        mine = policy_rows(inputs.knobs["policy"], names) if len(by_fn) > 1 else None
        for f in fields(decision):
            value = getattr(decision, f.name)
            if value is None:
                continue
            written.add(f.name)
            if isinstance(value, dict):  # row state: merged name by name
                setattr(out, f.name, {**getattr(out, f.name), **{
                    name: _rows_of(mine, new, getattr(out, f.name)[name]) for name, new in value.items()}})
            else:
                setattr(out, f.name, _rows_of(mine, value, getattr(out, f.name)))
    return written


def _rows_of(mine: Optional[torch.Tensor], value: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """`value` at the rows `mine` ([B] bool; None: every row), `before` elsewhere."""
    return value if mine is None else torch.where(mine.view(-1, *[1] * (value.dim() - 1)), value, before)


def decide(x: PolicyInputs, present: Collection[str]) -> Decision:
    """Each present policy's decide function once; per row, the decision of the row's policy. Then
    Fast-dLLM's Dream block decoder's rule (`commit_first_at_block_start`): a block's first forward
    commits its first position alone."""
    zeros = torch.zeros_like(x.candidates)
    out = Decision(zeros, forced=zeros, edit=zeros, tokens=x.x0, state=dict(x.state),
                   grinding_exit=torch.zeros_like(x.step, dtype=torch.bool))
    if "state" not in _merge_by_policy(x, present, lambda name: POLICIES[name].decide, out):
        out.state = None  # no policy of the step keeps row state: nothing to store back
    if x.first_only is not None:
        first = torch.zeros_like(x.candidates)
        first[:, 0] = True
        out.commit = torch.where(x.first_only[:, None], first & x.candidates, out.commit)
    return out


def decide_canvas(x: U.CanvasInputs, present: Collection[str]) -> U.CanvasDecision:
    """Each present uniform-noise policy once; per row, the decision of the row's policy (the row
    state of a policy that keeps none passes through)."""
    out = U.CanvasDecision(x.canvas_in, torch.zeros_like(x.canvas_in, dtype=torch.bool),
                           torch.zeros_like(x.stable, dtype=torch.bool), dict(x.state),
                           torch.zeros_like(x.stable, dtype=torch.bool))
    if "state" not in _merge_by_policy(x, present, lambda name: POLICIES[name].canvas, out):
        out.state = None
    return out
