"""The decide step: from a step's logits to what each row commits, and the one summary the host reads.

Policies are a registry: name -> (confidence kind, decide function). Each decide function sees the
whole batch and returns a commit mask for every row; the dispatcher runs each function present in
the batch once and keeps, per row, the decision of that row's policy. Rows of different policies
share a step.

Per-row state that lives from step to step on the device (CAI's first-step confidences and
low-yield counter) and the per-request knobs are slot-indexed tensors, written once when a request
takes a slot, so a step gathers them with one index and never reads a device value back on its own.
The step ends with one tensor holding, per row, its counters and its block's tokens, which the
scheduler transfers to the host once. `decide_tensors` is the whole step as a function of tensors
(by name, and host-known flags), which `EngineConfig.compile_decide` compiles into fused kernels.
"""

from __future__ import annotations

import array
import functools
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Optional

import torch

from engine.decoding import policies as P
from engine.decoding.sampling import (
    CONF_MARGIN,
    CONF_NEG_ENTROPY,
    CONF_PROB,
    confidence,
    filter_min_p,
    filter_top_k_top_p,
    predict,
    token_logprobs,
)
from engine.request import Request, slot_slice

# ----------------------------------------------------------------------------------------- knobs

# Float, integer and boolean knobs of a request, one slot row each.
_FLOAT_KNOBS = ("theta_s", "theta_e", "warmup", "block_decay", "eta", "eta_denominator", "theta_fb", "threshold",
                "top_p", "min_p")
_INT_KNOBS = ("patience", "min_commit", "top_k", "steps_per_block", "num_blocks", "block_length", "family",
              "conf_kind")
_BOOL_KNOBS = ("block_schedule", "stretch", "position_factors", "budgets", "grinding", "grinding_fill")


def _float_knobs(request: Request) -> list[float]:
    p = request.params
    return [p.theta_s, p.theta_e, p.warmup, p.block_decay, p.eta,
            float(p.gen_length if p.eta_denominator == "generation" else request.block_length), p.theta_fb,
            p.threshold, p.top_p if p.top_p is not None else 1.0, p.min_p or 0.0]


# Integer knobs live in int64 tensors. Values past this mean the same as this one (a top_k above the
# vocabulary keeps every token, a patience above the steps of a block never runs out).
_TENSOR_INT_MAX = torch.iinfo(torch.long).max


def _int_knobs(request: Request) -> list[int]:
    p = request.params
    policy = POLICIES[p.policy]
    values = [p.patience, p.min_commit, p.top_k_on, request.steps_per_block, request.num_blocks,
              request.block_length, policy.family, policy.conf_kind]
    return [min(v, _TENSOR_INT_MAX) for v in values]


def _bool_knobs(request: Request) -> list[bool]:
    p = request.params
    gating = p.gating_on
    return [p.block_schedule, p.block_schedule_mode == "stretch", p.position_factors, p.budgets and gating,
            p.grinding and gating, p.grinding_exit == "fill"]


# Per-step values that change as a row advances, sent to the device as one [B, k] tensor.
# schedule_step: the row's step counted from its first block's first step, where it reads its
# tabulated theta_b(t) (DecodeState.theta_schedule).
STEP_FIELDS = ("slot", "step", "block", "block_start", "quota", "commit_first_only", "block_length", "length",
                "prompt_len", "schedule_step")


def step_fields(request: Request) -> list[int]:
    return [request.slot, request.step, request.block, request.block_start,
            request.rank_quota() if POLICIES[request.policy].family == P.FAMILY_RANK else 0,
            int(request.params.commit_first_at_block_start and request.step == 0), request.block_length,
            request.length, request.prompt_len, request.block * request.steps_per_block + request.step]


