"""Decoding policies: pure functions over batched tensors, no per-row Python loops.

Every function takes the current block of each row in the batch as [B, W] tensors (W = the widest
block; positions past a row's block are never candidates) and per-row values as [B] tensors, and
says which positions to commit this step. Rows in one batch may use different policies: the
registry (`engine.decoding.registry.decide`) runs each policy present once over the whole batch and
keeps each row's own decision.

Families:
- rank (`fixed`, `dream-*`): commit the `quota` best candidates; the quota comes from LLaDA's
  `get_num_transfer_tokens` or Dream's `int(M * (1 - s/t))` schedule.
- `threshold`: Fast-dLLM — every candidate with confidence >= threshold, and always the best one.
- `block-edit` (LLaDA2.1): block-dynamic's commits of masked positions, plus token edits
  (`token_edits`) of the block's already unmasked generated positions.
- `cai`: the paper's controller (Algorithm 1), one function per box of its Method section, named and
  numbered as there: Box 1 Token Confidence (`engine.decoding.sampling`), Box 2 First-Step
  Confidence Signal, Box 3 Adaptive Threshold Schedule, Box 4 Block-Specific End Thresholds, Box 5
  Confidence-Gated Token Budget, Box 6 Position-Aware Commit Rule, Box 7 Grinding Phase Detector.
  Decisions where the paper is silent are marked DECISION and collected in docs/cai.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

NEG_INF = float("-inf")

# Paper constants, defined for a 64-token block and 64 steps per block (Boxes 4-6). They scale with
# the block length (position boundaries) and with the steps per block (budgets): DECISION.
PAPER_BLOCK_LENGTH = 64
PAPER_STEPS_PER_BLOCK = 64
PAPER_BLOCK_TIERS = 4  # Box 4 defines end thresholds for blocks b = 1..4
POSITION_FACTORS = (0.80, 0.90, 1.05, 1.10)  # Box 6, quarters of the block
TOKEN_THRESHOLD_CLIP = (0.20, 0.98)  # Box 6
BUDGET_STEPS = (8, 32, 64)  # Box 5 (token budgets), in steps of a 64-step block
CONF_HIGH, CONF_LOW = 0.50, 0.25  # Box 5 budget tiers; also the telemetry bands
# A step count no row reaches: a budget or a patience that is switched off (int64 tensors hold it).
NEVER = torch.iinfo(torch.long).max


def rank_in_row(score: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """Rank of each candidate by descending score within its row (0 = best); non-candidates last."""
    keyed = score.masked_fill(~candidates, NEG_INF)
    order = keyed.argsort(dim=-1, descending=True, stable=True)
    return order.argsort(dim=-1)


def commit_best(score: torch.Tensor, candidates: torch.Tensor, quota: torch.Tensor) -> torch.Tensor:
    """The `quota[b]` best candidates of each row b."""
    return candidates & (rank_in_row(score, candidates) < quota[:, None])


def best_candidate(score: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """The best candidate of each row (the first on ties, as `commit_best` with a quota of 1); none
    in a row without candidates. One argmax instead of two sorts."""
    best = torch.where(candidates, score, NEG_INF).argmax(dim=-1, keepdim=True)
    return candidates & (torch.arange(score.shape[1], device=score.device) == best)


def fixed_quota(masked_at_block_start: int, steps_per_block: int, step: int) -> int:
    """LLaDA `get_num_transfer_tokens`: M // s per step, the first M % s steps one more. A host
    scalar: the engine knows every count it needs, so the rank policies' quotas cost no device work."""
    base, remainder = divmod(masked_at_block_start, steps_per_block)
    return base + (1 if step < remainder else 0)


def dream_quota(masked_now: int, transfer_fraction: float, last_step: bool) -> int:
    """Dream `diffusion_generate`: int(M * (1 - s/t)) in float32, every remaining mask at the last step."""
    if last_step:
        return masked_now
    return int(np.float32(masked_now) * np.float32(transfer_fraction))


def dream_transfer_fractions(steps: int, eps: float) -> list[float]:
    """(1 - s/t) for each step, from Dream's `timesteps = linspace(1, eps, steps + 1)`, in float32."""
    timesteps = torch.linspace(1, eps, steps + 1)
    return (1 - timesteps[1:] / timesteps[:-1]).tolist()


def threshold_commit(conf: torch.Tensor, candidates: torch.Tensor, threshold: torch.Tensor,
                     min_commit: torch.Tensor) -> torch.Tensor:
    """Fast-dLLM `get_transfer_index` with a threshold: conf >= threshold, plus the best candidate
    when `min_commit` is 1 (Fast-dLLM always commits it)."""
    commit = candidates & (conf >= threshold[:, None])
    best = best_candidate(conf, candidates)
    return commit | (best & (min_commit[:, None] > 0))


def token_edits(conf: torch.Tensor, x0: torch.Tensor, tokens: torch.Tensor, editable: torch.Tensor,
                editing_threshold: torch.Tensor) -> torch.Tensor:
    """LLaDA2.1's token-to-token editing: an editable position (unmasked, generated, in the block)
    takes the prediction when it differs from its token and its confidence is strictly above the
    row's editing threshold. The prediction may be the mask id: the edit then masks the position
    again, as the official decoder does."""
    return editable & (x0 != tokens) & (conf > editing_threshold[:, None])


