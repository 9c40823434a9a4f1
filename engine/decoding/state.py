"""Slot-indexed decoding tables: each request's knobs, CAI's per-request tables and CAI's row state.

A request's knobs and what Algorithm 1 reads that depends on its request, block and step alone
(theta_b(t) of Boxes 3-4 for every (block, step), Box 6's position factors, Box 5's budget tiers)
are written into its slot once, when it is admitted (`engine.slots.Slots.admit`); a step gathers
its rows' tables with one index each and computes none of them. CAI's state that lives from step to
step (Box 2's s_i, Box 7's counter) is stored back by the decide step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.batch import Batch
from engine.decoding import policies as P
from engine.decoding.decide import POLICIES, CaiSchedule
from engine.request import Request

FLOAT_KNOBS = ("theta_s", "theta_e", "warmup", "block_decay", "eta", "eta_denominator", "theta_fb", "threshold",
               "top_p", "min_p", "editing_threshold")
INT_KNOBS = ("patience", "min_commit", "top_k", "steps_per_block", "num_blocks", "block_length", "family",
             "conf_kind", "max_steps_per_block")
BOOL_KNOBS = ("block_schedule", "stretch", "position_factors", "budgets", "grinding", "grinding_fill")

# Integer knobs live in int64 tensors. Values past this mean the same as this one (a top_k above the
# vocabulary keeps every token, a patience above the steps of a block never runs out).
_INT_MAX = torch.iinfo(torch.long).max


def request_knobs(request: Request) -> tuple[list[float], list[int], list[bool]]:
    """A request's float, integer and boolean knobs, in FLOAT_KNOBS / INT_KNOBS / BOOL_KNOBS order."""
    p = request.params
    policy = POLICIES[p.policy]
    eta_denominator = p.gen_length if p.eta_denominator == "generation" else request.block_length
    floats = [p.theta_s, p.theta_e, p.warmup, p.block_decay, p.eta, float(eta_denominator), p.theta_fb,
              p.threshold, p.top_p if p.top_p is not None else 1.0, p.min_p or 0.0, p.editing_threshold]
    ints = [p.patience, p.min_commit, p.top_k_on, request.steps_per_block, request.num_blocks,
            request.block_length, policy.family, policy.conf_kind, p.max_steps_per_block]
    bools = [p.block_schedule, p.block_schedule_mode == "stretch", p.position_factors, p.budgets and p.gating_on,
             p.grinding and p.gating_on, p.grinding_exit == "fill"]
    return floats, [min(v, _INT_MAX) for v in ints], bools