class Columns(Mapping[str, torch.Tensor]):
    """The named columns of a [B, k] tensor, each a view made when first read: a step reads a few of
    a table's columns, and unbinding all of them every step costs more than selecting those."""

    def __init__(self, index: dict[str, int], table: torch.Tensor) -> None:
        self._index = index
        self._table = table
        self._views: dict[str, torch.Tensor] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        view = self._views.get(name)
        if view is None:
            view = self._views[name] = self._table[:, self._index[name]]
        return view

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)


# Columns the knob tables carry past the request's knobs: what CAI reads at a step of a request's
# knobs with their switches folded in (CaiStepKnobs, Box 6's clip, Box 5's largest budget),
# derived once per request (_cai_tables) so that admitting one is a copy per table.
_DERIVED_FLOATS = ("fallback_floor", "clip_low", "clip_high")
_DERIVED_INTS = ("grinding_patience", "budget_unsure", "last_step")
_DERIVED_BOOLS = ("min_commit_on",)

_FLOAT_INDEX = {name: k for k, name in enumerate(_FLOAT_KNOBS + _DERIVED_FLOATS)}
_INT_INDEX = {name: k for k, name in enumerate(_INT_KNOBS + _DERIVED_INTS)}
_BOOL_INDEX = {name: k for k, name in enumerate(_BOOL_KNOBS + _DERIVED_BOOLS)}
_FIELD_INDEX = {name: k for k, name in enumerate(STEP_FIELDS)}

# -------------------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class Batch:
    """Everything a decide function may read about the step's rows, as [B] / [B, W] tensors."""

    conf: torch.Tensor  # [B, W] Box 1 confidence (of the row's kind)
    candidates: torch.Tensor  # [B, W] still masked and inside the row's block
    step: torch.Tensor
    block: torch.Tensor
    quota: torch.Tensor
    f: Mapping[str, torch.Tensor]  # float knobs by name
    i: Mapping[str, torch.Tensor]  # integer knobs by name
    b: Mapping[str, torch.Tensor]  # boolean knobs by name
    first_conf: torch.Tensor  # [B, W] Box 2's s_i as stored so far
    low_yield: torch.Tensor  # [B]
    schedule: Optional[CaiSchedule]  # when a row of the step decodes with CAI


@dataclass(frozen=True)
class CaiSchedule:
    """What CAI reads at a step that depends on a row's request, block and step alone, tabulated
    when the request takes its slot (DecodeState.admit) and gathered for the step's rows."""

    theta_block: torch.Tensor  # [B] theta_b(t), Boxes 3-4
    factors: P.PositionFactors  # Box 6's position factors and clip
    tiers: P.BudgetTiers  # Box 5's budgets by confidence case (NEVER without budgets)
    knobs: P.CaiStepKnobs  # what the step reads of the knobs, switches folded in


def cai_knobs(f: Mapping[str, torch.Tensor], i: Mapping[str, torch.Tensor],
              b: Mapping[str, torch.Tensor]) -> P.CaiKnobs:
    return P.CaiKnobs(theta_s=f["theta_s"], theta_e=f["theta_e"], warmup=f["warmup"],
                      block_schedule=b["block_schedule"], block_decay=f["block_decay"], stretch=b["stretch"],
                      position_factors=b["position_factors"], budgets=b["budgets"], grinding=b["grinding"],
                      eta=f["eta"], eta_denominator=f["eta_denominator"], patience=i["patience"],
                      theta_fb=f["theta_fb"], grinding_fill=b["grinding_fill"], min_commit=i["min_commit"])


@dataclass
class Decision:
    commit: torch.Tensor  # [B, W]
    forced: Optional[torch.Tensor] = None  # [B, W] committed below their threshold
    first_conf: Optional[torch.Tensor] = None  # [B, W] state to store back
    low_yield: Optional[torch.Tensor] = None  # [B]
    grinding_exit: Optional[torch.Tensor] = None  # [B]


DecideFn = Callable[[Batch], Decision]


def decide_rank(batch: Batch) -> Decision:
    """`fixed` (LLaDA) and `dream-*`: the quota best candidates (the quota is computed on the host)."""
    return Decision(P.commit_best(batch.conf, batch.candidates, batch.quota))