# ---------------------------------------------------------------------------------------------- CAI


def box4_block_end_threshold(theta_e: torch.Tensor, block_index: torch.Tensor, num_blocks: torch.Tensor,
                      decay: torch.Tensor, stretch: torch.Tensor, enabled: torch.Tensor) -> torch.Tensor:
    """Box 4: theta_e^(b) = theta_e - decay * (b - 1) for b = 1..4 (block_index is 0-based).

    DECISION (more than 4 blocks): `clamp` keeps block 4's value for every later block; `stretch`
    maps the blocks onto the 4 tiers by their place in the canvas. Never below 0."""
    clamped = block_index.clamp(max=PAPER_BLOCK_TIERS - 1)
    stretched = block_index * PAPER_BLOCK_TIERS // num_blocks
    tier = torch.where(stretch, stretched, clamped).float()
    scheduled = (theta_e - decay * tier).clamp(min=0.0)
    return torch.where(enabled, scheduled, theta_e)


def box3_adaptive_threshold(step: torch.Tensor, steps_per_block: torch.Tensor, theta_s: torch.Tensor,
                        theta_end: torch.Tensor, warmup: torch.Tensor) -> torch.Tensor:
    """Box 3 (with Box 4's theta_e^(b) as theta_end): theta_s during warm-up (t < wT), then a cosine
    from theta_s down to theta_end."""
    t = step.float()
    total = steps_per_block.float()
    warm = warmup * total
    u = (t - warm) / (total - warm)
    alpha = (theta_s - theta_end) / 2
    relaxed = theta_end + alpha * (1 + torch.cos(math.pi * u))
    return torch.where(t < warm, theta_s, relaxed)


