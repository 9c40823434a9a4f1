"""Likelihood of a given text under a masked diffusion model: LLaDA's Monte-Carlo estimator, per token.

A masked diffusion model has no left-to-right factorisation to read log p(x_i | x_<i) from. LLaDA
(Nie et al., 2025, Eq. 6 and its evaluation code) scores a continuation r after a context p with a
Monte-Carlo estimate of the ELBO:

    log p(r | p)  >=  E_{l ~ U{1..L}, M: l random positions of r} [ (L / l) sum_{i in M} log p(r_i | p, r_M) ]

(r_M: r with the positions in M masked)

where L = |r|. We draw the mask counts l stratified over the K samples (sample k takes
l = floor((k + u) L / K) + 1 with one shared u ~ U[0, 1): every l is equally likely over the
samples, so the mean is the same unbiased estimate, with less variance), as LLaDA's evaluation
spreads its mask ratios over a batch.

An OpenAI client (lm-evaluation-harness's `local-completions`) sends context and continuation as one
prompt and sums the per-token logprobs after the context, and the server is never told where the
context ends. So each token gets the difference of two estimates: with S_c the estimate for the
tokens from c on given the tokens before c (S_n = 0 past the end),

    logprob of token c  =  S_c - S_{c+1}        (c >= 1; the first token gets None, as in OpenAI)

and the sum over any suffix c..n-1 is exactly S_c, LLaDA's estimate for that split, whichever split
the client had in mind. The price: one estimate per split, (n - 1) x K sequences of n tokens each,
all independent, run batched. Dream's logits are shifted (output i-1 predicts token i); the
estimator reads them accordingly. Everything is seeded: the same prompt, sample count and seed give
the same numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch

from engine.models.transformer import DiffusionTransformer


def scoring_cost(num_tokens: int, samples: int) -> int:
    """Tokens fed to the model to score a prompt of `num_tokens` tokens with `samples` per split."""
    return max(0, num_tokens - 1) * samples * num_tokens


# Logits taken in one forward are at most this many floats (rows x masked positions x vocabulary).
_MAX_LOGIT_FLOATS = 1 << 26


def _masks(n: int, splits: torch.Tensor, samples: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """For every split c in `splits` and sample k: the masked positions [len(splits) K, n] bool and
    each row's weight L / l, L = n - c."""
    split = splits.repeat_interleave(samples)  # c of each row
    length = n - split  # L
    k = torch.arange(samples).repeat(len(splits))
    u = torch.rand(len(splits), generator=generator).repeat_interleave(samples)
    count = torch.floor((k + u) * length / samples).long() + 1  # l in 1..L, stratified
    scores = torch.rand(len(split), n, generator=generator)
    scores = torch.where(torch.arange(n)[None, :] < split[:, None], 2.0, scores)  # the context is never masked
    kth = scores.sort(dim=1).values.gather(1, (count - 1)[:, None])
    return scores <= kth, length / count