def decide_threshold(batch: Batch) -> Decision:
    """Fast-dLLM: every candidate at or above the threshold, and always the best one."""
    return Decision(P.threshold_commit(batch.conf, batch.candidates, batch.f["threshold"],
                                       torch.ones_like(batch.step)))


def decide_cai(batch: Batch) -> Decision:
    """CAI, Algorithm 1 (policies.cai_step, with its per-request part tabulated: CaiSchedule)."""
    schedule = batch.schedule
    assert schedule is not None, "a CAI row's step gathers its schedule (decide_step)"
    first_conf = P.box2_first_step_confidence(batch.conf, batch.first_conf, batch.step)
    out = P.cai_commit(batch.conf, batch.candidates, batch.step, schedule.theta_block, schedule.factors,
                       schedule.tiers, P.CaiState(first_conf=first_conf, low_yield=batch.low_yield), schedule.knobs)
    return Decision(out.commit, out.forced, first_conf, out.low_yield, out.grinding_exit)


@dataclass(frozen=True)
class Policy:
    conf_kind: int
    family: int
    decide: DecideFn


POLICIES: dict[str, Policy] = {
    "fixed": Policy(CONF_PROB, P.FAMILY_RANK, decide_rank),
    "threshold": Policy(CONF_PROB, P.FAMILY_THRESHOLD, decide_threshold),
    "cai": Policy(CONF_PROB, P.FAMILY_CAI, decide_cai),
    "dream-maskgit_plus": Policy(CONF_PROB, P.FAMILY_RANK, decide_rank),
    "dream-entropy": Policy(CONF_NEG_ENTROPY, P.FAMILY_RANK, decide_rank),
    "dream-topk_margin": Policy(CONF_MARGIN, P.FAMILY_RANK, decide_rank),
}

# Summary columns before the block's tokens. band_high and band_low count a block's first step's
# candidates by confidence (0 in a step where no row is at its block's first step).
# end_pos: the block's first end token; first_masked: its first masked position; each the block width
# when there is none. An end token ends the row only with no mask before it (end_pos < first_masked),
# which the host checks.
SUMMARY_COLUMNS = ("committed", "still_masked", "forced", "band_high", "band_low", "grinding_exit", "end_pos",
                   "first_masked")


@dataclass(frozen=True)
class SlotRows:
    """Views of DecodeState's tables at a step's rows: what the decide step reads of its rows besides
    the theta_b(t) of their step."""

    f: Mapping[str, torch.Tensor]  # float knobs by name
    i: Mapping[str, torch.Tensor]  # integer knobs by name
    b: Mapping[str, torch.Tensor]  # boolean knobs by name
    first_conf: torch.Tensor  # [B, W]
    low_yield: torch.Tensor  # [B]
    factors: P.PositionFactors
    tiers: P.BudgetTiers
    cai_knobs: P.CaiStepKnobs


