"""The step's batch: its rows, their slots, their plans and per-row step fields, built once per step.

The scheduler's running requests become one `Batch`; the model runner reads it to run each row's
planned forward and the decide step reads it to commit tokens. Each row's plan for the step (its
mode's `RowPlan`: which forward, tokens fed, which rows share a forward) is made here, once. The
per-row values that change as a row advances (block, step, quota, ...) go to the device as one
[B, F] tensor, one host-to-device copy a step; what the host alone needs (the widest block, which
policies are present, which rows sample) is gathered in the same pass over the rows.
"""

from __future__ import annotations

import array
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import NamedTuple, Optional

import torch

from engine.host_copy import to_device
from engine.models.parallel.group import VocabShard
from engine.request import Request


class RowPlan(NamedTuple):
    """A row's part in this step, made once by its decoding mode (`DecodingMode.plan`)."""

    kind: str  # its forward: a key of the mode's `forwards`
    fed: int  # tokens it feeds the model (its share of the step's work)
    group: tuple  # rows with equal groups share one forward (the kind first)
    commits: bool = True  # False: a forward that writes the cache and commits nothing (SDAR's store pass)


# Per-row values sent to the device each step. first_only: the row's block's first forward commits its
# first position alone (commit_first_at_block_start); cache_start: the row's cached length (its cache
# holds [0, cache_start)); commits: 0 for a forward that commits nothing.
STEP_FIELDS = ("slot", "step", "block", "block_start", "quota", "first_only", "block_length", "length",
               "prompt_len", "cache_start", "commits", "steps_per_block", "num_blocks")
_ROW_TENSORS = ("slots", *STEP_FIELDS[1:])  # the Batch fields that hold them


@dataclass
class ForwardOutput:
    """The forward passes' result for the step's rows, in row order (`engine.model_runner`)."""

    logits: torch.Tensor  # [B, W, V] float32: the prediction for each block position
    block_tokens: torch.Tensor  # [B, W] the canvas at each row's block (past the block: what follows it)
    in_block: torch.Tensor  # [B, W] position inside the row's block
    positions: torch.Tensor  # [B, W] canvas index of each block position
    vocab: Optional[VocabShard] = None  # the logits' columns on a tensor-parallel rank (None: all of them)


@dataclass(frozen=True)
class StepDecision:
    """What a step decided (`DecodingMode.decide`): what `Slots.write_back` writes, and the summary."""

    tokens: torch.Tensor  # [B, W] each row's block after the step
    state: Mapping[str, torch.Tensor]  # the row state to store, by name (engine/decoding/row_state.py)
    summary: torch.Tensor  # engine.summary.encode


def _span(requests: list[Request]) -> slice:
    return slice(requests[0].slot, requests[-1].slot + 1)


