"""Packed tokens: the tokens a cached forward feeds, side by side in one row, without the padding.

Rows of one forward feed different numbers of tokens (a block-diffusion row at its block's first
step feeds the finished block in front of its block, a row just admitted feeds its prompt, a row
that runs another forward this step feeds none), and a dense [R, L] batch pads every row to the
longest. Everything in a layer but attention works token by token (norms, projections, RoPE, the
MLP or the experts), so it runs over the packed [1, T] tokens alone; attention, which needs each
row's queries against that row's cache, runs on the padded [R, L] grid, the queries scattered into
it and the outputs gathered back (`pad` / `pack`, two index operations a layer). Padding tokens
cost no matmul, and in a mixture-of-experts layer route to no expert.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class PackedTokens:
    """Where each of T packed tokens sits in the padded [rows, length] grid: input row `row[t]`,
    index `column[t]` among that row's fed tokens (a row's tokens are its first fed positions)."""

    row: torch.Tensor  # [T] long
    column: torch.Tensor  # [T] long
    start: torch.Tensor  # [rows] long: the packed index of each row's first token
    rows: int
    length: int

    @classmethod
    def where_padded(cls, fed: torch.Tensor, total: int, length: int) -> Optional[PackedTokens]:
        """Packed tokens when the rows' counts leave padding in the [R, length] grid, else None (a
        dense batch is already packed)."""
        return cls.from_counts(fed, total, length) if total < fed.shape[0] * length else None

    @classmethod
    def from_counts(cls, fed: torch.Tensor, total: int, length: int) -> PackedTokens:
        """From each row's fed count [R] (on the device) and their total, known on the host: no
        device-to-host read."""
        if total < 1:
            raise ValueError("a packed forward feeds at least one token")
        rows = fed.shape[0]
        start = torch.cumsum(fed, 0) - fed
        row = torch.repeat_interleave(torch.arange(rows, device=fed.device), fed, output_size=total)
        column = torch.arange(total, device=fed.device) - start[row]
        return cls(row, column, start, rows, length)

    @property
    def total(self) -> int:
        return self.row.shape[0]

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[R, L, ...] -> [1, T, ...]: the fed positions only."""
        return x[self.row, self.column][None]

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """[1, T, ...] -> [R, L, ...]: each token at its place, zeros at the padding."""
        out = x.new_zeros(self.rows, self.length, *x.shape[2:])
        out[self.row, self.column] = x[0]
        return out

    def take(self, x: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        """[1, T, ...] at each row's fed positions `at` [R, K]: [R, K, ...]; a position past a row's
        tokens (an output no one reads) takes some packed token."""
        return x[0][(self.start[:, None] + at).clamp(max=self.total - 1)]