class ScoringJob:
    """One prompt's scoring as a sequence of forwards, run one `advance()` at a time.

    Each forward feeds at most `chunk_tokens` tokens (rows x prompt length; at least one row), so
    the server can interleave them with decode steps and no step waits on more than one of them;
    `Engine.score` runs them back to back. Every mask is drawn here, at construction, from the seed:
    how the forwards are spread in time does not change a number."""

    def __init__(self, model: DiffusionTransformer, prompt_ids: Sequence[int], samples: int, seed: int = 0,
                 splits: Optional[Sequence[int]] = None, chunk_tokens: int = 8192) -> None:
        n = len(prompt_ids)
        if samples < 1:
            raise ValueError(f"samples must be >= 1, got {samples}")
        splits = list(range(1, n) if splits is None else splits)
        if any(not 1 <= c < n for c in splits):
            raise ValueError(f"splits must lie in [1, {n})")
        self.model, self.n, self.splits, self.samples = model, n, splits, samples
        self._ids = torch.tensor(list(prompt_ids), dtype=torch.long)
        self._shift = 1 if model.logits_shifted else 0
        generator = torch.Generator().manual_seed(seed)
        self._masked, self._weight = _masks(n, torch.tensor(splits, dtype=torch.long), samples, generator)
        most = int(self._masked.sum(dim=1).max()) if splits else 1
        self._rows = max(1, min(chunk_tokens // max(1, n), _MAX_LOGIT_FLOATS // (most * model.config.vocab_size)))
        self._totals: list[torch.Tensor] = []
        self._next = 0  # the first row not run yet

    @property
    def done(self) -> bool:
        return self._next >= len(self._masked)

    @property
    def total_tokens(self) -> int:
        """Tokens the whole job feeds the model (`scoring_cost` for every split)."""
        return len(self._masked) * self.n

    @torch.inference_mode()
    def advance(self) -> int:
        """Run the next forward; returns the tokens it fed the model (0 once done)."""
        if self.done:
            return 0
        start, stop = self._next, min(self._next + self._rows, len(self._masked))
        self._totals.append(_masked_loglik(self.model, self._ids, self._masked[start:stop], self._shift))
        self._next = stop
        return (stop - start) * self.n

    def run(self) -> ScoringJob:
        while not self.done:
            self.advance()
        return self

    def sample_values(self) -> torch.Tensor:
        """The estimator's terms [len(splits), samples] (float64): for each split c and sample k,
        (L / l) * sum over its l masked positions of log p(true token). Their mean over k is S_c."""
        if not self.done:
            raise RuntimeError("the scoring job has forwards left to run")
        totals = torch.cat(self._totals) if self._totals else torch.zeros(0, dtype=torch.float64)
        return (totals * self._weight.double()).view(len(self.splits), self.samples)

    def logprobs(self) -> list[Optional[float]]:
        """Per-token estimates of the prompt (the splits must be every c in 1..n-1): None for the first
        token, then S_c - S_{c+1} for every later token c (see the module docstring)."""
        if self.n < 2:
            return [None] * self.n
        if self.splits != list(range(1, self.n)):
            raise ValueError("per-token logprobs need every split 1..n-1")
        estimate = self.sample_values().mean(dim=1)
        after = torch.cat([estimate[1:], torch.zeros(1, dtype=torch.float64)])  # S_{c+1}; S_n = 0
        return [None, *(estimate - after).tolist()]


def sample_values(model: DiffusionTransformer, prompt_ids: Sequence[int], splits: Sequence[int], samples: int,
                  seed: int = 0, max_forward_tokens: int = 8192) -> torch.Tensor:
    """The estimator's terms [len(splits), samples] (see `ScoringJob.sample_values`), all at once.
    `max_forward_tokens` bounds the tokens of one forward (rows x prompt length)."""
    return ScoringJob(model, prompt_ids, samples, seed, splits, max_forward_tokens).run().sample_values()


def split_estimates(model: DiffusionTransformer, prompt_ids: Sequence[int], splits: Sequence[int], samples: int,
                    seed: int = 0, max_forward_tokens: int = 8192) -> torch.Tensor:
    """S_c for each split c (1 <= c < n): the estimate of log p(tokens c.. | tokens before c), float64."""
    return sample_values(model, prompt_ids, splits, samples, seed, max_forward_tokens).mean(dim=1)


def prompt_logprobs(model: DiffusionTransformer, prompt_ids: Sequence[int], samples: int, seed: int = 0,
                    max_forward_tokens: int = 8192) -> list[Optional[float]]:
    """Per-token log-likelihood estimates of `prompt_ids` (see the module docstring): None for the
    first token, then S_c - S_{c+1} for every later token c."""
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    if len(prompt_ids) < 2:
        return [None] * len(prompt_ids)
    return ScoringJob(model, prompt_ids, samples, seed, chunk_tokens=max_forward_tokens).run().logprobs()


def _masked_loglik(model: DiffusionTransformer, ids: torch.Tensor, masked: torch.Tensor, shift: int) -> torch.Tensor:
    """Per row: the sum over its masked positions of log p(the true token), one forward for the rows."""
    device = model.device
    canvas = torch.where(masked, model.special.mask_id, ids[None, :])
    counts = masked.sum(dim=1, keepdim=True)
    most = int(counts.max())
    # each row's masked positions first (in order), padded with other positions where a row has fewer
    order = torch.sort((~masked).to(torch.uint8), dim=1, stable=True).indices[:, :most]
    valid = torch.arange(most)[None, :] < counts
    logits = model(canvas.to(device), logits_at=(order - shift).clamp(min=0).to(device))
    logp = logits.float().log_softmax(dim=-1)
    picked = logp.gather(-1, ids[order].to(device)[..., None]).squeeze(-1).double().cpu()
    return torch.where(valid, picked, 0.0).sum(dim=1)
