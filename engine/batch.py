"""The step's batch: its rows, their slots and per-row step fields, built once per step.

The scheduler's running requests become one `Batch`; the model runner reads it to build the
forwards' inputs and the decide step reads it to commit tokens. The per-row values that change as a
row advances (block, step, quota, ...) go to the device as one [B, F] tensor, one host-to-device
copy a step; what the host alone needs (the widest block, which policies are present, which rows
sample) is computed here from the requests.
"""

from __future__ import annotations

import array
from dataclasses import dataclass, replace
from typing import Optional

import torch

from engine.request import FORWARD_STORE, Request

# Per-row values sent to the device each step. cache_start: a block-diffusion row's cached length (its
# exact cache holds [0, cache_start)); commits: 0 at its store pass, a forward that writes a finished
# block into the cache and commits nothing.
STEP_FIELDS = ("slot", "step", "block", "block_start", "quota", "commit_first_only", "block_length", "length",
               "prompt_len", "cache_start", "commits")
_ROW_TENSORS = ("slots", *STEP_FIELDS[1:])  # the Batch fields that hold them


def _step_fields(request: Request) -> tuple[int, ...]:
    first_only = request.params.commit_first_at_block_start and request.step == 0
    return (request.slot, request.step, request.block, request.block_start, request.rank_quota(), int(first_only),
            request.block_length, request.length, request.prompt_len, request.cached,
            int(request.forward_kind() != FORWARD_STORE))


def _slot_range(requests: list[Request]) -> Optional[slice]:
    first = requests[0].slot
    return slice(first, first + len(requests)) if all(r.slot == first + b for b, r in enumerate(requests)) else None


@dataclass(frozen=True)
class Batch:
    """The rows of one step, in slot order; every tensor is [B] on the model's device."""

    requests: list[Request]
    slots: torch.Tensor
    step: torch.Tensor
    block: torch.Tensor
    block_start: torch.Tensor  # canvas index of the row's block
    quota: torch.Tensor  # tokens a rank policy commits this step (read by those alone)
    commit_first_only: torch.Tensor  # Fast-dLLM's Dream decoder at a block's first step
    block_length: torch.Tensor
    length: torch.Tensor  # prompt + canvas
    prompt_len: torch.Tensor
    cache_start: torch.Tensor
    commits: torch.Tensor
    # host facts of the rows
    width: int  # the widest block
    policies: frozenset[str]
    sampled: tuple[tuple[int, torch.Generator, float], ...]  # (row, generator, temperature) of sampling rows
    max_top_k: int
    any_top_p: bool
    any_min_p: bool
    logprob_k: int  # top alternatives to report (the most any row asks); -1: no row wants logprobs
    at_block_start: bool  # some row is at its block's first step
    commit_first: bool  # some row commits its block's first token alone this step
    edit_fill: bool  # some block-edit row is at its block's step limit (it fills the block)
    slot_range: Optional[slice]  # the slots as a range when consecutive: KV store views, not copies

    @classmethod
    def build(cls, requests: list[Request], device: torch.device) -> Batch:
        rows = [_step_fields(r) for r in requests]
        flat = array.array("q", [value for row in rows for value in row])
        fields = torch.frombuffer(flat, dtype=torch.long).view(len(rows), len(STEP_FIELDS))
        columns = dict(zip(STEP_FIELDS, fields.to(device, non_blocking=True).unbind(1), strict=True))
        return cls(requests=requests, slots=columns.pop("slot"), **columns,
                   width=max(r.block_length for r in requests),
                   policies=frozenset(r.policy for r in requests),
                   sampled=tuple((b, r.generator, r.params.temperature) for b, r in enumerate(requests)
                                 if r.generator is not None),
                   max_top_k=max(r.params.top_k_on for r in requests),
                   any_top_p=any(r.params.top_p is not None and r.params.top_p < 1 for r in requests),
                   any_min_p=any(bool(r.params.min_p) for r in requests),
                   logprob_k=max((r.params.logprobs for r in requests if r.params.logprobs is not None), default=-1),
                   at_block_start=any(r.step == 0 for r in requests),
                   commit_first=any(row[STEP_FIELDS.index("commit_first_only")] for row in rows),
                   edit_fill=any(r.at_step_limit for r in requests),
                   slot_range=_slot_range(requests))

    def rows(self, index: list[int]) -> Batch:
        """These rows alone, in this order: one forward's rows, their per-row tensors gathered (the
        host facts stay the step's: its widest block is the width of every forward's logits)."""
        at = torch.tensor(index).to(self.slots.device, non_blocking=True)
        requests = [self.requests[b] for b in index]
        gathered = {name: getattr(self, name)[at] for name in _ROW_TENSORS}
        return replace(self, requests=requests, slot_range=_slot_range(requests), **gathered)

    def __len__(self) -> int:
        return len(self.requests)