class DecodeState:
    """Slot-indexed device tensors: request knobs, CAI's per-request tables and per-row state."""

    def __init__(self, max_batch: int, device: torch.device, compile_decide: bool = False) -> None:
        self.device = device
        # The decide step is ~90 small tensor operations; compiled, they run as a few fused kernels.
        # Compiling costs seconds per new batch shape family, hence a switch (EngineConfig).
        self.compiled = torch.compile(decide_tensors, dynamic=True) if compile_decide else None
        self.width = 1
        self.knobs_f = torch.zeros(max_batch, len(_FLOAT_INDEX), device=device)
        self.knobs_i = torch.zeros(max_batch, len(_INT_INDEX), dtype=torch.long, device=device)
        self.knobs_b = torch.zeros(max_batch, len(_BOOL_INDEX), dtype=torch.bool, device=device)
        self.first_conf = torch.zeros(max_batch, self.width, device=device)
        self.low_yield = torch.zeros(max_batch, dtype=torch.long, device=device)
        # CAI's per-request tables (CaiSchedule), so that a step computes none of it. Past a row's
        # block, positions are never candidates: what the tables hold there is never read.
        self.theta_schedule = torch.zeros(max_batch, 1, device=device)  # [slot, block * T + t]
        self.position_factor = torch.ones(max_batch, self.width, device=device)  # Box 6's r_pos
        self.tier_confident = torch.zeros(max_batch, self.width, dtype=torch.long, device=device)  # Box 5
        self.tier_middle = torch.zeros(max_batch, self.width, dtype=torch.long, device=device)
        # SlotRows of slot ranges, made once: the tables are written in place, so views stay valid
        # until a table is replaced by a wider one (then they are dropped)
        self._views: dict[tuple[int, int, int], SlotRows] = {}
        # SlotRows of slot sets with gaps: gathered copies, whose knobs and tables hold until a slot
        # takes a new request (then they are dropped); CAI's state is gathered anew each step
        self._gathered: dict[tuple[tuple[int, ...], int], SlotRows] = {}

    def admit(self, request: Request) -> None:
        """Write a request's knobs and CAI tables into its slot (host-to-device, once per request)."""
        if request.block_length > self.width:
            self.first_conf, self.position_factor, self.tier_confident, self.tier_middle = (
                _widened(t, request.block_length)
                for t in (self.first_conf, self.position_factor, self.tier_confident, self.tier_middle))
            self.width = request.block_length
            self._views.clear()
        total_steps = request.num_blocks * request.steps_per_block
        if total_steps > self.theta_schedule.shape[1]:
            self.theta_schedule = _widened(self.theta_schedule, total_steps)
        self._gathered.clear()
        slot = request.slot
        tables = _cai_tables(tuple(_float_knobs(request)), tuple(_int_knobs(request)), tuple(_bool_knobs(request)),
                             total_steps)
        width = request.block_length
        device = self.device
        self.knobs_f[slot] = tables.floats.to(device, non_blocking=True)
        self.knobs_i[slot] = tables.ints.to(device, non_blocking=True)
        self.knobs_b[slot] = tables.bools.to(device, non_blocking=True)
        self.low_yield[slot] = 0
        self.theta_schedule[slot, :total_steps] = tables.theta.to(device, non_blocking=True)
        self.position_factor[slot, :width] = tables.factor.to(device, non_blocking=True)
        self.tier_confident[slot, :width] = tables.confident.to(device, non_blocking=True)
        self.tier_middle[slot, :width] = tables.middle.to(device, non_blocking=True)

    def rows(self, rows_of: slice | torch.Tensor, width: int, slots: tuple[int, ...]) -> SlotRows:
        """The tables at a step's rows (`rows_of`: a slot range, or the rows' `slots` as a tensor): a
        slot range's views are made once and kept; a slot set with gaps has its knobs and tables
        gathered once per set of requests and its CAI state gathered each step."""
        if isinstance(rows_of, slice):
            key = (rows_of.start, rows_of.stop, width)
            view = self._views.get(key)
            if view is None:
                if len(self._views) >= _VIEW_CACHE:
                    self._views.clear()
                view = self._views[key] = self._slot_rows(rows_of, width)
            return view
        gathered = self._gathered.get((slots, width))
        if gathered is None:
            if len(self._gathered) >= _VIEW_CACHE:
                self._gathered.clear()
            gathered = self._gathered[(slots, width)] = self._slot_rows(rows_of, width)
            return gathered
        return replace(gathered, first_conf=self.first_conf[rows_of, :width], low_yield=self.low_yield[rows_of])

    def _slot_rows(self, rows_of: slice | torch.Tensor, width: int) -> SlotRows:
        knobs_f, knobs_i = self.knobs_f[rows_of], self.knobs_i[rows_of]
        f, i = Columns(_FLOAT_INDEX, knobs_f), Columns(_INT_INDEX, knobs_i)
        b = Columns(_BOOL_INDEX, self.knobs_b[rows_of])
        low, high, unsure = _FLOAT_INDEX["clip_low"], _FLOAT_INDEX["clip_high"], _INT_INDEX["budget_unsure"]
        return SlotRows(
            f=f, i=i, b=b, first_conf=self.first_conf[rows_of, :width],
            low_yield=self.low_yield[rows_of],
            factors=P.PositionFactors(self.position_factor[rows_of, :width], knobs_f[:, low:low + 1],
                                      knobs_f[:, high:high + 1]),
            tiers=P.BudgetTiers(self.tier_confident[rows_of, :width], self.tier_middle[rows_of, :width],
                                knobs_i[:, unsure:unsure + 1]),
            cai_knobs=P.CaiStepKnobs(eta=f["eta"], eta_denominator=f["eta_denominator"],
                                     patience=i["grinding_patience"], fallback_floor=f["fallback_floor"],
                                     min_commit=b["min_commit_on"], last_step=i["last_step"]))

    def theta_block(self, rows: StepRows) -> torch.Tensor:
        """[B] theta_b(t) of each row at its block and step (a gather)."""
        return self.theta_schedule[rows.column("slot"), rows.column("schedule_step")]


