"""One request's state inside the engine, and what a step reports about it.

A `Request` is host-side bookkeeping only: where the row is in its canvas (block, step), a host
mirror of its generated tokens (`HostMirror`), its telemetry, and the slot whose device tensors hold the rest
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

from engine.decoding.draws import request_generator
from engine.decoding.params import DecodeParams
from engine.decoding.registry import POLICIES, Policy
from engine.decoding.types import GenerationResult, RequestStats, TokenLogprob


@dataclass(frozen=True)
class Geometry:
    """Where a row's canvas lies: its first decoded block starts at canvas index `origin` (the
    prompt's end, or for a block-diffusion row the block boundary before it, so that the block holds
    the prompt's tail) and its last block ends at `length`; blocks are `block_length` wide and take at
    most `steps_per_block` forwards each (the mode's: a uniform-noise canvas's step cap)."""

    origin: int
    length: int
    block_length: int
    steps_per_block: int

    @property
    def num_blocks(self) -> int:
        return (self.length - self.origin) // self.block_length


@dataclass(frozen=True)
class Resolved:
    """A request as the engine will run it, resolved once (`Engine.resolve`): its prompt, its
    parameters with every model default filled, and where its canvas lies. The server prices it
    (`--max-decode-steps`) and submits this same object."""

    prompt_ids: tuple[int, ...]
    params: DecodeParams
    geometry: Geometry


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


class HostMirror:
    """The host's copy of a row's canvas from its origin (the prompt's tail, then the generation, each
    position as its last step wrote it), each position's logprobs (written at the step that commits
    it, when asked for), and how much of it has been reported."""

    def __init__(self, tail_ids: Sequence[int], blank: int, positions: int, logprobs: bool) -> None:
        self.tokens = list(tail_ids) + [blank] * positions
        self.logprobs: Optional[list[Optional[TokenLogprob]]] = [None] * len(self.tokens) if logprobs else None
        self.emitted = len(tail_ids)  # positions already reported in a StepOutput
        self.end_emitted = False

    def take_new_final(self, stable: int, end_ids: frozenset[int]) -> tuple[tuple[int, ...], tuple[TokenLogprob, ...]]:
        """The tokens in [emitted, stable) not yet reported, stopping after an end token, and their
        logprobs (empty unless asked for)."""
        if self.end_emitted or stable <= self.emitted:
            return (), ()
        start = self.emitted
        new = self.tokens[start:stable]
        for i, token in enumerate(new):
            if token in end_ids:
                new = new[:i + 1]
                self.end_emitted = True
                break
        self.emitted = stable
        logprobs = () if self.logprobs is None else tuple(self.logprobs[start:start + len(new)])
        return tuple(new), logprobs  # type: ignore[return-value]


class Request:
    """Host state of one request, from `Engine.add_request` until it finishes or is aborted."""

    def __init__(self, request_id: str, prompt_ids: Sequence[int], params: DecodeParams, geometry: Geometry,
                 blank: int, end_ids: frozenset[int], queued_at: float) -> None:
        """`blank`: what its mode's undecided positions hold (the mask id, or a uniform-noise -1)."""
        self.request_id = request_id
        self.prompt_ids = tuple(prompt_ids)
        self.params = params  # resolved: no None left where the model decides
        self.geometry = geometry
        self.cached = 0  # a cached mode's exact cache holds positions [0, cached)
        self.block_hashes: list[bytes] = []  # the prefix cache's chain over the blocks of [0, cached) it has seen
        self.post_steps = 0  # forwards of the current block that ended with no mask left (block-edit's rule)
        self.end_ids = frozenset() if params.ignore_eos else end_ids  # ignore_eos: no token ends the response
        self.queued_at = queued_at
        self.slot = -1
        self.block = 0
        self.step = 0
        self.undecided = self.block_length - self.tail  # positions of the current block not decided yet
        self.undecided_at_block_start = self.undecided
        self.schedule = None if self.policy.schedule is None else self.policy.schedule(self)
        # host mirror of the canvas from `origin` (the prompt's tail, then the generation)
        self.mirror = HostMirror(self.prompt_ids[self.origin:], blank, self.length - self.prompt_len,
                                 params.logprobs is not None)
        self.generator: Optional[torch.Generator] = None  # a sampling row's (temperature > 0)
        self.started = 0.0
        self.stats = RequestStats(fixed_step_budget=self.num_blocks * self.steps_per_block)

    # where its canvas lies (its mode's geometry) and what its parameters fix

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def gen_length(self) -> int:
        return self.params.gen_length

    @property
    def policy(self) -> Policy:
        return POLICIES[self.params.policy]

    @property
    def origin(self) -> int:
        return self.geometry.origin

    @property
    def length(self) -> int:
        return self.geometry.length

    @property
    def block_length(self) -> int:
        return self.geometry.block_length

    @property
    def steps_per_block(self) -> int:
        return self.geometry.steps_per_block

    @property
    def num_blocks(self) -> int:
        return self.geometry.num_blocks

    @property
    def tail(self) -> int:
        """Prompt tokens inside the first decoded block."""
        return self.prompt_len - self.origin

    def move_to(self, slot: int) -> None:
        """The request's row now lives in `slot` (`Slots.move` moved its device state)."""
        self.slot = slot

    def start(self, slot: int, device: torch.device) -> None:
        """The request takes `slot` (its device state is written by `Slots.admit`)."""
        self.slot = slot
        self.started = time.perf_counter()
        self.stats.queue_time = self.started - self.queued_at
        if self.params.temperature > 0:
            self.generator = request_generator(self.params.seed, device)

    @property
    def block_start(self) -> int:
        """Canvas index of the current block's first token."""
        return self.origin + self.block * self.block_length

    def first_end(self, stop: Optional[int] = None) -> Optional[int]:
        """Index in the response (the mirror's tokens [tail, stop)) of its first end token."""
        return next((i for i, t in enumerate(self.mirror.tokens[self.tail:stop]) if t in self.end_ids), None)


def finish(request: Request, reason: str, generated: list[int], end: Optional[int]) -> GenerationResult:
    """The request's result: `generated` are its response positions from the prompt's end on."""
    request.stats.wall_time = time.perf_counter() - request.started
    recorded = request.mirror.logprobs
    logprobs = None if recorded is None else list(recorded[request.tail:request.tail + len(generated)])
    return GenerationResult(request.request_id, request.prompt_ids, generated, reason, request.stats,
                            end_index=end, logprobs=logprobs)  # type: ignore[arg-type]