def block_quarter(width: int, block_length: torch.Tensor) -> torch.Tensor:
    """Quarter (0..3) of each position p inside its block: the paper's 16/32/48 boundaries for a
    64-token block, scaled to the block length (DECISION)."""
    p = torch.arange(width, device=block_length.device)[None, :]
    return (p * 4 // block_length[:, None]).clamp(max=3)


def box6_position_thresholds(theta_block: torch.Tensor, quarter: torch.Tensor, enabled: torch.Tensor) -> torch.Tensor:
    """Box 6: theta_i = clip(theta_b * r_pos(i), 0.20, 0.98), r_pos = 0.80 / 0.90 / 1.05 / 1.10 by the
    position's quarter; theta_b itself where `enabled` is off."""
    first, second, third, fourth = POSITION_FACTORS
    r_pos = torch.where(quarter < 2, torch.where(quarter < 1, first, second), torch.where(quarter < 3, third, fourth))
    low, high = TOKEN_THRESHOLD_CLIP
    theta = theta_block[:, None]
    return torch.where(enabled[:, None], (theta * r_pos).clamp(low, high), theta)


def budget_levels(steps_per_block: torch.Tensor) -> torch.Tensor:
    """Box 5's 8/32/64-step budgets scaled to the steps per block (DECISION), at least 1: [B, 3]."""
    return torch.stack([torch.div(steps_per_block * steps, PAPER_STEPS_PER_BLOCK, rounding_mode="floor")
                        for steps in BUDGET_STEPS], dim=1).clamp(min=1)


def box5_token_budget(first_conf: torch.Tensor, quarter: torch.Tensor, steps_per_block: torch.Tensor,
                      enabled: torch.Tensor) -> torch.Tensor:
    """Box 5: B_i = 8 if s_i > 0.5 and p < 32; 64 if s_i < 0.25 or p >= 48; else 32 (the paper's
    positions and steps for a 64-token block of 64 steps, scaled: `block_quarter`, `budget_levels`).
    A row without budgets (`enabled` off: gating off) gets budgets it never reaches (NEVER)."""
    levels = budget_levels(steps_per_block)
    small, mid, big = levels[:, 0:1], levels[:, 1:2], levels[:, 2:3]
    middle = torch.where(quarter >= 3, big, mid)
    confident = torch.where(quarter < 2, small, middle)
    budgets = torch.where(first_conf > CONF_HIGH, confident, torch.where(first_conf < CONF_LOW, big, middle))
    return torch.where(enabled[:, None], budgets, NEVER)


@dataclass
class CaiState:
    """What CAI carries from step to step within a block, per row."""

    first_conf: torch.Tensor  # [B, W] s_i = c_i^(0) (Box 2)
    low_yield: torch.Tensor  # [B] the counter l of Algorithm 1


@dataclass
class CaiKnobs:
    """Per-row CAI parameters as tensors ([B])."""

    theta_s: torch.Tensor
    theta_e: torch.Tensor
    warmup: torch.Tensor
    block_schedule: torch.Tensor
    block_decay: torch.Tensor
    stretch: torch.Tensor
    position_factors: torch.Tensor
    budgets: torch.Tensor  # budgets on (already and-ed with gating)
    grinding: torch.Tensor  # grinding detector on (already and-ed with gating)
    eta: torch.Tensor
    eta_denominator: torch.Tensor  # tokens η is a fraction of (generation or block length)
    patience: torch.Tensor
    theta_fb: torch.Tensor
    grinding_fill: torch.Tensor
    min_commit: torch.Tensor


@dataclass
class CaiDecision:
    commit: torch.Tensor  # [B, W]
    forced: torch.Tensor  # [B, W] committed below the token's threshold (budget, grinding, block end)
    low_yield: torch.Tensor  # [B] the counter after this step
    grinding_exit: torch.Tensor  # [B] the detector fired this step
    thresholds: torch.Tensor  # [B, W] theta_i(t), for telemetry and tests
    budgets: torch.Tensor  # [B, W] B_i


def box2_first_step_confidence(conf: torch.Tensor, stored: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """Box 2: s_i = c_i^(0): the confidence of the block's first step, kept for the rest of the block."""
    return torch.where((step == 0)[:, None], conf, stored)


def box6_position_aware_commit(conf: torch.Tensor, candidates: torch.Tensor, thresholds: torch.Tensor,
                               budgets: torch.Tensor, step: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Box 6's commit rule: c_i >= theta_i(t), or t >= B_i (budgets are NEVER where gating is off).
    Returns (committed by threshold, committed by budget only)."""
    by_threshold = candidates & (conf >= thresholds)
    by_budget = candidates & (step[:, None] >= budgets) & ~by_threshold
    return by_threshold, by_budget


def box7_grinding_phase_detector(committed: torch.Tensor, low_yield: torch.Tensor, eta_bar: torch.Tensor,
                                 length: torch.Tensor, patience: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Box 7: eta = newly committed / L; K = `patience` consecutive steps with eta < eta_bar fire the
    detector (a detector that is off has a patience of NEVER). Returns (the counter l after this
    step, fired). The counter restarts when the detector fires.

    DECISION: L is the generation length by default (the "sequence" being decoded);
    `eta_denominator=block` uses the block length."""
    eta = committed / length  # float32: the count converts exactly
    counter = torch.where(eta < eta_bar, low_yield + 1, 0)
    fired = counter >= patience
    return torch.where(fired, 0, counter), fired


def block_threshold(step: torch.Tensor, steps_per_block: torch.Tensor, block_index: torch.Tensor,
                    num_blocks: torch.Tensor, knobs: CaiKnobs) -> torch.Tensor:
    """theta_b(t): Box 3's schedule ending at Box 4's theta_e^(b)."""
    theta_end = box4_block_end_threshold(knobs.theta_e, block_index, num_blocks, knobs.block_decay,
                                         knobs.stretch, knobs.block_schedule)
    return box3_adaptive_threshold(step, steps_per_block, knobs.theta_s, theta_end, knobs.warmup)


def cai_step(conf: torch.Tensor, candidates: torch.Tensor, step: torch.Tensor, steps_per_block: torch.Tensor,
             block_index: torch.Tensor, num_blocks: torch.Tensor, block_length: torch.Tensor,
             state: CaiState, knobs: CaiKnobs) -> CaiDecision:
    """One step of Algorithm 1 for every row (its lines 10-29); `state.first_conf` is Box 2's s_i."""
    quarter = block_quarter(conf.shape[1], block_length)
    thresholds = box6_position_thresholds(block_threshold(step, steps_per_block, block_index, num_blocks, knobs),
                                          quarter, knobs.position_factors)
    budgets = box5_token_budget(state.first_conf, quarter, steps_per_block, knobs.budgets)
    by_threshold, by_budget = box6_position_aware_commit(conf, candidates, thresholds, budgets, step)
    commit = by_threshold | by_budget

    # DECISION (a step that commits nothing): with min_commit=1 the best candidate is committed, as
    # in Fast-dLLM, so every forward makes progress; min_commit=0 follows Algorithm 1 literally.
    # (A row without candidates has no best candidate.)
    nothing = ~commit.any(dim=1) & (knobs.min_commit > 0)
    commit = commit | (best_candidate(conf, candidates) & nothing[:, None])

    patience = torch.where(knobs.grinding, knobs.patience, NEVER)  # a detector that is off never fires
    low_yield, grinding_exit = box7_grinding_phase_detector(commit.sum(dim=1), state.low_yield, knobs.eta,
                                                            knobs.eta_denominator, patience)
    remaining = candidates & ~commit
    # DECISION (tokens left at a grinding exit): `continue` commits those above theta_fb and keeps
    # decoding the others, with the counter reset; `fill` ends the block now, committing them all
    # with their current prediction (a floor of -inf).
    floor = torch.where(knobs.grinding_fill, -math.inf, knobs.theta_fb)
    by_grinding = remaining & grinding_exit[:, None] & (conf > floor[:, None])
    # DECISION (a block never ends with masks): at the block's last step every token still masked
    # is committed with its current prediction.
    last = step >= steps_per_block - 1
    late = by_grinding | (remaining & last[:, None])
    return CaiDecision(commit | late, by_budget | late, low_yield, grinding_exit, thresholds, budgets)