# Bound on the slot ranges whose views a DecodeState keeps (cleared when reached).
_VIEW_CACHE = 256


@dataclass(frozen=True)
class CaiTables:
    """A request's slot rows, on the host: its knob rows (with the derived columns) and CAI's tables."""

    floats: torch.Tensor  # [len(_FLOAT_INDEX)] float knobs, then _DERIVED_FLOATS
    ints: torch.Tensor  # [len(_INT_INDEX)] integer knobs, then _DERIVED_INTS
    bools: torch.Tensor  # [len(_BOOL_INDEX)] boolean knobs, then _DERIVED_BOOLS
    theta: torch.Tensor  # [total_steps] theta_b(t) for every (block, step)
    factor: torch.Tensor  # [block_length] Box 6's r_pos
    confident: torch.Tensor  # [block_length] Box 5's tiers
    middle: torch.Tensor  # [block_length]


@functools.lru_cache(maxsize=64)
def _cai_tables(floats: tuple[float, ...], ints: tuple[int, ...], bools: tuple[bool, ...],
                total_steps: int) -> CaiTables:
    """A request's slot rows: its knobs and what Algorithm 1 reads that depends on them, its block
    and step alone. Requests with the same knobs share them (a server's requests mostly do), so
    admitting one is a few copies."""
    f = {name: torch.tensor([v], dtype=torch.float32) for name, v in zip(_FLOAT_KNOBS, floats, strict=True)}
    i = {name: torch.tensor([v], dtype=torch.long) for name, v in zip(_INT_KNOBS, ints, strict=True)}
    b = {name: torch.tensor([v], dtype=torch.bool) for name, v in zip(_BOOL_KNOBS, bools, strict=True)}
    knobs = cai_knobs(f, i, b)
    steps_per_block = i["steps_per_block"]
    every_step = torch.arange(total_steps)
    theta = P.block_threshold(every_step % steps_per_block, steps_per_block, every_step // steps_per_block,
                              i["num_blocks"], knobs)
    quarter = P.block_quarter(ints[_INT_KNOBS.index("block_length")], i["block_length"])
    factors = P.box6_position_factors(quarter, knobs.position_factors)
    tiers = P.budget_tiers(quarter, steps_per_block, knobs.budgets)
    step = P.cai_step_knobs(knobs, steps_per_block)
    derived_floats = torch.cat([step.fallback_floor.float(), factors.low[0].float(), factors.high[0].float()])
    derived_ints = torch.cat([step.patience.long(), tiers.unsure[0].long(), step.last_step.long()])
    return CaiTables(floats=torch.cat([torch.tensor(floats, dtype=torch.float32), derived_floats]),
                     ints=torch.cat([torch.tensor(ints, dtype=torch.long), derived_ints]),
                     bools=torch.cat([torch.tensor(bools, dtype=torch.bool), step.min_commit]),
                     theta=theta, factor=factors.factor[0],
                     confident=tiers.confident[0], middle=tiers.middle[0])