@dataclass(frozen=True)
class Batch:
    """The rows of one step, in slot order; every tensor is [B] on the model's device."""

    requests: list[Request]
    plans: list[RowPlan]
    slots: torch.Tensor
    step: torch.Tensor
    block: torch.Tensor
    block_start: torch.Tensor  # canvas index of the row's block
    quota: torch.Tensor  # the count its policy's decide function reads (Policy.quota)
    first_only: torch.Tensor
    block_length: torch.Tensor
    length: torch.Tensor  # prompt + canvas
    prompt_len: torch.Tensor
    cache_start: torch.Tensor
    commits: torch.Tensor
    steps_per_block: torch.Tensor
    num_blocks: torch.Tensor
    # host facts of the rows
    width: int  # the widest block
    policies: frozenset[str]
    sampled: tuple[tuple[int, torch.Generator, float], ...]  # (row, generator, temperature) of sampling rows
    max_top_k: int
    any_top_p: bool
    any_min_p: bool
    logprob_k: int  # top alternatives to report (the most any row asks); -1: no row wants logprobs
    at_block_start: bool  # some row is at its block's first step
    any_first_only: bool  # some row commits its block's first token alone this step
    max_length: int  # the longest canvas of the step: a KV store column past every row's canvas
    span: slice  # the slots from the first row's to the last's: the store rows a forward attending to them reads

    @classmethod
    def build(cls, requests: list[Request], plan: Callable[[Request], RowPlan], device: torch.device) -> Batch:
        """The step's rows, each planned by `plan` (its decoding mode's)."""
        plans, flat, sampled, policies = [], array.array("q"), [], set()
        width = max_top_k = max_length = 0
        logprob_k = -1
        any_top_p = any_min_p = at_block_start = any_first_only = False
        for b, r in enumerate(requests):
            p = r.params
            row_plan = plan(r)
            plans.append(row_plan)
            first_only = p.commit_first_at_block_start and r.step == 0
            row = {"slot": r.slot, "step": r.step, "block": r.block, "block_start": r.block_start,
                   "quota": r.policy.quota(r), "first_only": first_only, "block_length": r.block_length,
                   "length": r.length, "prompt_len": r.prompt_len, "cache_start": r.cached,
                   "commits": row_plan.commits, "steps_per_block": r.steps_per_block, "num_blocks": r.num_blocks}
            flat.extend(row[name] for name in STEP_FIELDS)
            width = max(width, r.block_length)
            max_length = max(max_length, r.length)
            policies.add(p.policy)
            if r.generator is not None:
                sampled.append((b, r.generator, p.temperature))
            max_top_k = max(max_top_k, p.top_k_on)
            any_top_p |= p.top_p is not None and p.top_p < 1
            any_min_p |= bool(p.min_p)
            if p.logprobs is not None:
                logprob_k = max(logprob_k, p.logprobs)
            at_block_start |= r.step == 0
            any_first_only |= first_only
        fields = torch.frombuffer(flat, dtype=torch.long).view(len(requests), len(STEP_FIELDS))
        columns = dict(zip(STEP_FIELDS, to_device(fields, device).unbind(1), strict=True))
        return cls(requests=requests, plans=plans, slots=columns.pop("slot"), **columns, width=width,
                   policies=frozenset(policies), sampled=tuple(sampled), max_top_k=max_top_k, any_top_p=any_top_p,
                   any_min_p=any_min_p, logprob_k=logprob_k, at_block_start=at_block_start,
                   any_first_only=any_first_only, max_length=max_length, span=_span(requests))

    def rows(self, index: list[int]) -> Batch:
        """These rows alone, in this order: one forward's rows, their per-row tensors gathered (the
        host facts stay the step's: its widest block is the width of every forward's logits)."""
        at = to_device(torch.tensor(index), self.slots.device)
        requests = [self.requests[b] for b in index]
        gathered = {name: getattr(self, name)[at] for name in _ROW_TENSORS}
        return replace(self, requests=requests, plans=[self.plans[b] for b in index], span=_span(requests), **gathered)

    @property
    def fills_span(self) -> bool:
        """Whether these rows are every slot of their span, in order (the running rows hold slots
        [0, n) in row order, so a forward of all of them does)."""
        return len(self.requests) == self.span.stop - self.span.start

    def spread(self, values: torch.Tensor, fill: int) -> torch.Tensor:
        """[span, ...]: `values` [B, ...] of these rows at their slots' places in the span, `fill` at
        the slots of the span's other rows (rows that run another forward this step: a forward that
        attends to the store runs over the span, a view of it, and ignores their outputs)."""
        if self.fills_span:
            return values
        out = values.new_full((self.span.stop - self.span.start, *values.shape[1:]), fill)
        out[self.slots - self.span.start] = values
        return out

    def gather(self, outputs: torch.Tensor) -> torch.Tensor:
        """These rows' part of a forward's outputs [span, ...] over the span."""
        return outputs if self.fills_span else outputs.index_select(0, self.slots - self.span.start)

    def __len__(self) -> int:
        return len(self.requests)
