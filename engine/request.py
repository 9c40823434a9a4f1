"""One request's state inside the engine, and what a step reports about it.

A `Request` is host-side bookkeeping only: where the row is in its canvas (block, step), a host
mirror of its generated tokens, its telemetry, and the slot whose device tensors hold the rest
(canvas, KV cache, knobs, policy state: `engine.slots`). Everything here is updated from the one
summary a step transfers back (`engine.summary`), so no field needs a device read of its own.
Where its canvas lies is its decoding mode's (`Geometry`, from `engine.mode`); how it advances is
`engine.advance`'s.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from engine.decoding.params import DecodeParams
from engine.decoding.registry import POLICIES
from engine.decoding.types import GenerationResult, RequestStats, TokenLogprob


@dataclass(frozen=True)
class Geometry:
    """Where a row's canvas lies: its first decoded block starts at canvas index `origin` (the
    prompt's end, or for a block-diffusion row the block boundary before it, so that the block holds
    the prompt's tail) and its last block ends at `length`; blocks are `block_length` wide."""

    origin: int
    length: int
    block_length: int


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
    finished the row. `cached_tokens`: its prompt tokens restored from the prefix cache."""

    request_id: str
    new_token_ids: tuple[int, ...]
    committed: int
    fed_tokens: int
    result: Optional[GenerationResult] = None
    new_logprobs: tuple[TokenLogprob, ...] = ()
    cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.result is not None

    @property
    def finish_reason(self) -> Optional[str]:
        return None if self.result is None else self.result.finish_reason


class Request:
    """Host state of one request, from `Engine.add_request` until it finishes or is aborted."""

    def __init__(self, request_id: str, prompt_ids: Sequence[int], params: DecodeParams, geometry: Geometry,
                 mask_id: int, end_ids: frozenset[int], queued_at: float) -> None:
        self.request_id = request_id
        self.prompt_ids = tuple(prompt_ids)
        self.params = params  # resolved: no None left where the model decides
        self.prompt_len = len(self.prompt_ids)
        self.gen_length = params.gen_length
        self.block_length = geometry.block_length
        self.origin = geometry.origin
        self.length = geometry.length
        self.num_blocks = (self.length - self.origin) // self.block_length
        self.tail = self.prompt_len - self.origin  # prompt tokens inside the first decoded block
        self.cached = 0  # a cached mode's exact cache holds positions [0, cached)
        self.block_hashes: list[bytes] = []  # the prefix cache's chain over the blocks of [0, cached) it has seen
        self.steps_per_block = params.steps_per_block
        self.policy = POLICIES[params.policy]
        self.post_steps = 0  # block-edit's post-fill forwards in the current block (its block-end rule)
        self.mask_id = mask_id
        self.end_ids = frozenset() if params.ignore_eos else end_ids  # ignore_eos: no token ends the response
        self.queued_at = queued_at
        self.slot = -1
        self.block = 0
        self.step = 0
        self.undecided = self.block_length - self.tail  # positions of the current block not decided yet
        self.undecided_at_block_start = self.undecided
        self.schedule = None if self.policy.schedule is None else self.policy.schedule(self)
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
    def block_start(self) -> int:
        """Canvas index of the current block's first token."""
        return self.origin + self.block * self.block_length

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