def _widened(table: torch.Tensor, width: int) -> torch.Tensor:
    grown = torch.zeros(table.shape[0], width, dtype=table.dtype, device=table.device)
    grown[:, :table.shape[1]] = table
    return grown


@dataclass(frozen=True)
class BatchTraits:
    """What the host knows of a step's rows that holds as long as the batch is the same requests:
    made once per batch (`StepRows.build` reuses the last step's), not once per step."""

    request_ids: tuple[str, ...]
    width: int  # the widest block
    policies: frozenset[str]
    sampled: tuple[tuple[int, torch.Generator, float], ...]  # (row, generator, temperature) of sampling rows
    max_top_k: int
    any_top_p: bool
    any_min_p: bool
    logprob_k: int  # top alternatives to report (the most any row asks); -1: no row wants logprobs
    slot_rows: Optional[slice]  # the rows' slots as a slice when consecutive (request.slot_slice), else None
    slots: tuple[int, ...]  # the rows' slots

    @classmethod
    def of(cls, requests: Sequence[Request], request_ids: tuple[str, ...]) -> BatchTraits:
        return cls(request_ids=request_ids, width=max(r.block_length for r in requests),
                   policies=frozenset(r.policy for r in requests),
                   sampled=tuple((b, r.generator, r.params.temperature) for b, r in enumerate(requests)
                                 if r.generator is not None),
                   max_top_k=max(r.params.top_k_on for r in requests),
                   any_top_p=any(r.params.top_p is not None and r.params.top_p < 1 for r in requests),
                   any_min_p=any(bool(r.params.min_p) for r in requests),
                   logprob_k=max((r.params.logprobs for r in requests if r.params.logprobs is not None),
                                 default=-1),
                   slot_rows=slot_slice(requests), slots=tuple(r.slot for r in requests))


_COMMIT_FIRST_FIELD = STEP_FIELDS.index("commit_first_only")


@dataclass
class StepRows:
    """The host's view of the rows in a step, fixed before the forward."""

    requests: Sequence[Request]
    fields: torch.Tensor  # [B, len(STEP_FIELDS)] on the device
    traits: BatchTraits
    commit_first: bool
    block_start: bool  # some row is at its block's first step
    columns: Columns = field(init=False)  # fields' columns by name, each a view made when first read

    def __post_init__(self) -> None:
        self.columns = Columns(_FIELD_INDEX, self.fields)

    @classmethod
    def build(cls, requests: Sequence[Request], device: torch.device,
              previous: Optional[BatchTraits] = None) -> StepRows:
        """The step's rows; `previous` (the last step's traits) is reused when the rows are the same."""
        rows = [step_fields(r) for r in requests]
        flat = array.array("q", [value for row in rows for value in row])
        fields = torch.frombuffer(flat, dtype=torch.long).view(len(rows), len(STEP_FIELDS))
        request_ids = tuple(r.request_id for r in requests)
        traits = previous if previous is not None and previous.request_ids == request_ids else (
            BatchTraits.of(requests, request_ids))
        return cls(requests=requests, fields=fields.to(device, non_blocking=True), traits=traits,
                   commit_first=any(row[_COMMIT_FIRST_FIELD] for row in rows),
                   block_start=any(r.step == 0 for r in requests))

    @property
    def width(self) -> int:
        return self.traits.width

    @property
    def slot_rows(self) -> Optional[slice]:
        return self.traits.slot_rows

    def column(self, name: str) -> torch.Tensor:
        return self.columns[name]


