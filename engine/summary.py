"""The one summary a step transfers to the host: its layout, encoder and decoder in one place.

Per row: the step's counts, the block's new tokens and, when a row asked for logprobs, every block
position's logprob and top-k. Counts and token ids are integers below 2**53 and logprobs are float32,
so one float64 tensor carries all of them exactly: one device-to-host copy a step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

import torch

# Counts before the block's tokens. undecided: the block's positions still undecided (its mode's
# progress measure: masks left). band_high / band_low count a block's first step's candidates by
# first-step confidence (0 in a step where no row is at its block's first step). end_pos: the block's
# first end token; first_undecided: its first undecided position; each the block width when there is
# none. An end token ends the row only with nothing undecided before it (end_pos < first_undecided).
# edited: token edits (block-edit); end_committed: end tokens among the step's commits (eos_early_stop).
COUNTS = ("committed", "undecided", "forced", "band_high", "band_low", "grinding_exit", "end_pos",
          "first_undecided", "edited", "end_committed")


def encode(counts: Mapping[str, torch.Tensor], new_tokens: torch.Tensor,
           logprobs: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """[B, len(COUNTS) + W (+ W + 2 W k)] float64: `counts` ([B] each, by name: every one of COUNTS),
    the block's tokens [B, W], then (chosen logprob [B, W], top logprobs [B, W, k], top ids [B, W, k])."""
    assert counts.keys() == set(COUNTS), f"a summary's counts are {COUNTS}, got {sorted(counts)}"
    batch = new_tokens.shape[0]
    parts = [torch.stack([counts[name] for name in COUNTS], dim=1), new_tokens]
    if logprobs is not None:
        parts += [t.reshape(batch, -1) for t in logprobs]
    return torch.cat([p.to(torch.float64) for p in parts], dim=1)


@dataclass(frozen=True)
class RowSummary:
    """One row of a step's summary on the host."""

    committed: int
    undecided: int
    forced: int
    band_high: int
    band_low: int
    grinding_exit: int
    end_pos: int
    first_undecided: int
    edited: int
    end_committed: int
    tokens: list[int]  # the block after the step (W wide)
    _row: Sequence[float]
    _k: int

    def logprob(self, position: int) -> tuple[float, tuple[tuple[int, float], ...]]:
        """(log p of the token committed at `position`, its step's top-k as (token id, log p))."""
        width = len(self.tokens)
        base = len(COUNTS) + width
        k = self._k
        tops = base + width + position * k
        ids = base + width + width * k + position * k
        return self._row[base + position], tuple((int(self._row[ids + j]), self._row[tops + j]) for j in range(k))


def decode(host: list[list[float]], width: int, logprob_k: int) -> list[RowSummary]:
    """The rows of a summary's host copy (`logprob_k` -1: it carries no logprobs)."""
    n = len(COUNTS)
    return [RowSummary(**{name: int(v) for name, v in zip(COUNTS, row[:n], strict=True)},
                       tokens=[int(t) for t in row[n:n + width]], _row=row, _k=max(logprob_k, 0)) for row in host]