def cai_knobs(f: dict[str, torch.Tensor], i: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> P.CaiKnobs:
    return P.CaiKnobs(theta_s=f["theta_s"], theta_e=f["theta_e"], warmup=f["warmup"],
                      block_schedule=b["block_schedule"], block_decay=f["block_decay"], stretch=b["stretch"],
                      position_factors=b["position_factors"], budgets=b["budgets"], grinding=b["grinding"],
                      eta=f["eta"], eta_denominator=f["eta_denominator"], patience=i["patience"],
                      theta_fb=f["theta_fb"], grinding_fill=b["grinding_fill"], min_commit=i["min_commit"])


@dataclass(frozen=True)
class RowTables:
    """The tables at a step's rows (gathered copies)."""

    f: dict[str, torch.Tensor]  # [B] float knobs by name
    i: dict[str, torch.Tensor]  # [B] integer knobs by name
    b: dict[str, torch.Tensor]  # [B] boolean knobs by name
    first_conf: torch.Tensor  # [B, W] Box 2's s_i as stored so far
    low_yield: torch.Tensor  # [B] Box 7's counter


def _grown(table: torch.Tensor, width: int, fill: float = 0) -> torch.Tensor:
    grown = torch.full((table.shape[0], width), fill, dtype=table.dtype, device=table.device)
    grown[:, :table.shape[1]] = table
    return grown


class DecodeTables:
    def __init__(self, max_batch: int, device: torch.device) -> None:
        self.device = device
        self.knobs_f = torch.zeros(max_batch, len(FLOAT_KNOBS), device=device)
        self.knobs_i = torch.zeros(max_batch, len(INT_KNOBS), dtype=torch.long, device=device)
        self.knobs_b = torch.zeros(max_batch, len(BOOL_KNOBS), dtype=torch.bool, device=device)
        self.first_conf = torch.zeros(max_batch, 1, device=device)
        self.low_yield = torch.zeros(max_batch, dtype=torch.long, device=device)
        # Past a row's block, positions are never candidates: what the tables hold there is never read.
        self.theta = torch.zeros(max_batch, 1, device=device)  # [slot, block * T + t] theta_b(t)
        self.position_factor = torch.ones(max_batch, 1, device=device)  # Box 6's r_pos
        self.tier_confident = torch.zeros(max_batch, 1, dtype=torch.long, device=device)  # Box 5
        self.tier_middle = torch.zeros(max_batch, 1, dtype=torch.long, device=device)

    def grow(self, block_width: int, total_steps: int) -> None:
        """Room for blocks `block_width` wide and `total_steps` steps in all (tables never shrink)."""
        if block_width > self.first_conf.shape[1]:
            self.first_conf = _grown(self.first_conf, block_width)
            self.position_factor = _grown(self.position_factor, block_width, 1.0)
            self.tier_confident = _grown(self.tier_confident, block_width)
            self.tier_middle = _grown(self.tier_middle, block_width)
        if total_steps > self.theta.shape[1]:
            self.theta = _grown(self.theta, total_steps)

    def write(self, request: Request) -> None:
        """The request's knobs and CAI tables into its slot (a few host-to-device copies, once)."""
        floats, ints, bools = request_knobs(request)
        f = dict(zip(FLOAT_KNOBS, torch.tensor(floats)[:, None], strict=True))
        i = dict(zip(INT_KNOBS, torch.tensor(ints)[:, None], strict=True))
        b = dict(zip(BOOL_KNOBS, torch.tensor(bools)[:, None], strict=True))
        knobs = cai_knobs(f, i, b)
        steps_per_block = i["steps_per_block"]
        total_steps = request.num_blocks * request.steps_per_block
        every_step = torch.arange(total_steps)
        theta = P.block_threshold(every_step % steps_per_block, steps_per_block, every_step // steps_per_block,
                                  i["num_blocks"], knobs)
        quarter = P.block_quarter(request.block_length, i["block_length"])
        factors = P.box6_position_factors(quarter, knobs.position_factors)
        tiers = P.budget_tiers(quarter, steps_per_block, knobs.budgets)
        slot, width, device = request.slot, request.block_length, self.device
        self.knobs_f[slot] = torch.tensor(floats, dtype=torch.float32).to(device, non_blocking=True)
        self.knobs_i[slot] = torch.tensor(ints, dtype=torch.long).to(device, non_blocking=True)
        self.knobs_b[slot] = torch.tensor(bools, dtype=torch.bool).to(device, non_blocking=True)
        self.low_yield[slot] = 0
        self.theta[slot, :total_steps] = theta.to(device, non_blocking=True)
        self.position_factor[slot, :width] = factors.factor[0].to(device, non_blocking=True)
        self.tier_confident[slot, :width] = tiers.confident[0].to(device, non_blocking=True)
        self.tier_middle[slot, :width] = tiers.middle[0].to(device, non_blocking=True)

    def at(self, batch: Batch) -> RowTables:
        slots, width = batch.slots, batch.width
        return RowTables(f=dict(zip(FLOAT_KNOBS, self.knobs_f[slots].unbind(1), strict=True)),
                         i=dict(zip(INT_KNOBS, self.knobs_i[slots].unbind(1), strict=True)),
                         b=dict(zip(BOOL_KNOBS, self.knobs_b[slots].unbind(1), strict=True)),
                         first_conf=self.first_conf[slots, :width], low_yield=self.low_yield[slots])

    def cai_schedule(self, batch: Batch, rows: RowTables) -> CaiSchedule:
        """What CAI reads at this step of its rows that depends on their request, block and step alone."""
        slots, width = batch.slots, batch.width
        f, i, b = rows.f, rows.i, rows.b
        on = b["position_factors"][:, None]
        low, high = P.TOKEN_THRESHOLD_CLIP
        factors = P.PositionFactors(self.position_factor[slots, :width], torch.where(on, low, -math.inf),
                                    torch.where(on, high, math.inf))
        unsure = torch.where(b["budgets"], P.budget_levels(i["steps_per_block"])[:, 2], P.NEVER)[:, None]
        tiers = P.BudgetTiers(self.tier_confident[slots, :width], self.tier_middle[slots, :width], unsure)
        return CaiSchedule(theta_block=self.theta[slots, batch.schedule_step], factors=factors, tiers=tiers,
                           knobs=P.cai_step_knobs(cai_knobs(f, i, b), i["steps_per_block"]))

    def store_cai_state(self, batch: Batch, first_conf: torch.Tensor, low_yield: torch.Tensor) -> None:
        self.first_conf[batch.slots, :batch.width] = first_conf
        self.low_yield[batch.slots] = low_yield
