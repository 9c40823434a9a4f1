"""From the logits of each row's current block to a predicted token and a confidence per position.

- top-k / top-p filter the logits first, as Dream's `sample_tokens` does, even at temperature 0
  (it changes the confidences, not the argmax); min_p (vLLM's) then drops every token whose
  probability is below min_p times the best one's.
- temperature 0 predicts the argmax; temperature > 0 uses Gumbel-max in float64, as LLaDA's
  `add_gumbel_noise`, with noise from the request's own seeded generator (so a row's tokens do not
  depend on what else is in the batch).
- confidence is the probability of the predicted token (the paper's Box 1 Token Confidence, which
  for the argmax is the largest probability; LLaDA "low_confidence", Fast-dLLM, CAI, Dream
  `maskgit_plus`), the negative entropy (Dream `entropy`) or the top-1 minus top-2 probability
  (Dream `topk_margin`), all from the softmax of the filtered, untempered logits.

Which rows sample, filter or use another confidence kind is known on the host from the requests'
parameters and passed in, so none of these functions reads a device value back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Optional

import torch

CONF_PROB = 0
CONF_NEG_ENTROPY = 1
CONF_MARGIN = 2
_ENTROPY_EPS = 1e-10  # Dream adds it inside the log


def filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, max_top_k: int,
                       any_top_p: bool) -> torch.Tensor:
    """Dream's `top_p_logits` then `top_k_logits`, per row: top_k 0 and top_p 1 mean "off".

    logits [B, W, V]; removed entries become the dtype's lowest value, as in Dream. `max_top_k` (the
    largest top_k of the rows, 0 if none) and `any_top_p` come from the host."""
    lowest = torch.finfo(logits.dtype).min
    if any_top_p:
        sorted_logits, sorted_index = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative > top_p[:, None, None]
        remove[..., 1:] = remove[..., :-1].clone()  # keep the first token above the threshold
        remove[..., 0] = False
        remove &= (top_p < 1)[:, None, None]
        logits = logits.masked_fill(torch.zeros_like(remove).scatter(-1, sorted_index, remove), lowest)
    if max_top_k > 0:
        k = top_k.clamp(min=1, max=logits.shape[-1])
        kth = logits.topk(min(max_top_k, logits.shape[-1]), dim=-1).values.gather(
            -1, (k - 1)[:, None, None].expand(-1, logits.shape[1], 1))
        remove = (logits < kth) & (top_k > 0)[:, None, None]
        logits = logits.masked_fill(remove, lowest)
    return logits


def filter_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """vLLM's min_p, per row (0 = off): tokens below min_p x the top probability are removed. The
    threshold is taken in log space: p_v < min_p * p_max  <=>  l_v < l_max + log(min_p)."""
    lowest = torch.finfo(logits.dtype).min
    floor = logits.amax(dim=-1, keepdim=True) + torch.log(min_p)[:, None, None]
    return logits.masked_fill((logits < floor) & (min_p > 0)[:, None, None], lowest)


def token_logprobs(logits: torch.Tensor, x0: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """log p of each predicted token [B, W] and the k most likely tokens' log p and ids [B, W, k],
    from the raw logits (before any filter or temperature: vLLM's default "raw" logprobs)."""
    logp = logits.float().log_softmax(dim=-1)
    chosen = logp.gather(-1, x0[..., None]).squeeze(-1)
    top = logp.topk(k, dim=-1) if k > 0 else None
    empty = logp.new_zeros(*x0.shape, 0)
    return (chosen, empty if top is None else top.values,
            empty.long() if top is None else top.indices)


def _best_but(scores: torch.Tensor, excluded: int) -> torch.Tensor:
    """argmax over the last dimension, never `excluded` (a copy with that entry at -inf: cheaper
    than a top-2 here, and exactly the argmax wherever `excluded` is not the best)."""
    scores = scores.clone()
    scores[..., excluded] = float("-inf")
    return scores.argmax(dim=-1)


def predict(logits: torch.Tensor, sampled: Sequence[tuple[int, torch.Generator, float]],
            mask_id: int, mask_rows: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Predicted token per position [B, W]: argmax, or Gumbel-max for the rows in `sampled`
    (row, its generator, its temperature > 0); and the greedy best token other than the mask [B, W]
    (`block-edit` fills a block with it at its step limit).

    DECISION: the mask token is never predicted, except in `mask_rows` ([B] bool: `block-edit`,
    LLaDA2.1's decoder, which takes the argmax over the whole vocabulary, so that an edit may mask a
    position again). A committed mask would leave its position masked, and a policy that commits
    until no mask is left (threshold) would loop forever on it; the official decoders do not guard
    this. It changes nothing where the mask is not the best token, as in every golden run of the
    official code (tests/parity/test_golden_decoding.py). Confidences still come from the full softmax."""
    unmasked = _best_but(logits, mask_id)
    x0 = unmasked if mask_rows is None else torch.where(mask_rows[:, None], logits.argmax(dim=-1), unmasked)
    if sampled and x0 is unmasked:
        x0 = unmasked.clone()
    for row, generator, tau in sampled:
        noise = torch.rand(logits.shape[1:], generator=generator, dtype=torch.float64, device=logits.device)
        # argmax(exp(l) / (-log u)^tau) of LLaDA's add_gumbel_noise, taken in log space (no overflow)
        gumbel = logits[row].double() - tau * torch.log(-torch.log(noise))
        best = _best_but(gumbel, mask_id)
        x0[row] = best if mask_rows is None else torch.where(mask_rows[row], gumbel.argmax(dim=-1), best)
    return x0, unmasked


def box1_token_confidence(probs: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
    """Box 1: c_i = p(x_i = v | x) of the predicted token (the largest probability under argmax)."""
    return probs.gather(-1, x0[..., None]).squeeze(-1)


def confidence(logits: torch.Tensor, x0: torch.Tensor, rows_by_kind: Mapping[int, torch.Tensor]) -> torch.Tensor:
    """Confidence [B, W] float32 of each prediction: the probability (Box 1), or for the rows of
    another kind (`rows_by_kind`: kind -> [B] bool) that kind's."""
    probs = logits.float().softmax(dim=-1)
    conf = box1_token_confidence(probs, x0)
    if CONF_NEG_ENTROPY in rows_by_kind:
        neg_entropy = (probs * torch.log(probs + _ENTROPY_EPS)).sum(dim=-1)
        conf = torch.where(rows_by_kind[CONF_NEG_ENTROPY][:, None], neg_entropy, conf)
    if CONF_MARGIN in rows_by_kind:
        top2 = probs.topk(2, dim=-1).values
        conf = torch.where(rows_by_kind[CONF_MARGIN][:, None], top2[..., 0] - top2[..., 1], conf)
    return conf
