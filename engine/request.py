"""One request's state inside the engine, and what a step reports about it.

A `Request` is host-side bookkeeping only: where the row is in its canvas (block, step), a host
mirror of its generated tokens, its telemetry, and the slot whose device tensors hold the rest
(canvas, KV cache, knobs, CAI state: `engine.slots`). Everything here is updated from the one
summary a step transfers back (`engine.summary`), so no field needs a device read of its own.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from engine.decoding.params import BLOCK_SCHEDULE_POLICIES, EDIT_POLICIES, DecodeParams
from engine.decoding.policies import dream_quota, dream_transfer_fractions, fixed_quota
from engine.decoding.types import GenerationResult, RequestStats, TokenLogprob

FORWARD_FULL, FORWARD_DUAL, FORWARD_PREFIX = "full", "dual", "prefix"
# Block-diffusion rows (`block_causal`): a denoising forward of the row's block against its exact
# cache (the clean tokens not yet cached ride along in front of it), or SDAR's store pass; without
# a cache (`cache="none"`), a full forward of the window (prompt, finished blocks and the block).
FORWARD_BLOCK, FORWARD_STORE, FORWARD_WINDOW = "block", "store", "window"


@dataclass(frozen=True)
class StepOutput:
    """What one step did for one row.

    `new_token_ids` are the generated tokens that became final since the row's last output (no
    mask before them; for `block-edit`, whose edits may change a committed token until its block
    ends, the tokens of blocks that have ended), up to and including the first end token; concatenated over a request's
    outputs they are its response followed by its end token, if any (with `ignore_eos`, every
    generated token). `new_logprobs` are their logprobs when the request asked for them (else
    empty). `fed_tokens` is the row's
    share of the step's work (tokens it fed to the model). `result` is set once, on the step that
    finished the row."""

    request_id: str
    new_token_ids: tuple[int, ...]
    committed: int
    fed_tokens: int
    result: Optional[GenerationResult] = None
    new_logprobs: tuple[TokenLogprob, ...] = ()

    @property
    def finished(self) -> bool:
        return self.result is not None

    @property
    def finish_reason(self) -> Optional[str]:
        return None if self.result is None else self.result.finish_reason


class Request:
    """Host state of one request, from `Engine.add_request` until it finishes or is aborted."""

    def __init__(self, request_id: str, prompt_ids: Sequence[int], params: DecodeParams, mask_id: int,
                 end_ids: frozenset[int], queued_at: float, block_causal: bool = False) -> None:
        self.request_id = request_id
        self.prompt_ids = tuple(prompt_ids)
        self.params = params  # resolved: no None left where the model decides
        self.prompt_len = len(self.prompt_ids)
        self.gen_length = params.gen_length
        self.block_length = params.effective_block_length
        # A block-diffusion row's blocks count from position 0 (as the model's): its first decoded
        # block starts at `origin` and holds the prompt's tail; its canvas ends at the block boundary
        # past prompt + gen_length, as the official decoders round it. Elsewhere origin = prompt_len.
        self.block_causal = block_causal
        if block_causal:
            width = self.block_length
            self.origin = self.prompt_len // width * width
            self.length = -(-(self.prompt_len + self.gen_length) // width) * width
            self.num_blocks = (self.length - self.origin) // width
        else:
            self.origin = self.prompt_len
            self.length = self.prompt_len + self.gen_length
            self.num_blocks = params.num_blocks
        self.tail = self.prompt_len - self.origin  # prompt tokens inside the first decoded block
        self.cached = 0  # block-diffusion rows: the exact cache holds positions [0, cached)
        # block-edit (LLaDA2.1): its block's tokens may change until the block ends, and a block ends
        # after post-fill forwards (`post_steps` of them so far, counted as the official decoder does)
        self.edits = params.policy in EDIT_POLICIES
        self.post_steps = 0
        self.steps_per_block = params.steps_per_block
        self.policy = params.policy
        self.mask_id = mask_id
        self.end_ids = frozenset() if params.ignore_eos else end_ids  # ignore_eos: no token ends the response
        self.dream_fractions = (dream_transfer_fractions(self.steps_per_block, params.eps)
                                if params.policy.startswith("dream-") else None)
        self.queued_at = queued_at
        self.slot = -1
        self.block = 0
        self.step = 0
        self.masked_now = self.block_length - self.tail  # masks left in the current block
        self.masked_at_block_start = self.masked_now
        # host mirror of the canvas from `origin` (the prompt's tail, then the generation)
        self.generated = list(self.prompt_ids[self.origin:]) + [mask_id] * (self.length - self.prompt_len)
        # each position's logprobs, written at the step that commits it (when asked for)
        self.logprobs: Optional[list[Optional[TokenLogprob]]] = (
            [None] * len(self.generated) if params.logprobs is not None else None)
        self.emitted = self.tail  # positions of `generated` already reported in a StepOutput
        self.end_emitted = False
        self.generator: Optional[torch.Generator] = None
        self.started = 0.0
        self.stats = RequestStats(fixed_step_budget=self.num_blocks * self.steps_per_block)

    def start(self, slot: int, device: torch.device) -> None:
        """The request takes `slot` (its device state is written by `Slots.admit`)."""
        self.slot = slot
        self.started = time.perf_counter()
        self.stats.queue_time = self.started - self.queued_at
        p = self.params
        if p.temperature > 0:
            self.generator = torch.Generator(device=device)
            if p.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(p.seed)

    @property
    def at_step_limit(self) -> bool:
        """A block-edit row's step is its block's last allowed one (`max_steps_per_block`)."""
        return self.edits and self.step + 1 >= self.params.max_steps_per_block

    @property
    def block_start(self) -> int:
        """Canvas index of the current block's first token."""
        return self.origin + self.block * self.block_length

    def forward_kind(self) -> str:
        p = self.params
        if self.block_causal:
            if p.cache == "none":
                return FORWARD_WINDOW
            return FORWARD_STORE if p.store_pass and self.cached < self.block_start else FORWARD_BLOCK
        if p.cache == "none" or self.step == 0 or (p.refresh_interval and self.step % p.refresh_interval == 0):
            return FORWARD_FULL
        return FORWARD_DUAL if p.cache == "dual" else FORWARD_PREFIX

    def rank_quota(self) -> int:
        """Tokens the rank policies (LLaDA's fixed schedule, Dream's) commit this step; block-edit's
        num_to_transfer (the fewest it commits while masks are left)."""
        if self.edits:
            return self.params.num_to_transfer
        if self.policy in BLOCK_SCHEDULE_POLICIES:  # the official block decoders: from the block length
            return fixed_quota(self.block_length, self.steps_per_block, self.step)
        if self.dream_fractions is None:
            return fixed_quota(self.masked_at_block_start, self.steps_per_block, self.step)
        return dream_quota(self.masked_now, self.dream_fractions[min(self.step, self.steps_per_block - 1)],
                           last_step=self.step >= self.steps_per_block - 1)

    def take_new_final(self, stable: int) -> tuple[tuple[int, ...], tuple[TokenLogprob, ...]]:
        """The generated tokens in [emitted, stable) not yet reported, stopping after an end token,
        and their logprobs (empty unless asked for)."""
        if self.end_emitted or stable <= self.emitted:
            return (), ()
        start = self.emitted
        new = self.generated[start:stable]
        for i, token in enumerate(new):
            if token in self.end_ids:
                new = new[:i + 1]
                self.end_emitted = True
                break
        self.emitted = stable
        logprobs = () if self.logprobs is None else tuple(self.logprobs[start:start + len(new)])
        return tuple(new), logprobs  # type: ignore[return-value]

    def first_end(self, stop: Optional[int] = None) -> Optional[int]:
        """Index in the response (generated[tail:stop]) of its first end token."""
        return next((i for i, t in enumerate(self.generated[self.tail:stop]) if t in self.end_ids), None)


def finish(request: Request, reason: str, generated: list[int], end: Optional[int]) -> GenerationResult:
    """The request's result: `generated` are its response positions from the prompt's end on."""
    request.stats.wall_time = time.perf_counter() - request.started
    logprobs = None if request.logprobs is None else list(request.logprobs[request.tail:request.tail + len(generated)])
    return GenerationResult(request.request_id, request.prompt_ids, generated, reason, request.stats,
                            end_index=end, logprobs=logprobs)  # type: ignore[arg-type]

