"""Uniform-noise decoding policies (DiffusionGemma): pure batched functions over a step's canvases.

A canvas of `canvas_length` tokens starts as uniform random ids; every step the decoder's logits are
tempered (T from t_max down towards t_min), every position is sampled, and a policy says which
samples the canvas keeps (the rest are re-randomised) and whether the canvas is done (its argmax is
then committed). Inputs are [B, CL] / [B] tensors of the step's rows; no function reads a value back
to the host.

- `dg-official`: transformers' DiffusionGemma `generate()` (5.23.0, fixture README sections 5.4-5.5):
  the entropy-bound acceptance (`entropy_bound_accept`) and the stop rule (`official_stop`).
- `dg-converge`: the paper's convergence ideas carried over to a canvas (docs/decoding.md):
  per-position settling (a position whose accepted sample has not changed for `settle_steps` steps
  keeps its token and stops taking the entropy budget), Box 4's relaxing end thresholds across
  canvases (the confidence threshold grows by `canvas_relax` per canvas over 4 tiers), and Box 7's
  grinding detector on the accepted set (it has grown by less than eta x canvas for `patience`
  steps while the argmax is stable: the canvas is committed).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

import torch

# The official library defaults (`_get_default_generation_params`, transformers 5.23.0), for a
# checkpoint whose generation_config.json leaves a field out.
OFFICIAL = {"max_denoising_steps": 48, "entropy_bound": 0.1, "t_min": 0.4, "t_max": 0.8, "stability_threshold": 1,
            "confidence_threshold": 0.005}
BOX4_TIERS = 4  # the paper's end-threshold tiers (Box 4): later canvases keep the last tier's value


@dataclass(frozen=True)
class CanvasInputs:
    """A step of every row's canvas."""

    entropy: torch.Tensor  # [B, CL] float32 entropy of softmax(logits / T) per position
    canvas_in: torch.Tensor  # [B, CL] the canvas the decoder read
    sampled: torch.Tensor  # [B, CL] a sample of softmax(logits / T) per position
    renoise: torch.Tensor  # [B, CL] fresh uniform ids
    stable: torch.Tensor  # [B] consecutive steps whose argmax equalled the previous one (this step's included)
    canvas_index: torch.Tensor  # [B] 0-based canvas of the row
    knobs: Mapping[str, torch.Tensor]  # [B] each declared device knob, by name
    accepted_before: torch.Tensor  # [B] positions the previous step accepted (0 at a canvas's first step)
    # the policies' row state (registry: Policy.state), by name: dg-converge's `settled` [B, CL] (steps
    # each position's accepted sample has stayed the same) and `low_yield` [B] (Box 7's counter:
    # consecutive steps the accepted set did not grow enough)
    state: Mapping[str, torch.Tensor]


@dataclass
class CanvasDecision:
    next_canvas: torch.Tensor  # [B, CL]
    accepted: torch.Tensor  # [B, CL] the samples kept
    done: torch.Tensor  # [B] the canvas is committed now (the step cap is the mode's)
    state: Optional[dict[str, torch.Tensor]] = None  # the row state to store back, by name
    grinding_exit: Optional[torch.Tensor] = None  # [B] done by the grinding detector


