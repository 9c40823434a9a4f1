"""What comes out of the engine for a request: its result, telemetry and logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

FINISH_STOP = "stop"  # an end token was generated
FINISH_LENGTH = "length"  # the canvas filled without an end token
FINISH_ABORT = "abort"


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability at the step that committed it, and that step's top
    alternatives (token id, log p), most likely first (`DecodeParams.logprobs` of them)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class RequestStats:
    """Per-request telemetry (issue: NFE, steps per block, steps saved, commits, bands, time)."""

    fixed_step_budget: int  # blocks x steps per block: what the fixed decoder would spend
    nfe: int = 0  # forward passes this request took part in
    steps_per_block: list[int] = field(default_factory=list)
    tokens_per_step: list[int] = field(default_factory=list)
    forced_commits: int = 0  # committed below their threshold: budgets, grinding, block end
    grinding_exits: int = 0
    token_edits: int = 0  # block-edit: unmasked tokens replaced by another prediction (or masked again)
    # first-step confidence of every token masked at its block's first step: > 0.5, 0.25-0.5, < 0.25
    first_step_confidence_bands: list[int] = field(default_factory=lambda: [0, 0, 0])
    queue_time: float = 0.0
    wall_time: float = 0.0
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache (engine.prefix_cache)

    @property
    def steps(self) -> int:
        return sum(self.steps_per_block)

    @property
    def blocks(self) -> int:
        """Blocks (a uniform-noise model: canvases) decoded: one entry of `steps_per_block` each."""
        return len(self.steps_per_block)

    @property
    def steps_saved(self) -> int:
        """Steps below the fixed budget (blocks skipped by early exit count as saved); 0 when the row
        took more steps than the budget (a threshold policy may), never negative: `steps` says how many."""
        return max(0, self.fixed_step_budget - self.steps)

    def as_dict(self) -> dict:
        return {"nfe": self.nfe, "steps_per_block": self.steps_per_block, "steps_saved": self.steps_saved,
                "fixed_step_budget": self.fixed_step_budget, "tokens_per_step": self.tokens_per_step,
                "forced_commits": self.forced_commits, "grinding_exits": self.grinding_exits,
                "token_edits": self.token_edits,
                "first_step_confidence_bands": dict(zip(("gt_0.5", "0.25_to_0.5", "lt_0.25"),
                                                        self.first_step_confidence_bands, strict=True)),
                "wall_time": self.wall_time}


@dataclass
class GenerationResult:
    request_id: str
    prompt_ids: tuple[int, ...]
    generated_ids: list[int]  # up to and including the end token when early exit stopped the row
    finish_reason: str
    stats: RequestStats
    end_index: Optional[int] = None  # index in generated_ids of the first end token, if any
    text: Optional[str] = None  # the response text (up to the end token), when a tokenizer was given
    logprobs: Optional[list[TokenLogprob]] = None  # one per generated id, when DecodeParams.logprobs is set

    @property
    def response_ids(self) -> list[int]:
        """The generated ids before the first end token: what the text is made of."""
        return self.generated_ids if self.end_index is None else self.generated_ids[:self.end_index]

    @property
    def response_logprobs(self) -> Optional[list[TokenLogprob]]:
        """The logprobs of `response_ids`, when they were asked for."""
        return None if self.logprobs is None else self.logprobs[:len(self.response_ids)]