def decide_step(state: DecodeState, rows: StepRows, logits: torch.Tensor, block_tokens: torch.Tensor,
                in_block: torch.Tensor, mask_id: int, end_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Predict, decide and commit for every row. Returns (the block's new tokens [B, W], the summary
    [B, len(SUMMARY_COLUMNS) + W] whose host copy is the step's one device-to-host transfer)."""
    # A full batch is in slot order (the scheduler keeps it sorted): slices, not gathers and scatters
    rows_of = rows.slot_rows if rows.slot_rows is not None else rows.column("slot")
    width = block_tokens.shape[1]
    traits = rows.traits
    slot_rows = state.rows(rows_of, width, traits.slots)
    schedule = None
    if "cai" in traits.policies:
        schedule = CaiSchedule(state.theta_block(rows), slot_rows.factors, slot_rows.tiers, slot_rows.cai_knobs)
    args = (slot_rows.first_conf, slot_rows.low_yield, logits, block_tokens, in_block, end_ids, mask_id,
            traits.policies, traits.sampled, traits.max_top_k, traits.any_top_p, traits.any_min_p, rows.commit_first,
            rows.block_start, traits.logprob_k, schedule)
    if state.compiled is not None and not traits.sampled:
        # Rows that sample draw from their own generators, which stay outside a compiled graph; the
        # compiled step takes plain dicts of the columns
        new_tokens, summary, first_conf, low_yield = state.compiled(
            dict(slot_rows.f), dict(slot_rows.i), dict(slot_rows.b), dict(rows.columns), *args)
    else:
        new_tokens, summary, first_conf, low_yield = decide_tensors(slot_rows.f, slot_rows.i, slot_rows.b,
                                                                    rows.columns, *args)
    if "cai" in traits.policies:
        state.first_conf[rows_of, :width] = first_conf
        state.low_yield[rows_of] = low_yield
    return new_tokens, summary


def decide_tensors(f: Mapping[str, torch.Tensor], i: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor],
                   column: Mapping[str, torch.Tensor], first_conf: torch.Tensor, low_yield: torch.Tensor,
                   logits: torch.Tensor, block_tokens: torch.Tensor, in_block: torch.Tensor, end_ids: torch.Tensor,
                   mask_id: int, policies: frozenset[str], sampled: tuple[tuple[int, torch.Generator, float], ...],
                   max_top_k: int, any_top_p: bool, any_min_p: bool, commit_first: bool, block_start: bool = True,
                   logprob_k: int = -1,
                   schedule: Optional[CaiSchedule] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                    torch.Tensor]:
    """The decide step on the rows' tensors (knobs by name, step fields by name, CAI state and
    schedule at the rows): tensors in, tensors out, so that it can be compiled. Returns (new tokens,
    summary, CAI's s_i, CAI's counter). With `logprob_k` >= 0 the summary also carries every block
    position's logprobs (`LogprobColumns`)."""
    raw_logits = logits
    if max_top_k > 0 or any_top_p:
        logits = filter_top_k_top_p(logits, i["top_k"], f["top_p"], max_top_k=max_top_k, any_top_p=any_top_p)
    if any_min_p:
        logits = filter_min_p(logits, f["min_p"])
    x0 = predict(logits, sampled, mask_id)
    kinds = frozenset(POLICIES[name].conf_kind for name in policies)
    conf = confidence(logits, x0, i["conf_kind"], kinds)
    candidates = (block_tokens == mask_id) & in_block
    width = block_tokens.shape[1]
    step = column["step"]
    batch = Batch(conf=conf, candidates=candidates, step=step, block=column["block"], quota=column["quota"], f=f,
                  i=i, b=b, first_conf=first_conf, low_yield=low_yield, schedule=schedule)
    decided: dict[DecideFn, Decision] = {}
    for name in sorted(policies):
        policy = POLICIES[name]
        if policy.decide not in decided:
            decided[policy.decide] = policy.decide(batch)
    if len(decided) == 1:  # every row decides alike: its decision is the step's, no per-row choice
        [decision] = decided.values()
        commit = decision.commit
        if decision.forced is not None:
            forced, grinding = decision.forced, decision.grinding_exit
            first_conf, low_yield = decision.first_conf, decision.low_yield
        else:
            forced, grinding = torch.zeros_like(candidates), torch.zeros_like(step, dtype=torch.bool)
    else:
        commit = torch.zeros_like(candidates)
        forced = torch.zeros_like(candidates)
        grinding = torch.zeros_like(step, dtype=torch.bool)
        for fn, decision in decided.items():
            mine = torch.zeros_like(grinding)
            for family in {p.family for p in POLICIES.values() if p.decide is fn}:
                mine |= i["family"] == family
            commit = torch.where(mine[:, None], decision.commit, commit)
            if decision.forced is not None:
                forced = torch.where(mine[:, None], decision.forced, forced)
                grinding = mine & decision.grinding_exit
                first_conf = torch.where(mine[:, None], decision.first_conf, first_conf)
                low_yield = torch.where(mine, decision.low_yield, low_yield)
    if commit_first:  # Fast-dLLM's Dream block decoder: a block's first forward commits its first token
        first_only = column["commit_first_only"] > 0
        first = torch.zeros_like(candidates)
        first[:, 0] = True
        commit = torch.where(first_only[:, None], first & candidates, commit)

    new_tokens = torch.where(commit, x0, block_tokens)
    still_masked = candidates & ~commit  # a committed position holds a prediction, never the mask
    position, none = P.block_positions(width, conf.device)
    # first still-masked position and first end token (width: none)
    first_masked = torch.where(still_masked, position, none).amin(dim=1)
    end_pos = torch.where(torch.isin(new_tokens, end_ids) & in_block, position, none).amin(dim=1)
    # the counted columns in one reduction; first-step confidence bands, which the host reads at a
    # block's first step alone: above 0.5 and below 0.25 (the host derives the middle band)
    if block_start:
        bands = [candidates & (conf > P.CONF_HIGH), candidates & (conf < P.CONF_LOW)]
    else:
        bands = [_no_positions(candidates.shape, candidates.device)] * 2
    counts = torch.stack([commit, still_masked, forced, *bands], dim=1).sum(dim=2)
    parts = [counts, torch.stack([grinding, end_pos, first_masked], dim=1), new_tokens]  # stack promotes to int64
    if logprob_k >= 0:
        chosen, top_values, top_ids = token_logprobs(raw_logits, x0, logprob_k)
        batch_size = new_tokens.shape[0]
        parts += [float_bits(chosen), float_bits(top_values).reshape(batch_size, -1), top_ids.reshape(batch_size, -1)]
    return new_tokens, torch.cat(parts, dim=1), first_conf, low_yield


@functools.lru_cache(maxsize=64)
def _no_positions(shape: torch.Size, device: torch.device) -> torch.Tensor:
    """An all-False [B, W] mask, made once per shape (read, never written)."""
    return torch.zeros(shape, dtype=torch.bool, device=device)


def float_bits(values: torch.Tensor) -> torch.Tensor:
    """float32 values as int64 holding their bit patterns, so they travel in the integer summary (one
    transfer); `LogprobColumns.read` turns them back into floats on the host."""
    return values.float().contiguous().view(torch.int32).long()


@dataclass(frozen=True)
class LogprobColumns:
    """Where a summary row keeps its logprobs: after the block's W tokens, W chosen-token logprobs,
    then W x k top logprobs, then W x k top ids (all row-major)."""

    width: int
    k: int

    def read(self, row: Sequence[int], position: int) -> tuple[float, tuple[tuple[int, float], ...]]:
        """(log p of the token committed at `position`, its step's top-k as (token id, log p))."""
        base = len(SUMMARY_COLUMNS) + self.width
        chosen = _bits_to_float(row[base + position])
        tops = base + self.width + position * self.k
        ids = base + self.width + self.width * self.k + position * self.k
        return chosen, tuple((row[ids + j], _bits_to_float(row[tops + j])) for j in range(self.k))


def _bits_to_float(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<i", bits))[0]