def temperature(step: torch.Tensor, knobs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """[B] float32: T = t_min + (t_max - t_min) * cur_step / N at the row's 0-based step, cur_step =
    N - step (N..1: t_min itself is never reached), as the official loop evaluates it in float32;
    times the request's `temperature`, a scale on the whole schedule. 1 (the OpenAI default) and 0
    leave it as it is: a canvas drawn from noise has no greedy decode, so 0 means the schedule too."""
    steps = knobs["max_denoising_steps"]
    fraction = (steps - step).float() / steps.float()
    schedule = knobs["t_min"] + (knobs["t_max"] - knobs["t_min"]) * fraction
    scale = knobs["temperature"]
    return schedule * torch.where(scale > 0, scale, 1).to(schedule.dtype)


def entropy(scaled: torch.Tensor) -> torch.Tensor:
    """[B, CL] float32 entropy of softmax(scaled), as torch.distributions.Categorical computes it (the
    official code's), without its argument check (a host read)."""
    log_p = scaled - scaled.logsumexp(dim=-1, keepdim=True)
    return -(log_p.clamp(min=torch.finfo(log_p.dtype).min) * log_p.softmax(dim=-1)).sum(dim=-1)


def entropy_bound_accept(entropy: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """[B, CL] bool: by ascending entropy, a position is kept when the entropies before it sum to at
    most the row's bound (the lowest-entropy position always is; float32 sums, as officially)."""
    ascending, order = entropy.sort(dim=-1)
    keep = ascending.cumsum(dim=-1) - ascending <= bound[:, None]
    return torch.zeros_like(keep).scatter(-1, order, keep)


def official_stop(stable: torch.Tensor, mean_entropy: torch.Tensor, knobs: Mapping[str, torch.Tensor],
                  confidence: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[B] bool: the argmax equalled the last `stability_threshold` argmax canvases and the mean
    entropy is strictly below the confidence threshold (`confidence`, default the knob's); never
    without `adaptive_stop`."""
    threshold = knobs["confidence_threshold"] if confidence is None else confidence
    return knobs["adaptive_stop"] & (stable >= knobs["stability_threshold"]) & (mean_entropy < threshold)


def decide_official(x: CanvasInputs) -> CanvasDecision:
    """dg-official: the entropy-bound samples are kept, the rest re-randomised; the stop rule."""
    accepted = entropy_bound_accept(x.entropy, x.knobs["entropy_bound"])
    return CanvasDecision(torch.where(accepted, x.sampled, x.renoise), accepted,
                          official_stop(x.stable, x.entropy.mean(dim=-1), x.knobs))


def relaxed_confidence(threshold: torch.Tensor, canvas_index: torch.Tensor, relax: torch.Tensor) -> torch.Tensor:
    """Box 4 carried over: the confidence (mean-entropy) threshold of canvas c is threshold x (1 +
    relax x tier), tier = min(c, 3): later canvases stop sooner, the first keeps the official value."""
    tier = canvas_index.clamp(max=BOX4_TIERS - 1).float()
    return threshold * (1 + relax * tier)


def settle(settled: torch.Tensor, accepted: torch.Tensor, sampled: torch.Tensor, canvas_in: torch.Tensor,
           settle_steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position settling: (frozen [B, CL], the counts after this step). A position is frozen once
    its accepted sample has equalled the token it was fed for `settle_steps` steps (0: never); a
    frozen position stays frozen for the rest of the canvas."""
    on = (settle_steps > 0)[:, None]
    frozen = on & (settled >= settle_steps[:, None])
    same = accepted & (sampled == canvas_in)
    counts = torch.where(frozen | same, settled + 1, 0)
    return frozen, counts


def grinding(accepted: torch.Tensor, accepted_before: torch.Tensor, flat_steps: torch.Tensor,
             eta: torch.Tensor, patience: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Box 7 on a canvas: eta_t = (accepted now - accepted before) / CL; `patience` consecutive steps
    with eta_t < eta fire. Returns (the counter after this step, fired)."""
    growth = (accepted.sum(dim=-1) - accepted_before).float() / accepted.shape[-1]
    counter = torch.where(growth < eta, flat_steps + 1, 0)
    return counter, counter >= patience


def decide_converge(x: CanvasInputs) -> CanvasDecision:
    """dg-converge: frozen positions keep their token and take no entropy budget; the others follow
    the entropy bound; the canvas ends by the relaxed stop rule or the grinding detector (with a
    stable argmax)."""
    k = x.knobs
    settled_before, flat_before = x.state["settled"], x.state["low_yield"]
    frozen_before = (k["settle_steps"] > 0)[:, None] & (settled_before >= k["settle_steps"][:, None])
    budget_entropy = torch.where(frozen_before, 0.0, x.entropy)  # sorted first, summing to nothing
    accepted = entropy_bound_accept(budget_entropy, k["entropy_bound"]) | frozen_before
    frozen, settled = settle(settled_before, accepted, x.sampled, x.canvas_in, k["settle_steps"])
    next_canvas = torch.where(frozen, x.canvas_in, torch.where(accepted, x.sampled, x.renoise))
    confidence = relaxed_confidence(k["confidence_threshold"], x.canvas_index, k["canvas_relax"])
    stop = official_stop(x.stable, x.entropy.mean(dim=-1), k, confidence)
    flat, fired = grinding(accepted, x.accepted_before, flat_before, k["eta"], k["patience"])
    cut = fired & k["adaptive_stop"] & (x.stable >= k["stability_threshold"]) & ~stop
    return CanvasDecision(next_canvas, accepted, stop | cut, {"settled": settled, "low_yield": flat}, cut)
