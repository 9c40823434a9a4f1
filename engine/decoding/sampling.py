"""From the logits of each row's current block to a predicted token and a confidence per position.

- top-k / top-p filter the logits first, as Dream's `sample_tokens` does, even at temperature 0
  (it changes the confidences, not the argmax).
- temperature 0 predicts the argmax; temperature > 0 uses Gumbel-max in float64, as LLaDA's
  `add_gumbel_noise`, with noise from the request's own seeded generator (so a row's tokens do not
  depend on what else is in the batch).
- confidence is the probability of the predicted token (LLaDA "low_confidence", Fast-dLLM, CAI,
  Dream `maskgit_plus`), the negative entropy (Dream `entropy`) or the top-1 minus top-2
  probability (Dream `topk_margin`), all from the softmax of the filtered, untempered logits.
"""

from __future__ import annotations

from typing import Optional

import torch

CONF_PROB = 0
CONF_NEG_ENTROPY = 1
CONF_MARGIN = 2
_ENTROPY_EPS = 1e-10  # Dream adds it inside the log


def filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Dream's `top_p_logits` then `top_k_logits`, per row: top_k 0 and top_p 1 mean "off".

    logits [B, W, V]; removed entries become the dtype's lowest value, as in Dream."""
    lowest = torch.finfo(logits.dtype).min
    if bool((top_p < 1).any()):
        sorted_logits, sorted_index = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative > top_p[:, None, None]
        remove[..., 1:] = remove[..., :-1].clone()  # keep the first token above the threshold
        remove[..., 0] = False
        remove &= (top_p < 1)[:, None, None]
        logits = logits.masked_fill(torch.zeros_like(remove).scatter(-1, sorted_index, remove), lowest)
    if bool((top_k > 0).any()):
        k = top_k.clamp(min=1, max=logits.shape[-1])
        kth = logits.topk(int(k.max()), dim=-1).values.gather(-1, (k - 1)[:, None, None].expand(-1, logits.shape[1], 1))
        remove = (logits < kth) & (top_k > 0)[:, None, None]
        logits = logits.masked_fill(remove, lowest)
    return logits


def predict(logits: torch.Tensor, temperature: torch.Tensor,
            generators: list[Optional[torch.Generator]]) -> torch.Tensor:
    """Predicted token per position [B, W]: argmax, or Gumbel-max where temperature > 0."""
    x0 = logits.argmax(dim=-1)
    for row, generator in enumerate(generators):
        tau = float(temperature[row])
        if tau <= 0:
            continue
        noise = torch.rand(logits.shape[1:], generator=generator, dtype=torch.float64, device=logits.device)
        # argmax(exp(l) / (-log u)^tau) of LLaDA's add_gumbel_noise, taken in log space (no overflow)
        gumbel = logits[row].double() - tau * torch.log(-torch.log(noise))
        x0[row] = gumbel.argmax(dim=-1)
    return x0


def confidence(logits: torch.Tensor, x0: torch.Tensor, kind: torch.Tensor) -> torch.Tensor:
    """Confidence [B, W] float32 of each prediction, by each row's confidence kind."""
    probs = logits.float().softmax(dim=-1)
    conf = probs.gather(-1, x0[..., None]).squeeze(-1)
    if bool((kind == CONF_NEG_ENTROPY).any()):
        neg_entropy = (probs * torch.log(probs + _ENTROPY_EPS)).sum(dim=-1)
        conf = torch.where((kind == CONF_NEG_ENTROPY)[:, None], neg_entropy, conf)
    if bool((kind == CONF_MARGIN).any()):
        top2 = probs.topk(2, dim=-1).values
        conf = torch.where((kind == CONF_MARGIN)[:, None], top2[..., 0] - top2[..., 1], conf)
    return conf
