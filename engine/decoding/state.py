"""Slot-indexed decoding tables: each request's knobs and CAI's row state.

A request's knobs are written into its slot once, when it is admitted (`engine.slots.Slots.admit`),
as one row of floats, integers and booleans; a step gathers its rows' knobs with one index per
table. CAI's state that lives from step to step (Box 2's s_i, Box 7's counter) is stored back by
the decide step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.batch import Batch
from engine.decoding.decide import POLICIES
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


@dataclass(frozen=True)
class RowTables:
    """The tables at a step's rows (gathered copies)."""

    f: dict[str, torch.Tensor]  # [B] float knobs by name
    i: dict[str, torch.Tensor]  # [B] integer knobs by name
    b: dict[str, torch.Tensor]  # [B] boolean knobs by name
    first_conf: torch.Tensor  # [B, W] Box 2's s_i as stored so far
    low_yield: torch.Tensor  # [B] Box 7's counter


class DecodeTables:
    def __init__(self, max_batch: int, device: torch.device) -> None:
        self.device = device
        self.knobs_f = torch.zeros(max_batch, len(FLOAT_KNOBS), device=device)
        self.knobs_i = torch.zeros(max_batch, len(INT_KNOBS), dtype=torch.long, device=device)
        self.knobs_b = torch.zeros(max_batch, len(BOOL_KNOBS), dtype=torch.bool, device=device)
        self.first_conf = torch.zeros(max_batch, 1, device=device)  # past a row's block: never read
        self.low_yield = torch.zeros(max_batch, dtype=torch.long, device=device)

    def grow(self, block_width: int) -> None:
        """Room for blocks `block_width` wide (tables never shrink)."""
        if block_width > self.first_conf.shape[1]:
            grown = torch.zeros(self.first_conf.shape[0], block_width, device=self.device)
            grown[:, :self.first_conf.shape[1]] = self.first_conf
            self.first_conf = grown

    def write(self, request: Request) -> None:
        """The request's knobs into its slot (three host-to-device copies, once)."""
        floats, ints, bools = request_knobs(request)
        slot, device = request.slot, self.device
        self.knobs_f[slot] = torch.tensor(floats, dtype=torch.float32).to(device, non_blocking=True)
        self.knobs_i[slot] = torch.tensor(ints, dtype=torch.long).to(device, non_blocking=True)
        self.knobs_b[slot] = torch.tensor(bools, dtype=torch.bool).to(device, non_blocking=True)
        self.low_yield[slot] = 0

    def at(self, batch: Batch) -> RowTables:
        slots, width = batch.slots, batch.width
        return RowTables(f=dict(zip(FLOAT_KNOBS, self.knobs_f[slots].unbind(1), strict=True)),
                         i=dict(zip(INT_KNOBS, self.knobs_i[slots].unbind(1), strict=True)),
                         b=dict(zip(BOOL_KNOBS, self.knobs_b[slots].unbind(1), strict=True)),
                         first_conf=self.first_conf[slots, :width], low_yield=self.low_yield[slots])

    def store_cai_state(self, batch: Batch, first_conf: torch.Tensor, low_yield: torch.Tensor) -> None:
        self.first_conf[batch.slots, :batch.width] = first_conf
        self.low_yield[batch.slots] = low_yield
